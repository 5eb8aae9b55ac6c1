"""The whole-file digest: every byte of a kvcache file, header and tensor data, is covered.

The digest is the file's last tensor, `__kvcache_digest__` (bytes), computed over everything before
it: the 8-byte header length, the JSON header (which names the digest's own size and place) and
every tensor's data in file order. A flipped bit anywhere is therefore a mismatch.

- `xxh3-128` (always): a fast non-cryptographic hash (xxhash; ~14 GB/s on one core where SHA-256
  does ~1.5 GB/s and reading the file from the page cache ~2.5 GB/s). It catches accidents (bad
  disks, truncation, torn copies), not an adversary: anyone can recompute it.
- `hmac-sha256` (when a key is given to `save_cache`): a keyed MAC over the same bytes, appended
  after the xxh3 digest. Only a holder of the key can produce it, so `load_cache(..., key=...)`
  gives tamper evidence. Without the key a loader still checks the xxh3 part.
"""

from __future__ import annotations

import hashlib
import hmac

import xxhash

from ..errors import CacheFormatError, CacheInputError

#: Name of the digest tensor, always the file's last.
DIGEST_TENSOR = "__kvcache_digest__"
PLAIN = "xxh3-128"
KEYED = "xxh3-128+hmac-sha256"
DIGEST_BYTES = {PLAIN: 16, KEYED: 48}


def check_key(key: object) -> bytes | None:
    """A MAC key must be bytes of at least 16 bytes (or None for no MAC)."""
    if key is None:
        return None
    if not isinstance(key, (bytes, bytearray)) or len(key) < 16:
        raise CacheInputError("key must be bytes of at least 16 bytes (e.g. os.urandom(32)), or None")
    return bytes(key)


class FileDigest:
    """Running digest of a file's bytes, in the scheme given by whether a key is used."""

    def __init__(self, key: bytes | None, *, scheme: str | None = None) -> None:
        self.scheme = scheme or (KEYED if key else PLAIN)
        self._xxh = xxhash.xxh3_128()
        self._mac = hmac.new(key, digestmod=hashlib.sha256) if key and self.scheme == KEYED else None

    @property
    def nbytes(self) -> int:
        return DIGEST_BYTES[self.scheme]

    def update(self, data: bytes | memoryview) -> None:
        self._xxh.update(data)
        if self._mac is not None:
            self._mac.update(data)

    def digest(self) -> bytes:
        out = self._xxh.digest()
        if self.scheme == KEYED:
            out += self._mac.digest() if self._mac is not None else b"\0" * 32
        return out

    def verify(self, stored: bytes, key: bytes | None) -> None:
        """Raise `CacheFormatError` unless `stored` is this digest (the MAC part only with `key`)."""
        mine = self.digest()
        if not hmac.compare_digest(mine[:16], stored[:16]):
            raise CacheFormatError(f"file digest ({PLAIN}) does not match: the file is damaged or was modified")
        if key is not None and not hmac.compare_digest(mine[16:], stored[16:]):
            raise CacheFormatError("file MAC (hmac-sha256) does not match: wrong key, or the file was tampered with")
