"""Prefix reuse across requests: `PrefixStore` keeps what caches held at chunk boundaries of
prompts (and of the answers decoded after them), and rebuilds a cache for the longest stored
prefix of a new prompt."""

from .backends import MemoryBackend, StoreUnavailable
from .directory import DirectoryBackend
from .identity import forget
from .prefix_store import PrefixStore, StoreStats, open_store, prefill_for_generation
from .redis_backend import RedisBackend
from .session import StoreSession

__all__ = [
    "DirectoryBackend",
    "MemoryBackend",
    "PrefixStore",
    "RedisBackend",
    "StoreSession",
    "StoreStats",
    "StoreUnavailable",
    "forget",
    "open_store",
    "prefill_for_generation",
]
