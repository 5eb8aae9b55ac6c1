"""Build the kvcache cache a transformers model config needs."""

from __future__ import annotations

from typing import Any

from transformers import PretrainedConfig
from transformers.cache_utils import get_layer_types_and_kwargs

from ..cache import Cache
from ..encoder_decoder import EncoderDecoderCache
from ..errors import CacheInputError
from ..layer_types import LAYER_TYPE_BUILDERS, build_layer
from ..layers.base import CacheLayer
from ..layers.dynamic import DynamicLayer

#: transformers layer types that cache like one of kvcache's: chunked attention keeps the last chunk like a
#: sliding window of the chunk size (only the mask differs), as in transformers' own caches.
_ALIASES = {"chunked_attention": "sliding_attention"}


def layer_for(layer_type: str, kwargs: dict[str, Any]) -> CacheLayer:
    """The kvcache layer for one transformers layer type and its per-layer kwargs (as transformers derives them)."""
    name = _ALIASES.get(layer_type, layer_type)
    if name not in LAYER_TYPE_BUILDERS:
        raise CacheInputError(
            f"config: layer type {layer_type!r} has no kvcache layer; supported: "
            f"{sorted([*LAYER_TYPE_BUILDERS, *_ALIASES])}"
        )
    return build_layer(name, sliding_window=kwargs.get("sliding_window"), num_states=kwargs.get("number_of_states", 1))


def decoder_layers(config: PretrainedConfig) -> list[CacheLayer]:
    """One fresh kvcache layer per decoder layer of `config`, following transformers' own layer typing."""
    text_config = config.get_text_config(decoder=True)
    layer_types, per_layer_kwargs = get_layer_types_and_kwargs(text_config)
    # Legacy flat encoder-decoder configs (T5) keep the decoder depth apart from num_hidden_layers.
    depth = getattr(text_config, "num_decoder_layers", None)
    if config.is_encoder_decoder and isinstance(depth, int) and depth != len(layer_types):
        if len(set(layer_types)) > 1:
            raise CacheInputError(f"config: {len(layer_types)} layer types for {depth} decoder layers")
        layer_types, per_layer_kwargs = layer_types[:1] * depth, per_layer_kwargs[:1] * depth
    return [layer_for(t, dict(kw)) for t, kw in zip(layer_types, per_layer_kwargs, strict=True)]


def cache_from_config(config: PretrainedConfig) -> Cache | EncoderDecoderCache:
    """The empty kvcache cache a model built from the transformers `config` needs.

    Decoder-only: a `Cache` with one layer per model layer: `DynamicLayer` for full attention,
    `SlidingWindowLayer(window)` for sliding (and chunked) attention, `RecurrentLayer` for linear
    attention / Mamba / short-conv layers, `HybridLayer` for layers that carry both. Encoder-decoder:
    an `EncoderDecoderCache` of such a self-attention cache and one cross-attention `DynamicLayer`
    per decoder layer. Hand it to a transformers model through `as_transformers_cache`, or let
    `wrap_model` do it.
    """
    if not isinstance(config, PretrainedConfig):
        raise CacheInputError(f"cache_from_config takes a transformers config, got {type(config).__name__}")
    layers = decoder_layers(config)
    if not config.is_encoder_decoder:
        return Cache(layers)
    return EncoderDecoderCache(Cache(layers), Cache([DynamicLayer() for _ in layers]))
