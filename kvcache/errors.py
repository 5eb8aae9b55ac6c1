"""The package's error types: every deliberate failure raises one of these."""

from __future__ import annotations


class KVCacheError(Exception):
    """Base of every error `kvcache` raises on purpose.

    `param` names the argument that was wrong, when one was; the message then starts with that
    name, so a front end (the command line) can say the name its user typed instead (`--top-p`
    for `top_p`)."""

    def __init__(self, *args: object, param: str | None = None) -> None:
        super().__init__(*args)
        self.param = param

    def renamed(self, names: dict[str, str]) -> str:
        """The message with the wrong argument's name replaced by `names[param]`, when known."""
        message = str(self)
        if self.param in names and message.startswith(self.param):
            return names[self.param] + message[len(self.param) :]
        return message


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
