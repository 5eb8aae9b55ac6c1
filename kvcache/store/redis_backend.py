"""A prefix store's entries on a Redis server, shared by processes and machines.

Needs the optional `redis` client (`pip install "kvcache[redis]"`). Each entry is the same
safetensors bytes a `DirectoryBackend` file holds (with its xxh3 digest), under
`<prefix>:e:<key>`; `<prefix>:meta` maps each key to its parent and size, `<prefix>:lru` orders keys
by last use, `<prefix>:bytes` counts the bytes held, and a Redis lock serializes check-evict-put
among sharers so the budget holds across them. Every call has a socket timeout: a server that is
down or slow gives a miss and a warning (or, with `strict`, a `KVCacheError`), never a hang; an
entry that fails to decode or verify is dropped.
"""

from __future__ import annotations

import contextlib
import json
import time
import warnings
from collections.abc import Iterator
from typing import Any

from ..errors import CacheFormatError, CacheInputError, KVCacheError
from .backends import Entry, EntryInfo, decode, encode
from .location import redact


class RedisBackend:
    """Entries on the Redis server at `url` (e.g. "redis://127.0.0.1:6379/0"), under `prefix`."""

    def __init__(self, url: str, *, prefix: str = "kvcache", timeout: float = 1.0, strict: bool = False) -> None:
        try:
            import redis
        except ImportError as exc:
            raise CacheInputError('RedisBackend needs the redis client: pip install "kvcache[redis]"') from exc
        if not isinstance(url, str) or not url.startswith(("redis://", "rediss://", "unix://")):
            raise CacheInputError(f"RedisBackend: url must be redis://host:port[/db], got {redact(str(url))!r}")
        self.url, self.prefix, self.strict = url, prefix, strict
        self._errors = (redis.exceptions.RedisError, OSError)
        self.client = redis.Redis.from_url(url, socket_timeout=timeout, socket_connect_timeout=timeout)
        self._encoded: tuple[int, bytes] | None = None

    @property
    def location(self) -> str:
        return redact(self.url)

    def _name(self, what: str) -> str:
        return f"{self.prefix}:{what}"

    def _entry(self, key: bytes) -> str:
        return self._name("e:" + key.hex())

    def _unavailable(self, exc: Exception, default: Any) -> Any:
        message = f"prefix store: Redis at {self.location} unavailable ({type(exc).__name__}); treated as a miss"
        if self.strict:
            raise KVCacheError(message) from exc
        warnings.warn(message, stacklevel=3)
        return default

    # ----------------------------------------------------------------------------- interface
    def get(self, key: bytes) -> Entry | None:
        try:
            data = self.client.get(self._entry(key))
        except self._errors as exc:
            return self._unavailable(exc, None)
        if data is None:
            return None
        try:
            entry = decode(data)
        except CacheFormatError as exc:
            self.delete(key)
            message = f"prefix store entry {key.hex()[:16]}... on {self.location}: {exc}; dropped"
            if self.strict:
                raise CacheFormatError(message) from exc
            warnings.warn(message, stacklevel=2)
            return None
        with contextlib.suppress(*self._errors):
            self.client.zadd(self._name("lru"), {key.hex(): time.time()})
        return entry

    def put(self, key: bytes, entry: Entry) -> None:
        data = self._encoded[1] if self._encoded and self._encoded[0] == id(entry) else encode(entry)
        self._encoded = None
        meta = json.dumps({"parent": None if entry.parent is None else entry.parent.hex(), "size": len(data)})
        try:
            if self.client.hsetnx(self._name("meta"), key.hex(), meta):
                pipe = self.client.pipeline(transaction=True)
                pipe.set(self._entry(key), data)
                pipe.zadd(self._name("lru"), {key.hex(): time.time()})
                pipe.incrby(self._name("bytes"), len(data))
                pipe.execute()
        except self._errors as exc:
            self._unavailable(exc, None)

    def exists(self, key: bytes) -> bool:
        try:
            return bool(self.client.hexists(self._name("meta"), key.hex()))
        except self._errors as exc:
            return self._unavailable(exc, False)

    def delete(self, key: bytes) -> None:
        try:
            meta = self.client.hget(self._name("meta"), key.hex())
            if meta is None:
                return
            pipe = self.client.pipeline(transaction=True)
            pipe.hdel(self._name("meta"), key.hex())
            pipe.delete(self._entry(key))
            pipe.zrem(self._name("lru"), key.hex())
            pipe.decrby(self._name("bytes"), int(json.loads(meta)["size"]))
            pipe.execute()
        except self._errors as exc:
            self._unavailable(exc, None)

    def infos(self) -> Iterator[EntryInfo]:
        try:
            metas = self.client.hgetall(self._name("meta"))
            recency = dict(self.client.zrange(self._name("lru"), 0, -1, withscores=True))
        except self._errors as exc:
            return iter(self._unavailable(exc, []))
        out = []
        for hexkey, raw in metas.items():
            try:
                meta = json.loads(raw)
                parent = None if meta["parent"] is None else bytes.fromhex(meta["parent"])
                out.append(EntryInfo(bytes.fromhex(hexkey.decode()), parent, int(meta["size"]),
                                     float(recency.get(hexkey, 0.0))))  # fmt: skip
            except (ValueError, KeyError, TypeError):
                continue
        return iter(out)

    def nbytes(self) -> int:
        try:
            return int(self.client.get(self._name("bytes")) or 0)
        except self._errors as exc:
            return self._unavailable(exc, 0)

    def size(self, entry: Entry) -> int:
        data = encode(entry)
        self._encoded = (id(entry), data)
        return len(data)

    def count(self, lookups: int, hits: int, tokens: int) -> None:
        try:
            pipe = self.client.pipeline(transaction=True)
            for name, value in (("lookups", lookups), ("hits", hits), ("tokens_reused", tokens)):
                pipe.hincrby(self._name("stats"), name, value)
            pipe.execute()
        except self._errors as exc:
            self._unavailable(exc, None)

    def counters(self) -> dict[str, int]:
        try:
            return {k.decode(): int(v) for k, v in self.client.hgetall(self._name("stats")).items()}
        except self._errors as exc:
            return self._unavailable(exc, {})

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """The store's Redis lock (released after 10 s even if its holder dies)."""
        try:
            lock = self.client.lock(self._name("lock"), timeout=10, blocking_timeout=5)
            acquired = lock.acquire()
        except self._errors as exc:
            self._unavailable(exc, None)
            acquired, lock = False, None
        try:
            yield
        finally:
            if acquired and lock is not None:
                with contextlib.suppress(*self._errors):
                    lock.release()
