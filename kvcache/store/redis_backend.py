"""A prefix store on a Redis server or a Redis Cluster, shared by processes and machines.

Needs the optional `redis` client (`pip install "kvcache[redis]"`) and Redis >= 6.2. Keys share
one hash tag, `{prefix}`, so a store lives in one slot (on one node of a cluster; several
prefixes spread over the nodes) and each operation is one atomic Lua script there:

    {prefix}:e:<key>   an entry's bytes (`codec`)      {prefix}:lru    sorted set of keys by score
    {prefix}:meta      hash: key -> "<parent>|<size>"  {prefix}:bytes  bytes held
    {prefix}:roots     first chunks held               {prefix}:stamp  the request counter
    {prefix}:stats     lookup counters

An insert checks, evicts the lowest scores and writes in one script, so no lock is needed, the
byte count moves with the entries it counts (it cannot drift, and two deleters of one entry
count it once), and eviction reads one sorted-set element per victim (never the whole
keyspace). A value that vanished behind the store's back (maxmemory eviction, EXPIRE, an
operator's DEL) is forgotten and stored again by the next insert of its key; a counter another
program overwrote is counted again from the hash. Every call has a socket timeout and no retry: a
server that is down, hung or answering nonsense is `StoreUnavailable`, which the store turns into
a miss and a back-off.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

from ..errors import CacheInputError
from .backends import Inserted, StoreUnavailable, floor, score
from .location import REDIS_SCHEMES, redact

_SIZE_OF = """
local function size_of(meta) return tonumber(string.match(meta or '', '|(%d+)$')) or 0 end
local function held_bytes(meta_key, bytes_key)
  local raw = redis.call('GET', bytes_key)
  if raw and string.match(raw, '^%d+$') then return tonumber(raw) end  -- a count, or recounted
  local total = 0
  for _, m in ipairs(redis.call('HVALS', meta_key)) do total = total + size_of(m) end
  return total
end
local function forget(meta_key, lru_key, roots_key, value_prefix, hex)
  local m = redis.call('HGET', meta_key, hex)
  redis.call('ZREM', lru_key, hex)
  redis.call('DEL', value_prefix .. hex)
  if not m then return 0 end
  redis.call('HDEL', meta_key, hex)
  if string.sub(m, 1, 1) == '|' then redis.call('DECR', roots_key) end
  return size_of(m)
end
"""
# KEYS: meta, lru, bytes, roots, the entry's value. ARGV: key hex, parent hex or '', size, score,
# floor, max bytes, data, value-key prefix.
_INSERT = _SIZE_OF + """
local hex, parent, size = ARGV[1], ARGV[2], tonumber(ARGV[3])
local sc, fl, max = tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6])
local held = held_bytes(KEYS[1], KEYS[3])
if redis.call('HEXISTS', KEYS[1], hex) == 1 then
  if redis.call('EXISTS', KEYS[5]) == 1 then
    redis.call('ZADD', KEYS[2], 'XX', 'GT', sc, hex)
    redis.call('SET', KEYS[3], held)
    return {'exists', 0}
  end
  held = held - forget(KEYS[1], KEYS[2], KEYS[4], ARGV[8], hex)
end
if parent ~= '' and redis.call('HEXISTS', KEYS[1], parent) == 0 then
  redis.call('SET', KEYS[3], held)
  return {'orphan', 0}
end
local evicted = 0
while held + size > max do
  local victim = redis.call('ZRANGE', KEYS[2], 0, 0, 'WITHSCORES')
  if #victim == 0 or tonumber(victim[2]) >= fl then
    redis.call('SET', KEYS[3], held)
    return {'full', evicted}
  end
  held = held - forget(KEYS[1], KEYS[2], KEYS[4], ARGV[8], victim[1])
  evicted = evicted + 1
