"""The two ready-made composite caches: `DynamicCache` (growing layers, built lazily or from a
model's layer types) and `StaticCache` (fixed shapes, for `torch.compile`)."""

from __future__ import annotations

from collections.abc import Sequence

from .cache import Cache
from .errors import CacheInputError
from .layer_types import build_layer, build_static_layer
from .layers.static import StaticLayer
from .layers.static_sliding import DEFAULT_ROLLBACK_TOKENS


class DynamicCache(Cache):
    """Growing layers: built lazily as `DynamicLayer`s, or from `layer_types` such as
    `["full_attention", "sliding_attention", ...]` (with `sliding_window`). `kv_bits` (8, 4 or 2):
    attention keys/values quantized, values in groups of `group_size` along head_dim and keys per
    channel (`QuantizedLayer`)."""

    def __init__(
        self,
        layer_types: Sequence[str] | None = None,
        *,
        sliding_window: int | None = None,
        num_states: int = 1,
        kv_bits: int | None = None,
        group_size: int = 64,
    ) -> None:
        if kv_bits is not None:
            from .layers.quant import check_quant

            check_quant(kv_bits, group_size)
        if layer_types is None:
            from .layers.dynamic import DynamicLayer
            from .layers.quantized import QuantizedLayer

            factory = DynamicLayer if kv_bits is None else (lambda: QuantizedLayer(kv_bits, group_size))
            super().__init__(layer_factory=factory)
        else:
            if not isinstance(layer_types, (list, tuple)) or not all(isinstance(t, str) for t in layer_types):
                raise CacheInputError(f"layer_types must be a list of layer-type names, got {layer_types!r}"[:200])
            layers = [build_layer(t, sliding_window=sliding_window, num_states=num_states, kv_bits=kv_bits,
                                  group_size=group_size) for t in layer_types]  # fmt: skip
            super().__init__(layers)


class StaticCache(Cache):
    """Fixed-shape layers for `torch.compile`: `num_layers` `StaticLayer`s of `max_cache_len`
    tokens (or created lazily as layer indices appear), or one layer per entry of `layer_types`
    (`StaticSlidingWindowLayer` for "sliding_attention", `StaticRecurrentLayer` for conv/recurrent
    types, ...; see `build_static_layer`)."""

    def __init__(
        self,
        max_cache_len: int,
        num_layers: int | None = None,
        *,
        layer_types: Sequence[str] | None = None,
        sliding_window: int | None = None,
        num_states: int = 1,
        rollback_tokens: int = DEFAULT_ROLLBACK_TOKENS,
    ) -> None:
        StaticLayer(max_cache_len)  # validates max_cache_len before anything is built
        if layer_types is not None:
            if num_layers is not None and num_layers != len(layer_types):
                raise CacheInputError(f"num_layers {num_layers!r} != {len(layer_types)} layer types")
            if not isinstance(layer_types, (list, tuple)) or not all(isinstance(t, str) for t in layer_types):
                raise CacheInputError(f"layer_types must be a list of layer-type names, got {layer_types!r}"[:200])
            super().__init__([
                build_static_layer(t, max_cache_len=max_cache_len, sliding_window=sliding_window,
                                   num_states=num_states, rollback_tokens=rollback_tokens)
                for t in layer_types
            ])  # fmt: skip
        elif num_layers is None:
            super().__init__(layer_factory=lambda: StaticLayer(max_cache_len))
        else:
            if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 0:
                raise CacheInputError(f"num_layers must be a non-negative int, got {num_layers!r}")
            super().__init__([StaticLayer(max_cache_len) for _ in range(num_layers)])
        self.max_cache_len = max_cache_len
