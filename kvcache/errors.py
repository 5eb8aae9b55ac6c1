"""The package's error types: every deliberate failure raises one of these."""

from __future__ import annotations


class KVCacheError(Exception):
    """Base of every error `kvcache` raises on purpose."""


class RollbackError(KVCacheError):
    """A `crop` that cannot restore the cache exactly (too far, not recording, off a step boundary)."""


class CacheFormatError(KVCacheError):
    """A file that is not a valid kvcache file (truncated, corrupted, tampered, newer version)."""


class CacheInputError(KVCacheError, ValueError):
    """An argument that does not fit the cache: a shape, dtype, device, batch or index mismatch."""


class CacheOverflowError(CacheInputError):
    """An update that would write past a preallocated cache's `max_cache_len`."""


class GenerationError(KVCacheError, ValueError):
    """Bad input to the generation driver, found before any work is done."""