end
redis.call('SET', KEYS[5], ARGV[7])
redis.call('HSET', KEYS[1], hex, parent .. '|' .. size)
redis.call('ZADD', KEYS[2], sc, hex)
if parent ~= '' then redis.call('ZADD', KEYS[2], 'XX', 'GT', sc + 1, parent) else redis.call('INCR', KEYS[4]) end
redis.call('SET', KEYS[3], held + size)
return {'stored', evicted}
"""
# KEYS: meta, lru, bytes, roots. ARGV: key hex, value-key prefix.
_DISCARD = _SIZE_OF + """
local held = held_bytes(KEYS[1], KEYS[3])
redis.call('SET', KEYS[3], held - forget(KEYS[1], KEYS[2], KEYS[4], ARGV[2], ARGV[1]))
return 1
"""
# KEYS: meta, lru, bytes, roots. ARGV: max bytes, value-key prefix, most evictions this call.
_SHRINK = _SIZE_OF + """
local held, max, evicted = held_bytes(KEYS[1], KEYS[3]), tonumber(ARGV[1]), 0
while held > max and evicted < tonumber(ARGV[3]) do
  local victim = redis.call('ZRANGE', KEYS[2], 0, 0)
  if #victim == 0 then break end
  held = held - forget(KEYS[1], KEYS[2], KEYS[4], ARGV[2], victim[1])
  evicted = evicted + 1
