"""KV caches for transformer-style models, with exact rollback of every layer kind.

The names below are imported on first use (PEP 562), so `import kvcache` and the command line's
`--help` / `--version` do not pay for importing torch; `from kvcache import DynamicCache` works
as usual.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ._version import __version__

#: public name -> the module (relative to this package) that defines it
_EXPORTS = {
    "Cache": ".cache",
    "DynamicCache": ".caches",
    "StaticCache": ".caches",
    "EncoderDecoderCache": ".encoder_decoder",
    "CacheFormatError": ".errors",
    "CacheInputError": ".errors",
    "CacheOverflowError": ".errors",
    "GenerationError": ".errors",
    "KVCacheError": ".errors",
    "RollbackError": ".errors",
    "LAYER_REGISTRY": ".layers",
    "CacheLayer": ".layers",
    "DynamicLayer": ".layers",
    "EmptyLayer": ".layers",
    "HybridLayer": ".layers",
    "QuantizedLayer": ".layers",
    "QuantizedRows": ".layers",
    "QuantizedSlidingWindowLayer": ".layers",
    "RecurrentLayer": ".layers",
    "SlidingWindowLayer": ".layers",
    "StaticLayer": ".layers",
    "StaticRecurrentLayer": ".layers",
    "StaticSlidingWindowLayer": ".layers",
    "load_cache": ".persistence",
    "save_cache": ".persistence",
}

__all__ = [
    "Cache",
    "CacheFormatError",
    "CacheInputError",
    "CacheLayer",
    "CacheOverflowError",
    "DynamicCache",
    "DynamicLayer",
    "EmptyLayer",
    "EncoderDecoderCache",
    "GenerationError",
    "HybridLayer",
    "KVCacheError",
    "LAYER_REGISTRY",
    "QuantizedLayer",
    "QuantizedRows",
    "QuantizedSlidingWindowLayer",
    "RecurrentLayer",
    "RollbackError",
    "SlidingWindowLayer",
    "StaticCache",
    "StaticLayer",
    "StaticRecurrentLayer",
    "StaticSlidingWindowLayer",
    "load_cache",
    "save_cache",
    "__version__",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))


if TYPE_CHECKING:
    from .cache import Cache
    from .caches import DynamicCache, StaticCache
    from .encoder_decoder import EncoderDecoderCache
    from .errors import (
        CacheFormatError,
        CacheInputError,
        CacheOverflowError,
        GenerationError,
        KVCacheError,
        RollbackError,
    )
    from .layers import (
        LAYER_REGISTRY,
        CacheLayer,
        DynamicLayer,
        EmptyLayer,
        HybridLayer,
        QuantizedLayer,
        QuantizedRows,
        QuantizedSlidingWindowLayer,
        RecurrentLayer,
        SlidingWindowLayer,
        StaticLayer,
        StaticRecurrentLayer,
        StaticSlidingWindowLayer,
    )
    from .persistence import load_cache, save_cache
