"""KV caches for transformer-style models, with exact rollback of every layer kind."""

from .cache import Cache, DynamicCache, StaticCache
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
    RecurrentLayer,
    SlidingWindowLayer,
    StaticLayer,
    StaticRecurrentLayer,
    StaticSlidingWindowLayer,
)
from .persistence import load_cache, save_cache

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
    "EmptyLayer",
    "EncoderDecoderCache",
    "GenerationError",
    "HybridLayer",
    "KVCacheError",
    "RecurrentLayer",
    "RollbackError",
    "SlidingWindowLayer",
    "StaticCache",
    "StaticLayer",
    "StaticRecurrentLayer",
    "StaticSlidingWindowLayer",
    "__version__",
    "load_cache",
    "save_cache",
]