end
redis.call('SET', KEYS[3], held)
return {evicted, held}
"""
# KEYS: the stamp counter. A counter another program overwrote restarts from 1.
_BEGIN = """
local v = (tonumber(redis.call('GET', KEYS[1])) or 0) + 1
redis.call('SET', KEYS[1], v)
return v
"""
#: Values fetched per round trip of a lookup (a path usually breaks early only on a miss).
MGET_BATCH = 16


class RedisBackend:
    """Entries on the Redis server (or Redis Cluster) at `url`, under the hash tag `{prefix}`.

    `url`: redis://[:password@]host:port[/db], rediss://, unix://path; the schemes
    redis+cluster:// and rediss+cluster:// (or `cluster=True`) connect to a Redis Cluster through
    any of its nodes. `timeout` (seconds) bounds every call; there are no retries."""

    holds_objects = False

    def __init__(self, url: str, *, prefix: str = "kvcache", timeout: float = 1.0, strict: bool = False,
                 cluster: bool | None = None) -> None:  # fmt: skip
        try:
            import redis
            from redis.backoff import NoBackoff
            from redis.retry import Retry
        except ImportError as exc:
            raise CacheInputError('RedisBackend needs the redis client: pip install "kvcache[redis]"') from exc
        if not isinstance(url, str) or url.split("://")[0].lower() not in REDIS_SCHEMES:
            raise CacheInputError(f"RedisBackend: url must be redis://host:port[/db], got {redact(str(url))!r}")
        if not isinstance(prefix, str) or not prefix or any(c in prefix for c in "{}"):
            raise CacheInputError(f"RedisBackend: prefix must be a non-empty str without braces, got {prefix!r}")
        scheme, rest = url.split("://", 1)
        is_cluster = scheme.lower().endswith("+cluster") if cluster is None else bool(cluster)
        plain_url = f"{scheme.lower().removesuffix('+cluster')}://{rest}"
        self.url, self.prefix, self.strict = url, prefix, strict
        self._errors = (redis.exceptions.RedisError, OSError)
        options = {"socket_timeout": timeout, "socket_connect_timeout": timeout, "retry": Retry(NoBackoff(), 0)}
        try:
            if is_cluster:
                from redis.cluster import RedisCluster

                self.client: Any = RedisCluster.from_url(plain_url, **options)
            else:
                self.client = redis.Redis.from_url(plain_url, health_check_interval=0, **options)
        except self._errors as exc:
            why = type(exc).__name__
            raise StoreUnavailable(f"prefix store: Redis at {self.location} unavailable ({why})") from None
        except ValueError as exc:
            raise CacheInputError(f"RedisBackend: bad url {self.location!r}: {exc}") from exc
        tag = f"{{{prefix}}}"
        self._keys = [f"{tag}:meta", f"{tag}:lru", f"{tag}:bytes", f"{tag}:roots"]
        self._value_prefix = f"{tag}:e:"
        self._stamp, self._stats = f"{tag}:stamp", f"{tag}:stats"
        scripts = {"insert": _INSERT, "discard": _DISCARD, "shrink": _SHRINK, "begin": _BEGIN}
        self._scripts = {name: self.client.register_script(text) for name, text in scripts.items()}

    def close(self) -> None:
        """Close the client's connections (a later call opens new ones)."""
        with contextlib.suppress(*self._errors):
            self.client.close()

    @property
    def location(self) -> str:
        return redact(self.url)

    def _call(self, what: str, fn: Any) -> Any:
        try:
            return fn()
        except self._errors as exc:
            detail = str(exc).replace(self.url, self.location)[:200]
            raise StoreUnavailable(
                f"prefix store: Redis at {self.location} unavailable ({type(exc).__name__}: {detail}) during {what}"
            ) from None

    def _value(self, key: bytes) -> str:
        return self._value_prefix + key.hex()

    # ------------------------------------------------------------------------- interface
    def begin(self) -> int:
        return int(self._call("begin", lambda: self._scripts["begin"](keys=[self._stamp])))

    def get_many(self, keys: Sequence[bytes]) -> list[Any]:
        out: list[Any] = []
        for start in range(0, len(keys), MGET_BATCH):
            batch = [self._value(k) for k in keys[start : start + MGET_BATCH]]
            values = self._call("lookup", lambda b=batch: self.client.mget(b))
            for value in values:
                if value is None:
                    return out
                out.append(value)
        return out

    def record_lookup(self, keys: Sequence[bytes], stamp: int, tokens: int) -> None:
        def run() -> None:
            pipe = self.client.pipeline(transaction=False)
            if keys:
                pipe.zadd(self._keys[1], {k.hex(): score(stamp, d) for d, k in enumerate(keys)}, xx=True, gt=True)
            pipe.hincrby(self._stats, "lookups", 1)
            pipe.hincrby(self._stats, "hits", int(bool(keys)))
            pipe.hincrby(self._stats, "tokens_reused", tokens)
            pipe.execute()

        self._call("lookup", run)

    def insert(self, key: bytes, parent: bytes | None, record: Any, size: int, depth: int, stamp: int,
               max_bytes: int) -> Inserted:  # fmt: skip
        args = [key.hex(), "" if parent is None else parent.hex(), size, score(stamp, depth), floor(stamp),
                max_bytes, record, self._value_prefix]  # fmt: skip
        outcome, evicted = self._call(
            "insert", lambda: self._scripts["insert"](keys=[*self._keys, self._value(key)], args=args)
        )
        return Inserted(outcome.decode() if isinstance(outcome, bytes) else str(outcome), int(evicted))

    def discard(self, key: bytes) -> None:
        self._call("drop", lambda: self._scripts["discard"](keys=self._keys, args=[key.hex(), self._value_prefix]))

    def _counter(self, name: str) -> int:
        value = self._call("report", lambda: self.client.get(name))
        try:
            return int(value or 0)
        except ValueError:
            return 0

    def nbytes(self) -> int:
        return self._counter(self._keys[2])

    def summary(self) -> dict[str, int]:
        chunks = int(self._call("report", lambda: self.client.hlen(self._keys[0])))
        return {"chunks": chunks, "roots": self._counter(self._keys[3]), "bytes": self.nbytes()}

    def shrink_to(self, max_bytes: int) -> int:
        evicted = 0
        while True:
            done, held = self._call(
                "eviction", lambda: self._scripts["shrink"](keys=self._keys, args=[max_bytes, self._value_prefix, 256])
            )
            evicted += int(done)
            if int(held) <= max_bytes or not int(done):
                return evicted

    def clear(self) -> None:
        def run() -> None:
            members = [m.decode() for m in self.client.zrange(self._keys[1], 0, -1)]
            members += [m.decode() for m in self.client.hkeys(self._keys[0])]
            for start in range(0, len(members), 512):
                self.client.delete(*[self._value_prefix + m for m in members[start : start + 512]])
            self.client.delete(*self._keys)

        self._call("clear", run)

    def counters(self) -> dict[str, int]:
        raw = self._call("report", lambda: self.client.hgetall(self._stats))
        out = {}
        for name, value in raw.items():
            try:
                out[name.decode()] = int(value)
            except ValueError:
                continue
        return out
