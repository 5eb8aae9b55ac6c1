"""Reuse of computed prefixes across requests: chunks of token ids, keyed by a chained hash.

A prompt is split into chunks of `chunk_size` tokens. Chunk i's key hashes the key of chunk i - 1
and the chunk's token ids; chunk 0 chains from the model's fingerprint (`identity`: its class,
config, weights and cache layout, the namespace, and the store's key if it has one). So a key
names one exact prefix of one model, as LMCache, SGLang and vLLM key theirs. An entry holds, for
every layer, what the cache needs at the chunk's end boundary (`payloads`). Entries are taken
during a chunked prefill and, while decoding, whenever the cache reaches a chunk boundary
(`StoreSession`), so a recurrent state is never guessed: a lookup lands only on boundaries where
every layer's state was taken, and the cache it rebuilds continues bitwise as the one that made
the entries did.

An entry is trusted only after it is checked: whole and verified (`codec`, with a MAC for a keyed
store), made for its key and parent, and matching, layer by layer, what the model's own cache
holds at that boundary (`payloads.check_payload`). Anything else is a miss and a warning (a
`KVCacheError` with a strict backend), and the entry is dropped.

Memory is a hard bound: the backend counts what it holds and evicts the lowest-scored entries
(least recently used, leaves first: `backends`), so it never holds more than `max_bytes`. A
backend that fails is skipped for the rest of the request and then left alone for a back-off
that doubles while it keeps failing, so a hung server costs about one timeout per request.
"""

from __future__ import annotations

import os
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from ..cache import Cache
from ..errors import CacheInputError, GenerationError
from ..persistence.integrity import check_key
from .backends import Backend, MemoryBackend, StoreUnavailable
from .payloads import Payload, reference_payloads

T = TypeVar("T")
#: Back-off after a backend failure: first wait, and the most it doubles to (seconds).
BACKOFF_MIN_S, BACKOFF_MAX_S = 1.0, 60.0


@dataclass
class StoreStats:
    """What a store did in this process: lookups, hits (a lookup that reused at least one chunk),
    tokens reused, chunks inserted and evicted, bytes held (at the last insert), inserts refused
    (no room without evicting the request's own path), entries dropped (damaged, foreign or not
    fitting the model) and backend failures."""

    lookups: int = 0
    hits: int = 0
    tokens_reused: int = 0
    chunks_inserted: int = 0
    evictions: int = 0
    bytes_held: int = 0
    refused: int = 0
    dropped: int = 0
    unavailable: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def hit_rate(self) -> float:
        return self.hits / self.lookups if self.lookups else 0.0


