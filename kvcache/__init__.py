"""KV caches for transformer-style models, with exact rollback of every layer kind."""

from .cache import Cache, DynamicCache, StaticCache
from .errors import (
    CacheFormatError,
    CacheInputError,
    CacheOverflowError,
    GenerationError,
    KVCacheError,
    RollbackError,
)
from .layers import LAYER_REGISTRY, CacheLayer, DynamicLayer, SlidingWindowLayer, StaticLayer

__version__ = "0.1.0"

__all__ = [
    "LAYER_REGISTRY",
    "Cache",
    "CacheFormatError",
    "CacheInputError",
    "CacheLayer",
    "CacheOverflowError",
    "DynamicCache",
    "DynamicLayer",
    "GenerationError",
    "KVCacheError",
    "RollbackError",
    "SlidingWindowLayer",
    "StaticCache",
    "StaticLayer",
    "__version__",
]
