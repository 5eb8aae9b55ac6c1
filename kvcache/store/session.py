"""One request's use of a prefix store: its lookup, its chunked prefill, and the chunk boundaries
its decoding reaches.

A session takes the request's recency stamp (`Backend.begin`) once, computes the model's
fingerprint and the chain of chunk keys, and keeps track of which boundary the store holds: a
boundary is stored only when its parent is, so the chain never has holes. While the generation
driver decodes, it reports each forward (`after_forward`); when the cache then holds exactly a
whole number of chunks, that boundary is captured and stored too, so the next turn of a chat
finds the previous answer. The tokens of decoding steps stay on the device until a boundary needs
them (one host transfer per chunk, none per step). A backend failure ends the session's use of
the store (`PrefixStore.guard`).
"""

from __future__ import annotations

import sys
import warnings
from array import array
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import xxhash

from ..cache import Cache
from ..errors import CacheFormatError, CacheInputError, GenerationError, KVCacheError
from ..protocol import last_logits
from . import codec
from .backends import Entry
from .identity import fingerprint
from .payloads import Payload, capture, check_payload, model_module, rebuild, storable


@dataclass(frozen=True)
class ModelIdentity:
    """What every session of one model in one store starts from: its cache layers as `new_cache()`
    builds them (what may be stored) and the root key its chunks chain from (`fingerprint`)."""

    template: Cache
    root: bytes


def model_identity(store: Any, model: Any) -> ModelIdentity:
    """`model`'s identity in `store`, computed now: its config, every parameter's signature (the
    weights hashed again only when one changed) and a new cache (about 1.3 ms for a small
    transformers model, each time; a server whose model never changes computes it once)."""
    template = _new_cache(model)
    root = fingerprint(model, template, namespace=store.namespace, chunk_size=store.chunk_size, key=store.key)
    return ModelIdentity(template, root)