class PrefixStore:
    """A store of prefix caches for one or more models (see the module docstring).

    `chunk_size`: tokens per chunk (prefixes are reused in whole chunks). `max_bytes`: the budget,
    counted as the backend stores entries (tensor bytes in memory, file bytes in a directory, value
    bytes on Redis); a backend that holds more is evicted down to it now. `namespace`: mixed into
    every key, to keep apart models whose configs and weights coincide on purpose. `backend`:
    `MemoryBackend()` (the default), `DirectoryBackend(path)` or `RedisBackend(url)`. `key`: bytes
    (at least 16) that entries must carry a MAC under; an entry without one is a miss.
    """

    def __init__(
        self, *, chunk_size: int = 64, max_bytes: int = 1 << 30, namespace: str = "", backend: Backend | None = None,
        key: bytes | None = None,
    ) -> None:  # fmt: skip
        check_store_params(chunk_size, max_bytes, namespace)
        self.chunk_size, self.max_bytes, self.namespace = chunk_size, max_bytes, namespace
        self.key = check_key(key)
        self.backend: Backend = MemoryBackend() if backend is None else backend
        self.stats = StoreStats()
        self._references: dict[bytes, list[Payload]] = {}
        self._lock = threading.Lock()
        self._retry_at = 0.0
        self._backoff = BACKOFF_MIN_S
        if not getattr(self.backend, "writable", True):
            warnings.warn(f"prefix store {self.location} is read-only here: lookups hit, nothing is stored",
                          stacklevel=2)  # fmt: skip
        self.guard(lambda: self.backend.shrink_to(max_bytes), 0)
        self.writer: Any = None  # a StoreWriter once `start_writer` is called

    def start_writer(self) -> None:
        """Write new entries on a background thread from now on (`StoreWriter`): a server's
        engine captures a chunk and goes on decoding while it is encoded and written. Not for the
        memory backend, which keeps entries as they are (nothing to encode)."""
        if self.writer is None and not self.backend.holds_objects:
            from .writer import StoreWriter

            self.writer = StoreWriter()

    def stop_writer(self, timeout: float = 30.0) -> None:
        """Finish the queued writes (for up to `timeout` seconds) and write in the caller's thread again."""
        writer, self.writer = self.writer, None
        if writer is not None:
            writer.close(timeout)

    def close(self, timeout: float = 30.0) -> None:
        """Finish the queued writes (`stop_writer`) and release the backend: a directory's index
        is closed (later calls are misses, with a warning, or `StoreUnavailable` when strict), a
        Redis client's connections are. Also what leaving a `with PrefixStore(...) as store:`
        block does. The entries stay where they are, for the next store opened there."""
        self.stop_writer(timeout)
        close = getattr(self.backend, "close", None)  # a backend written before close() has none
        if close is not None:
            close()

    def __enter__(self) -> PrefixStore:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __len__(self) -> int:
        return int(self.guard(lambda: self.backend.summary()["chunks"], 0))

    @property
    def location(self) -> str:
        """Where the entries are, fit to print (a URL's password redacted)."""
        return self.backend.location

    @property
    def nbytes(self) -> int:
        """Bytes the store holds (never above `max_bytes`)."""
        return int(self.guard(self.backend.nbytes, 0))

    # ---------------------------------------------------------------------------- failures
    def guard(self, call: Callable[[], T], default: T, session: Any = None) -> T:
        """`call()`, unless the backend is failing: then `default`. A `StoreUnavailable` opens the
        breaker (one warning, or the error itself with a strict backend), marks `session` failed
        for the rest of its request, and keeps every caller away for the back-off."""
        if (session is not None and session.failed) or time.monotonic() < self._retry_at:
            return default
        try:
            result = call()
        except StoreUnavailable as exc:
            self.stats.unavailable += 1
            if session is not None:
                session.failed = True
            with self._lock:
                self._retry_at = time.monotonic() + self._backoff
                wait, self._backoff = self._backoff, min(2 * self._backoff, BACKOFF_MAX_S)
            if self.backend.strict:
                raise
            warnings.warn(f"{exc}; a miss, and the store is left alone for {wait:.0f} s", stacklevel=3)
            return default
        self._backoff = BACKOFF_MIN_S
        return result

    # --------------------------------------------------------------------------- requests
    def session(self, model: Any, identity: Any = None) -> Any:
        """One request's use of the store with `model` (`StoreSession`): its lookup, its prefill
        and, while it decodes, the chunk boundaries it reaches. `identity`: `self.identity(model)`
        computed earlier, for a caller that knows the model has not changed since (a server)."""
        from .session import StoreSession

        return StoreSession(self, model, identity)

    def identity(self, model: Any) -> Any:
        """`model`'s `ModelIdentity` in this store as it is now (its weights, config and layers)."""
        from .session import model_identity

        return model_identity(self, model)

    def lookup(self, tokens: Sequence[int], model: Any, *, max_tokens: int | None = None) -> tuple[int, Cache]:
        """`(matched, cache)`: the longest stored prefix of `tokens` (at most `max_tokens` tokens) and a
        fresh cache holding it, as one that had prefilled `tokens[:matched]` chunk by chunk holds it
        (`matched` is 0 and the cache empty on a miss). The cache shares nothing with the store."""
        return self.session(model).lookup(tokens, max_tokens=max_tokens)

    def prefill(
        self, model: Any, tokens: Sequence[int], *, keep_last: int = 1, progress: Any = None
    ) -> tuple[int, Cache]:
        """Look `tokens` up, then feed the model the whole chunks after the match that leave at
        least `keep_last` tokens unfed (a generation driver feeds those itself, to get their
        logits), storing each chunk's boundary. Returns `(reused, cache)`: tokens taken from the
        store, and a cache holding the tokens up to the last whole chunk fed.
        `progress` (a `kvcache.progress.Progress`) is told of every token done, reused ones first."""
        return self.session(model).prefill(tokens, keep_last=keep_last, progress=progress)

    def chunk_keys(self, model: Any, tokens: Sequence[int]) -> list[bytes]:
        """The key of every whole chunk of `tokens` for `model` (what the backend names entries by)."""
        session = self.session(model)
        session.tokens = list(tokens)
        session.extend_keys()
        return list(session.keys)

    def reference(self, model: Any, root: bytes) -> list[Payload]:
        """What each layer of `model`'s own cache keeps after one chunk, computed once per model
        identity (one forward of a chunk): what every entry of that model is checked against."""
        with self._lock:
            found = self._references.get(root)
        if found is None:
            found = reference_payloads(model, model.new_cache(), self.chunk_size)
            with self._lock:
                self._references[root] = found
        return found

    def clear(self) -> None:
        """Delete every entry."""
        self.guard(self.backend.clear, None)
        self.stats.bytes_held = 0


