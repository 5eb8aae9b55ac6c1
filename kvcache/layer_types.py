"""Layer-type names (as in transformers configs' `layer_types`) and the layers they build."""

from __future__ import annotations

from collections.abc import Callable

from .errors import CacheInputError
from .layers.base import CacheLayer
from .layers.dynamic import DynamicLayer
from .layers.empty import EmptyLayer
from .layers.hybrid import HybridLayer
from .layers.quant import check_quant
from .layers.quantized import QuantizedLayer
from .layers.quantized_sliding import QuantizedSlidingWindowLayer
from .layers.recurrent import RecurrentLayer
from .layers.sliding import SlidingWindowLayer
from .layers.static import StaticLayer
from .layers.static_recurrent import StaticRecurrentLayer
from .layers.static_sliding import DEFAULT_ROLLBACK_TOKENS, StaticSlidingWindowLayer


def _need_window(layer_type: str, sliding_window: int | None) -> int:
    if sliding_window is None:
        raise CacheInputError(f"layer type {layer_type!r} needs sliding_window")
    return sliding_window


#: name -> builder(sliding_window, num_states). Other modules add their kinds here.
LAYER_TYPE_BUILDERS: dict[str, Callable[[int | None, int], CacheLayer]] = {
    "full_attention": lambda window, states: DynamicLayer(),
    "sliding_attention": lambda window, states: SlidingWindowLayer(_need_window("sliding_attention", window)),
    # conv / recurrent states only (Mamba, gated delta net, short conv): transformers' names and "mamba"
    "linear_attention": lambda window, states: RecurrentLayer(states),
    "mamba": lambda window, states: RecurrentLayer(states),
    "conv": lambda window, states: RecurrentLayer(states),
    # no cache at all: MoE/MLP-only layers, KV-shared layers (transformers' "dummy")
    "dummy": lambda window, states: EmptyLayer(),
    # parallel hybrids: attention and recurrent states under one layer index
    "hybrid": lambda window, states: HybridLayer(DynamicLayer(), RecurrentLayer(states)),
    "hybrid_sliding": lambda window, states: HybridLayer(
        SlidingWindowLayer(_need_window("hybrid_sliding", window)), RecurrentLayer(states)
    ),
}


def build_layer(layer_type: str, *, sliding_window: int | None = None, num_states: int = 1,
                kv_bits: int | None = None, group_size: int = 64) -> CacheLayer:  # fmt: skip
    """A fresh dynamic layer for `layer_type` (e.g. "full_attention", "sliding_attention"). With
    `kv_bits` (8, 4 or 2) attention keys/values are quantized, per channel in blocks of tokens
    (`QuantizedLayer`, `QuantizedSlidingWindowLayer`; a hybrid's attention part too)."""
    builder = LAYER_TYPE_BUILDERS.get(layer_type)
    if builder is None:
        raise CacheInputError(f"unknown layer type {layer_type!r}; known: {sorted(LAYER_TYPE_BUILDERS)}")
    layer = builder(sliding_window, num_states)
    return layer if kv_bits is None else quantized(layer, kv_bits, group_size)


def quantized(layer: CacheLayer, bits: int, group_size: int) -> CacheLayer:
    """The quantized kind of a fresh attention layer (others as they are)."""
    check_quant(bits, group_size)
    if isinstance(layer, HybridLayer):
        return HybridLayer(quantized(layer.attention, bits, group_size), layer.recurrent)
    if type(layer) is SlidingWindowLayer:
        return QuantizedSlidingWindowLayer(layer.sliding_window, bits=bits, group_size=group_size)
    if type(layer) is DynamicLayer:
        return QuantizedLayer(bits=bits, group_size=group_size)
    return layer


#: name -> builder(max_cache_len, sliding_window, num_states, rollback_tokens): the fixed-shape layer
#: `torch.compile` can capture, for every name `LAYER_TYPE_BUILDERS` knows.
STATIC_LAYER_TYPE_BUILDERS: dict[str, Callable[[int, int | None, int, int], CacheLayer]] = {
    "full_attention": lambda max_len, window, states, room: StaticLayer(max_len),
    "sliding_attention": lambda max_len, window, states, room: StaticSlidingWindowLayer(
        _need_window("sliding_attention", window), max_len, room
    ),
    "linear_attention": lambda max_len, window, states, room: StaticRecurrentLayer(states, room),
    "mamba": lambda max_len, window, states, room: StaticRecurrentLayer(states, room),
    "conv": lambda max_len, window, states, room: StaticRecurrentLayer(states, room),
    "dummy": lambda max_len, window, states, room: EmptyLayer(),
    "hybrid": lambda max_len, window, states, room: HybridLayer(
        StaticLayer(max_len), StaticRecurrentLayer(states, room)
    ),
    "hybrid_sliding": lambda max_len, window, states, room: HybridLayer(
        StaticSlidingWindowLayer(_need_window("hybrid_sliding", window), max_len, room),
        StaticRecurrentLayer(states, room),
    ),
}


def build_static_layer(
    layer_type: str,
    *,
    max_cache_len: int,
    sliding_window: int | None = None,
    num_states: int = 1,
    rollback_tokens: int = DEFAULT_ROLLBACK_TOKENS,
) -> CacheLayer:
    """A fresh fixed-shape layer for `layer_type`: `StaticLayer`, `StaticSlidingWindowLayer`,
    `StaticRecurrentLayer`, or a `HybridLayer` of them (`rollback_tokens`: how many tokens a crop can
    undo, and the longest update a sliding layer serves at fixed shape)."""
    builder = STATIC_LAYER_TYPE_BUILDERS.get(layer_type)
    if builder is None:
        raise CacheInputError(f"unknown layer type {layer_type!r}; known: {sorted(STATIC_LAYER_TYPE_BUILDERS)}")
    return builder(max_cache_len, sliding_window, num_states, rollback_tokens)
