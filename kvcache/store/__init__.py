"""Prefix reuse across requests: `PrefixStore` keeps what caches held at chunk boundaries of
prompts, and rebuilds a cache for the longest stored prefix of a new prompt."""

from .backends import DirectoryBackend, MemoryBackend
from .prefix_store import PrefixStore, StoreStats, open_store, prefill_for_generation
from .redis_backend import RedisBackend

__all__ = [
    "DirectoryBackend",
    "MemoryBackend",
    "PrefixStore",
    "RedisBackend",
    "StoreStats",
    "open_store",
    "prefill_for_generation",
]