def check_store_params(chunk_size: Any, max_bytes: Any, namespace: Any) -> None:
    """A store's parameters, checked before anything (a directory, a connection) is made."""
    for name, value in (("chunk_size", chunk_size), ("max_bytes", max_bytes)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise CacheInputError(f"{name} must be a positive int, got {value!r} (PrefixStore)", param=name)
    if not isinstance(namespace, str):
        raise CacheInputError(f"namespace must be a str, got {namespace!r} (PrefixStore)", param="namespace")


def open_store(
    where: str, *, chunk_size: int = 64, max_bytes: int = 1 << 30, namespace: str = "", strict: bool = False,
    create: bool = True, key: bytes | None = None,
) -> PrefixStore:  # fmt: skip
    """A store at `where`: a Redis URL ("redis://host:port/db", "redis+cluster://host:port") or a
    directory path (created when missing; with `create=False`, only a directory that holds a
    store's index is opened, so nothing is written into one that is not a store). Any other URL
    scheme is a `CacheInputError`; so is a bad budget, before anything is created."""
    from .directory import DirectoryBackend
    from .location import kind_of_location
    from .redis_backend import RedisBackend

    check_store_params(chunk_size, max_bytes, namespace)
    key = check_key(key)
    if kind_of_location(where) == "redis":
        backend: Backend = RedisBackend(where, strict=strict)
    else:
        if not create and not os.path.isfile(os.path.join(where, "index.sqlite")):
            what = ("is a file, not a directory" if os.path.isfile(where) else "holds no index.sqlite"
                    if os.path.isdir(where) else "does not exist")  # fmt: skip
            raise CacheInputError(f"no prefix store at {where!r}: it {what}")
        backend = DirectoryBackend(where, strict=strict)
    return PrefixStore(chunk_size=chunk_size, max_bytes=max_bytes, namespace=namespace, backend=backend, key=key)


def prefill_for_generation(store: Any, model: Any, input_ids: torch.Tensor, attention_mask: Any, cache: Any,
                           encoder_decoder: bool) -> tuple[Cache, Any]:  # fmt: skip
    """What `generate(..., prefix_store=store)` / `speculative_generate` start from: the prompt's
    longest stored prefix, the rest of its whole chunks prefilled and stored, and the request's
    session (the generation driver feeds the remaining tokens, at least one, itself, and tells
    the session of every forward so decoding stores its chunk boundaries too)."""
    if not isinstance(store, PrefixStore):
        raise GenerationError(f"prefix_store must be a PrefixStore, got {type(store).__name__}")
    if encoder_decoder or cache is not None:
        raise GenerationError("prefix_store= is for decoder-only models, without cache=")
    if input_ids.shape[0] != 1 or (attention_mask is not None and not bool((attention_mask == 1).all())):
        raise GenerationError("prefix_store= takes one unpadded prompt (batch size 1)")
    session = store.session(model)
    return session.prefill(input_ids[0].tolist())[1], session
