"""Build the kvcache cache a transformers model config needs."""

from __future__ import annotations

from typing import Any

from transformers import PretrainedConfig
from transformers.cache_utils import get_layer_types_and_kwargs

from ..cache import Cache
from ..encoder_decoder import EncoderDecoderCache
from ..errors import CacheInputError
from ..layer_types import LAYER_TYPE_BUILDERS, build_layer, build_static_layer, quantized
from ..layers.base import CacheLayer
from ..layers.dynamic import DynamicLayer
from ..layers.static import StaticLayer
from ..layers.static_sliding import DEFAULT_ROLLBACK_TOKENS

#: transformers layer types that cache like one of kvcache's: chunked attention keeps the last chunk like a
#: sliding window of the chunk size (only the mask differs), as in transformers' own caches.
_ALIASES = {"chunked_attention": "sliding_attention"}


def layer_for(layer_type: str, kwargs: dict[str, Any], static: dict[str, int] | None = None) -> CacheLayer:
    """The kvcache layer for one transformers layer type and its per-layer kwargs (as transformers
    derives them); with `static` (`max_cache_len`, `rollback_tokens`), its fixed-shape kind."""
    name = _ALIASES.get(layer_type, layer_type)
    if name not in LAYER_TYPE_BUILDERS:
        raise CacheInputError(
            f"config: layer type {layer_type!r} has no kvcache layer; supported: "
            f"{sorted([*LAYER_TYPE_BUILDERS, *_ALIASES])}"
        )
    window, states = kwargs.get("sliding_window"), kwargs.get("number_of_states", 1)
    if static is not None:
        return build_static_layer(name, sliding_window=window, num_states=states, **static)
    return build_layer(name, sliding_window=window, num_states=states)


def decoder_layers(config: PretrainedConfig, static: dict[str, int] | None = None,
                   quant: tuple[int, int] | None = None) -> list[CacheLayer]:  # fmt: skip
    """One fresh kvcache layer per decoder layer of `config`, following transformers' own layer typing."""
    text_config = config.get_text_config(decoder=True)
    layer_types, per_layer_kwargs = get_layer_types_and_kwargs(text_config)
    # Legacy flat encoder-decoder configs (T5) keep the decoder depth apart from num_hidden_layers.
    depth = getattr(text_config, "num_decoder_layers", None)
    if config.is_encoder_decoder and isinstance(depth, int) and depth != len(layer_types):
        if len(set(layer_types)) > 1:
            raise CacheInputError(f"config: {len(layer_types)} layer types for {depth} decoder layers")
        layer_types, per_layer_kwargs = layer_types[:1] * depth, per_layer_kwargs[:1] * depth
    layers = [layer_for(t, dict(kw), static) for t, kw in zip(layer_types, per_layer_kwargs, strict=True)]
    return layers if quant is None else [quantized(layer, *quant) for layer in layers]


def cache_from_config(
    config: PretrainedConfig,
    *,
    static: bool = False,
    max_cache_len: int | None = None,
    rollback_tokens: int = DEFAULT_ROLLBACK_TOKENS,
    kv_bits: int | None = None,
    group_size: int = 64,
) -> Cache | EncoderDecoderCache:
    """The empty kvcache cache a model built from the transformers `config` needs.

    Decoder-only: a `Cache` with one layer per model layer: `DynamicLayer` for full attention,
    `SlidingWindowLayer(window)` for sliding (and chunked) attention, `RecurrentLayer` for linear
    attention / Mamba / short-conv layers, `HybridLayer` for layers that carry both. Encoder-decoder:
    an `EncoderDecoderCache` of such a self-attention cache and one cross-attention `DynamicLayer`
    per decoder layer. Hand it to a transformers model through `as_transformers_cache`, or let
    `wrap_model` do it.

    `static=True` builds the fixed-shape kinds instead, for `torch.compile`: `StaticLayer
    (max_cache_len)`, `StaticSlidingWindowLayer`, `StaticRecurrentLayer` (each able to undo the
    last `rollback_tokens` tokens). Cross-attention layers stay `DynamicLayer`s: they are written once,
    at the encoder's length, and never change shape after that.

    `kv_bits` (8, 4 or 2): attention keys/values quantized, values in groups of `group_size` along
    head_dim and keys per channel (`QuantizedLayer`, `QuantizedSlidingWindowLayer`; not with `static=True`).
    """
    if not isinstance(config, PretrainedConfig):
        raise CacheInputError(f"cache_from_config takes a transformers config, got {type(config).__name__}")
    if not isinstance(static, bool):
        raise CacheInputError(f"static must be a bool, got {static!r}")
    spec = None
    if static:
        if max_cache_len is None:
            raise CacheInputError("cache_from_config(static=True) needs max_cache_len")
        StaticLayer(max_cache_len)  # validates it
        spec = {"max_cache_len": max_cache_len, "rollback_tokens": rollback_tokens}
    elif max_cache_len is not None:
        raise CacheInputError("max_cache_len is for static=True caches")
    if kv_bits is not None and static:
        raise CacheInputError("kv_bits is for dynamic caches (static=False)")
    quant = None
    if kv_bits is not None:
        from ..layers.quant import check_quant

        quant = check_quant(kv_bits, group_size)
    layers = decoder_layers(config, spec, quant)
    if not config.is_encoder_decoder:
        return Cache(layers)
    return EncoderDecoderCache(Cache(layers), Cache([DynamicLayer() for _ in layers]))
