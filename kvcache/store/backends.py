"""Where a prefix store keeps its entries: the interface every backend implements, the recency
rule they share, and the in-process backend.

No operation scans: backends keep an index ordered by recency (a heap here, an SQLite index for a
directory, a sorted set on Redis), so every operation costs O(log n) in the entries held.

Recency rule. A request takes a *stamp* (`begin`, increasing across everyone sharing the backend),
and every entry it reads or writes gets the score `score(stamp, depth)`, never lowered. A chunk's
parent is scored with the same stamp and a smaller depth, hence higher: a prefix is always more
recent than every chunk that extends it, so evicting the lowest score evicts leaves first and no
stored chunk loses its prefix. An insert evicts only entries scored below its own request's
stamp (`floor`): the path a request is building is never evicted to make room for itself, and a
chunk that does not fit then is refused.
"""

from __future__ import annotations

import heapq
import itertools
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from ..errors import KVCacheError
from .payloads import Payload

#: Scores are `stamp * DEPTHS + (DEPTHS - 1 - depth)`: one stamp spans DEPTHS scores, deeper lower.
DEPTHS = 1 << 20


def score(stamp: int, depth: int) -> int:
    """The recency score of a chunk `depth` chunks deep (0 for a prompt's first chunk) used by the
    request of `stamp`."""
    return stamp * DEPTHS + (DEPTHS - 1 - min(depth, DEPTHS - 1))


def floor(stamp: int) -> int:
    """Scores below this belong to earlier requests: what a request of `stamp` may evict."""
    return stamp * DEPTHS


@dataclass
class Entry:
    """One stored chunk: the key of the chunk before it (None for a prompt's first chunk) and one
    payload per cache layer; `nbytes` is the bytes of its tensors."""

    parent: bytes | None
    payloads: list[Payload]
    nbytes: int
    #: `(model root, depth)` where a lookup last found it sound: the memory backend hands the same
    #: entry to every lookup, so its payloads are checked against the model once, not per hit
    checked: tuple[bytes, int] | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class Inserted:
    """What `Backend.insert` did: "stored", "exists" (already held; its score was raised),
    "orphan" (its parent is not held, so it was not stored) or "full" (it does not fit without
    evicting entries of this request); `evicted` entries went to make room."""

    outcome: str
    evicted: int = 0


class StoreUnavailable(KVCacheError):
    """The backend did not answer (a timeout, a refused connection, a read-only directory for a
    write): the store treats it as a miss and leaves the backend alone for a while."""


class Backend(Protocol):
    """The operations a prefix store needs. Backends with `holds_objects` keep `Entry` objects;
    the others keep the bytes `codec.encode` makes (directory files, Redis values) and return
    them undecoded, for the store to verify and check."""

    location: str
    holds_objects: bool
    strict: bool

    def begin(self) -> int: ...
    def get_many(self, keys: Sequence[bytes]) -> list[Any]: ...
    def record_lookup(self, keys: Sequence[bytes], stamp: int, tokens: int) -> None: ...
    def insert(self, key: bytes, parent: bytes | None, record: Any, size: int, depth: int, stamp: int,
               max_bytes: int) -> Inserted: ...  # fmt: skip
    def discard(self, key: bytes) -> None: ...
    def nbytes(self) -> int: ...
    def summary(self) -> dict[str, int]: ...
    def shrink_to(self, max_bytes: int) -> int: ...
    def clear(self) -> None: ...
    def counters(self) -> dict[str, int]: ...
    def close(self) -> None: ...


class _Held:
    __slots__ = ("entry", "score")

    def __init__(self, entry: Entry, score: int) -> None:
        self.entry, self.score = entry, score


class MemoryBackend:
    """Entries in a dict of this process, sizes the bytes of their tensors; a heap orders them by
    score (stale heap items, left by score raises and deletions, are skipped and compacted)."""

    location = "memory"
    holds_objects = True
    strict = False

    def __init__(self) -> None:
        self._held: dict[bytes, _Held] = {}
        self._heap: list[tuple[int, bytes]] = []
        self._bytes = 0
        self._stamps = itertools.count(1)
        self._lock = threading.Lock()  # a server's request threads may share one store

    def begin(self) -> int:
        with self._lock:
            return next(self._stamps)

    def close(self) -> None:
        """Nothing to release: the entries live as long as this object."""

    def get_many(self, keys: Sequence[bytes]) -> list[Any]:
        out = []
        for key in keys:
            held = self._held.get(key)
            if held is None:
                break
            out.append(held.entry)
        return out

    def _raise(self, key: bytes, new: int) -> None:
        held = self._held.get(key)
        if held is not None and new > held.score:
            held.score = new
            heapq.heappush(self._heap, (new, key))

    def record_lookup(self, keys: Sequence[bytes], stamp: int, tokens: int) -> None:
        """Raise the scores of a lookup's path (`keys`, root first); its counts are the store's `stats`."""
        with self._lock:
            for depth, key in enumerate(keys):
                self._raise(key, score(stamp, depth))
            self._compact()

    def insert(self, key: bytes, parent: bytes | None, record: Any, size: int, depth: int, stamp: int,
               max_bytes: int) -> Inserted:  # fmt: skip
        with self._lock:
            if key in self._held:
                self._raise(key, score(stamp, depth))
                return Inserted("exists")
            if parent is not None and parent not in self._held:
                return Inserted("orphan")
            evicted = 0
            while self._bytes + size > max_bytes:
                victim = self._lowest()
                if victim is None or self._held[victim].score >= floor(stamp):
                    return Inserted("full", evicted)
                self._drop(victim)
                evicted += 1
            self._held[key] = _Held(record, score(stamp, depth))
            heapq.heappush(self._heap, (self._held[key].score, key))
            self._bytes += size
            if parent is not None:
                self._raise(parent, score(stamp, depth - 1))
            self._compact()
            return Inserted("stored", evicted)

    def _lowest(self) -> bytes | None:
        """The key of the lowest score (stale heap items dropped on the way)."""
        while self._heap:
            value, key = self._heap[0]
            held = self._held.get(key)
            if held is not None and held.score == value:
                return key
            heapq.heappop(self._heap)
        return None

    def _drop(self, key: bytes) -> None:
        held = self._held.pop(key, None)
        if held is not None:
            self._bytes -= held.entry.nbytes

    def _compact(self) -> None:
        if len(self._heap) > 2 * len(self._held) + 64:
            self._heap = [(held.score, key) for key, held in self._held.items()]
            heapq.heapify(self._heap)

    def discard(self, key: bytes) -> None:
        with self._lock:
            self._drop(key)

    def nbytes(self) -> int:
        return self._bytes

    def summary(self) -> dict[str, int]:
        roots = sum(1 for held in self._held.values() if held.entry.parent is None)
        return {"chunks": len(self._held), "roots": roots, "bytes": self._bytes}

    def shrink_to(self, max_bytes: int) -> int:
        with self._lock:
            evicted = 0
            while self._bytes > max_bytes and (victim := self._lowest()) is not None:
                self._drop(victim)
                evicted += 1
            return evicted

    def clear(self) -> None:
        with self._lock:
            self._held.clear()
            self._heap.clear()
            self._bytes = 0

    def counters(self) -> dict[str, int]:
        return {}

    def entries(self) -> dict[bytes, Entry]:
        """The held entries by key (a copy of the index; for inspection and tests)."""
        return {key: held.entry for key, held in self._held.items()}