class StoreSession:
    """A request's view of `store` for `model` (see the module docstring)."""

    def __init__(self, store: Any, model: Any, identity: ModelIdentity | None = None) -> None:
        self.store, self.model = store, model
        self.chunk = store.chunk_size
        identity = identity or model_identity(store, model)
        self.template, self.root = identity.template, identity.root
        self.failed = False
        self.tokens: list[int] = []  # the request's tokens known on the host
        self.keys: list[bytes] = []  # the chained key of each whole chunk of `tokens`
        self.stored = 0  # tokens up to the last boundary the store holds along this path
        self.length = 0  # tokens the request's cache holds
        self._pending: list[tuple[int, torch.Tensor]] = []  # (position, ids) of forwards not read yet
        self._stamp: int | None = None
        self._warned = False
        self._broken = False  # an insert of the background writer failed: later ones are skipped
        self.device = _device(model)

    # ------------------------------------------------------------------------------ keys
    def extend_keys(self) -> None:
        """Keys for every whole chunk of `tokens` not keyed yet."""
        parent = self.keys[-1] if self.keys else self.root
        first = len(self.keys) * self.chunk
        whole = max(len(self.tokens) - first, 0) // self.chunk * self.chunk
        ints = array("q", self.tokens[first : first + whole])  # int64, little-endian on every machine
        if sys.byteorder == "big":
            ints.byteswap()
        data = ints.tobytes()
        step = self.chunk * 8
        for start in range(0, len(data), step):
            parent = xxhash.xxh3_128_digest(parent + data[start : start + step])
            self.keys.append(parent)

    def stamp(self) -> int | None:
        if self._stamp is None:
            self._stamp = self.store.guard(self.store.backend.begin, None, self)
        return self._stamp

    def _drop(self, key: bytes, why: str) -> None:
        """Forget a bad entry (damaged, foreign, not fitting the model): a miss, one warning per
        session (or the error with a strict backend)."""
        self.store.stats.dropped += 1
        self.store.guard(lambda: self.store.backend.discard(key), None, self)
        message = f"prefix store {self.store.location}: entry {key.hex()[:16]}... {why}; dropped"
        if self.store.backend.strict:
            raise CacheFormatError(message)
        if not self._warned:
            self._warned = True
            warnings.warn(message, stacklevel=4)

    def _checked(self, record: Any, depth: int) -> Entry | None:
        """The entry at `depth` of the path (0: the first chunk) if it is sound and fits the model."""
        key = self.keys[depth]
        if isinstance(record, OSError):
            self._drop(key, f"cannot be read ({record})")
            return None
        parent = self.keys[depth - 1] if depth else None
        if isinstance(record, Entry):
            entry = record
            if entry.checked == (self.root, depth) and entry.parent == parent:
                return entry
        else:
            try:
                entry = codec.decode(key, bytes(record), self.store.key)
            except CacheFormatError as exc:
                self._drop(key, str(exc))
                return None
        if entry.parent != parent:
            self._drop(key, "names another parent than its chunk's")
            return None
        reference = self.store.reference(self.model, self.root)
        if len(entry.payloads) != len(reference):
            self._drop(key, f"does not fit the model: it holds {len(entry.payloads)} layer(s), the model has "
                            f"{len(reference)}")
            return None
        for i, (payload, ref) in enumerate(zip(entry.payloads, reference, strict=True)):
            problem = check_payload(payload, ref, depth + 1)
            if problem is not None:
                self._drop(key, f"does not fit the model at layer {i}: {problem}")
                return None
        entry.checked = (self.root, depth)
        return entry

    # ---------------------------------------------------------------------------- lookup
    def lookup(self, tokens: Sequence[int], *, max_tokens: int | None = None) -> tuple[int, Cache]:
        """See `PrefixStore.lookup`. The session's tokens become `tokens`."""
        self.tokens = _check_tokens(tokens, self.model)
        if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int)
                                       or max_tokens < 0):  # fmt: skip
            raise CacheInputError(f"prefix store: max_tokens must be a non-negative int, got {max_tokens!r}")
        self.keys = []
        self.extend_keys()
        keys = self.keys[: (len(self.tokens) if max_tokens is None else max_tokens) // self.chunk]
        records = self.store.guard(lambda: self.store.backend.get_many(keys), [], self) if keys else []
        path: list[Entry] = []
        for depth, record in enumerate(records):
            entry = self._checked(record, depth)
            if entry is None:
                break
            path.append(entry)
        matched = len(path) * self.chunk
        stats = self.store.stats
        stats.lookups += 1
        if keys and self.stamp() is not None:
            self.store.guard(lambda: self.store.backend.record_lookup(keys[: len(path)], self._stamp, matched), None,
                             self)  # fmt: skip
        cache = _new_cache(self.model)
        if path:
            try:
                cache = Cache([rebuild([e.payloads[i] for e in path], self.device) for i in range(len(cache.layers))])
            except (KVCacheError, RuntimeError, ValueError, TypeError, KeyError) as exc:  # checked: a bug if so
                self._drop(self.keys[len(path) - 1], f"could not be rebuilt ({type(exc).__name__}: {exc})")
                return 0, _new_cache(self.model)
            stats.hits += 1
            stats.tokens_reused += matched
        self.stored = self.length = matched
        return matched, cache

    # --------------------------------------------------------------------------- prefill
    def prefill(self, tokens: Sequence[int], *, keep_last: int = 1, progress: Any = None) -> tuple[int, Cache]:
        """See `PrefixStore.prefill`."""
        steps = self.prefill_steps(tokens, keep_last=keep_last)
        reused, cache = next(steps)
        if progress is not None:
            progress.update(reused)
        for _ in steps:
            if progress is not None:
                progress.update(self.chunk)
        self.store.stats.bytes_held = self.store.nbytes
        return reused, cache

    def prefill_steps(self, tokens: Sequence[int], *, keep_last: int = 1) -> Iterator[tuple[int, Cache]]:
        """`prefill` one step at a time: the first `next()` looks `tokens` up and yields `(reused,
        cache)`; each later one feeds and stores one chunk (a server interleaves these with the
        decoding steps of the requests already running, so a newcomer's prefill stalls them by one
        chunk at most). `cache` is the same object throughout."""
        if isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1:
            raise CacheInputError(f"prefix store: keep_last must be a positive int, got {keep_last!r}")
        if any(not storable(layer, self.chunk) for layer in self.template):
            raise CacheInputError("prefix store: the model's cache has static layers, which a store cannot keep")
        tokens = _check_tokens(tokens, self.model)
        limit = max((len(tokens) - keep_last) // self.chunk * self.chunk, 0)
        reused, cache = self.lookup(tokens, max_tokens=limit)
        yield reused, cache
        for start in range(reused, limit, self.chunk):
            end = start + self.chunk
            ids = torch.tensor([tokens[start:end]], dtype=torch.long, device=self.device)
            with torch.no_grad():
                self.model(ids, cache=cache, position_ids=torch.arange(start, end, device=self.device)[None],
                           **last_logits(self.model))  # fmt: skip
            self.length = end
            self._store_boundary(lambda s, e: [capture(layer, s, e) for layer in cache], heal=True)
            yield reused, cache

    def fed(self, n: int, capture_chunk: Callable[[int, int], list[Payload]]) -> None:
        """The request's cache took the next `n` tokens of the looked-up `tokens` in one forward:
        store every whole chunk boundary it passed, in order (`capture_chunk(start, end)` gives
        the chunk's payloads from the cache as it is now, `end` possibly before its last token)."""
        end = self.length + n
        if end > len(self.tokens):
            raise CacheInputError(f"prefix store: fed {n} token(s) past the {len(self.tokens)} looked up")
        for boundary in range((self.length // self.chunk + 1) * self.chunk, end + 1, self.chunk):
            self.length = boundary
            self._store_boundary(capture_chunk, heal=True)
        self.length = end

    # ---------------------------------------------------------------------------- decode
    def after_forward(self, cache: Cache, ids: torch.Tensor) -> None:
        """The generation driver fed `ids` `[1, n]` into `cache`: store the boundary the cache now
        sits on, if it is the next whole chunk past the last stored one (a forward that crosses a
        boundary without ending on it leaves no state to store there: the path ends)."""
        self.advance(ids, lambda s, e: [capture(layer, s, e) for layer in cache])

    def advance(self, ids: torch.Tensor | Sequence[int], capture_chunk: Callable[[int, int], list[Payload]]) -> None:
        """The request's cache took `ids` (a `[1, n]` tensor, or host ints): when it now holds the
        next whole chunk past the last stored boundary, `capture_chunk(start, end)` gives that
        chunk's payloads (one per layer) and they are stored."""
        n = ids.shape[1] if isinstance(ids, torch.Tensor) else len(ids)
        position = self.length
        self.length += n
        if self.failed or self.length - self.stored > self.chunk:
            self._pending.clear()  # nothing more can be stored along this path
            return
        if position + n > len(self.tokens):
            self._pending.append((position, ids))
        if self.length - self.stored < self.chunk:
            return
        for start, pending in self._pending:  # one host transfer per chunk, not per step
            values = pending[0].tolist() if isinstance(pending, torch.Tensor) else list(pending)
            self.tokens.extend(values[len(self.tokens) - start :])
        self._pending.clear()
        self.extend_keys()
        self._store_boundary(capture_chunk, heal=False)

    # ---------------------------------------------------------------------------- insert
    def _store_boundary(self, capture_chunk: Callable[[int, int], list[Payload]], *, heal: bool) -> None:
        """Capture (`capture_chunk(start, end)`) and store the boundary at `self.length` (its parent
        stored), raising the stored mark on success. `heal`: an entry that exists there but is
        damaged (one the lookup did not reach) is replaced."""
        end = self.length
        if self.failed or self.stored != end - self.chunk or len(self.keys) < end // self.chunk:
            return
        stamp = self.stamp()
        if stamp is None:
            return
        depth = end // self.chunk - 1
        key, parent = self.keys[depth], (self.keys[depth - 1] if depth else None)
        payloads = capture_chunk(end - self.chunk, end)
        writer = self.store.writer
        if writer is None:
            if self._write(key, parent, payloads, depth, stamp, heal):
                self.stored = end
            return
        # a background writer encodes and writes; its inserts run in order, so once one of this
        # session's fails, the later ones (its children) are skipped
        def job() -> None:
            if not self._broken and not self._write(key, parent, payloads, depth, stamp, heal):
                self._broken = True

        if writer.submit(job, sum(p.nbytes for p in payloads)):
            self.stored = end

    def _write(self, key: bytes, parent: bytes | None, payloads: list[Payload], depth: int, stamp: int,
               heal: bool) -> bool:  # fmt: skip
        """Insert one entry (replacing a damaged one there when `heal`); True when the store holds it."""
        outcome = self._insert(key, parent, payloads, depth, stamp)
        if outcome == "exists" and heal:
            records = self.store.guard(lambda: self.store.backend.get_many([key]), [], self)
            if records and self._checked(records[0], depth) is None:
                outcome = self._insert(key, parent, payloads, depth, stamp)
        return outcome in ("stored", "exists")

    def _insert(self, key: bytes, parent: bytes | None, payloads: list[Payload], depth: int, stamp: int) -> str:
        store, backend = self.store, self.store.backend
        entry = Entry(parent, payloads, sum(p.nbytes for p in payloads))
        record: Any = entry if backend.holds_objects else codec.encode(key, entry, store.key)
        size = entry.nbytes if backend.holds_objects else len(record)
        done = store.guard(lambda: backend.insert(key, parent, record, size, depth, stamp, store.max_bytes), None,
                           self)  # fmt: skip
        if done is None:
            return "unavailable"
        store.stats.evictions += done.evicted
        if done.outcome == "stored":
            store.stats.chunks_inserted += 1
        elif done.outcome == "full":
            store.stats.refused += 1
        return done.outcome


def _check_tokens(tokens: Any, model: Any) -> list[int]:
    if isinstance(tokens, torch.Tensor):
        if tokens.dim() != 1 or tokens.is_floating_point():
            raise CacheInputError(f"prefix store: tokens must be a 1-D integer sequence, got {tuple(tokens.shape)}")
        tokens = tokens.tolist()
    if not isinstance(tokens, (list, tuple)):
        raise CacheInputError("prefix store: tokens must be a sequence of ints")
    # (the usual case, plain ints, checked in C: a lookup of a long prompt checks every token)
    if not set(map(type, tokens)) <= {int} and any(isinstance(t, bool) or not isinstance(t, int) for t in tokens):
        raise CacheInputError("prefix store: tokens must be a sequence of ints")
    vocab = getattr(model, "vocab_size", None)
    if isinstance(vocab, int) and tokens and (min(tokens) < 0 or max(tokens) >= vocab):
        raise CacheInputError(f"prefix store: token ids must be in [0, {vocab}) for this model")
    return list(tokens)


def _new_cache(model: Any) -> Cache:
    new_cache = getattr(model, "new_cache", None)
    if new_cache is None:
        raise GenerationError(f"prefix store: {type(model).__name__} has no new_cache(): it is not a kvcache model")
    cache = new_cache()
    if not isinstance(cache, Cache) or getattr(model, "is_encoder_decoder", False):
        raise GenerationError("prefix store: decoder-only models with a kvcache Cache only")
    if not cache.layers:
        raise GenerationError("prefix store: the model's new_cache() builds its layers lazily; it needs them upfront")
    return cache


def _device(model: Any) -> torch.device:
    module = model_module(model)
    param = None if module is None else next(iter(module.parameters()), None)
    return torch.device("cpu") if param is None else param.device
