"""Where a prefix store keeps its entries: one small key/value interface, two implementations.

`MemoryBackend` holds entries in this process. `DirectoryBackend` keeps one safetensors file per
entry in a directory, so a store survives restarts and several processes can share it: a file is
written to a temporary name and renamed into place (readers see a whole entry or none; two writers
of one key write the same content, and the last rename wins), carries an xxh3 digest of its
tensors, and is read into memory the process owns. A file that fails to read or verify is a miss:
it is deleted, and a warning says why. Recency is the file's modification time, refreshed on each
read, so least-recently-used eviction works across processes.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
import xxhash
from safetensors.torch import load as safetensors_load
from safetensors.torch import save as safetensors_save

from ..errors import CacheFormatError, CacheInputError
from .payloads import Delta, HybridPayload, Payload, Snapshot, WindowDelta


@dataclass
class Entry:
    """One stored chunk: the key of the chunk before it, per-layer payloads, its size and recency."""

    parent: bytes | None
    payloads: list[Payload]
    nbytes: int
    last_used: float


@dataclass(frozen=True)
class EntryInfo:
    """What eviction needs to know of an entry without reading its tensors."""

    key: bytes
    parent: bytes | None
    nbytes: int
    last_used: float


class Backend(Protocol):
    """get / put / exists / delete by key, with byte sizes; `infos` lists every entry for eviction,
    `size` says what an entry will take, `locked` serializes check-evict-put among sharers."""

    def get(self, key: bytes) -> Entry | None: ...
    def put(self, key: bytes, entry: Entry) -> None: ...
    def exists(self, key: bytes) -> bool: ...
    def delete(self, key: bytes) -> None: ...
    def infos(self) -> Iterator[EntryInfo]: ...
    def nbytes(self) -> int: ...
    def size(self, entry: Entry) -> int: ...
    def locked(self) -> contextlib.AbstractContextManager[None]: ...
    def count(self, lookups: int, hits: int, tokens: int) -> None: ...
    def counters(self) -> dict[str, int]: ...


class MemoryBackend:
    """Entries in a dict of this process; sizes are the bytes of their tensors."""

    location = "memory"

    def __init__(self) -> None:
        self._entries: dict[bytes, Entry] = {}
        self._bytes = 0

    def get(self, key: bytes) -> Entry | None:
        entry = self._entries.get(key)
        if entry is not None:
            entry.last_used = time.time()
        return entry

    def put(self, key: bytes, entry: Entry) -> None:
        if key not in self._entries:
            self._entries[key] = entry
            self._bytes += entry.nbytes

    def exists(self, key: bytes) -> bool:
        return key in self._entries

    def delete(self, key: bytes) -> None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self._bytes -= entry.nbytes

    def infos(self) -> Iterator[EntryInfo]:
        for key, e in self._entries.items():
            yield EntryInfo(key, e.parent, e.nbytes, e.last_used)

    def nbytes(self) -> int:
        return self._bytes

    def size(self, entry: Entry) -> int:
        return entry.nbytes

    def locked(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def count(self, lookups: int, hits: int, tokens: int) -> None:
        pass  # the store's own `stats` are the counters of an in-process store

    def counters(self) -> dict[str, int]:
        return {}

    def entries(self) -> dict[bytes, Entry]:
        return self._entries


# -------------------------------------------------------------------------- serialization
def _describe(payload: Payload, prefix: str, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    if isinstance(payload, WindowDelta):
        tensors[f"{prefix}keys"], tensors[f"{prefix}values"] = payload.keys, payload.values
        return {"kind": "window", "window": payload.window}
    if isinstance(payload, Delta):
        tensors[f"{prefix}keys"], tensors[f"{prefix}values"] = payload.keys, payload.values
        return {"kind": "delta"}
    if isinstance(payload, HybridPayload):
        return {
            "kind": "hybrid",
            "attention": _describe(payload.attention, prefix + "a.", tensors),
            "recurrent": _describe(payload.recurrent, prefix + "r.", tensors),
        }
    for name, t in payload.state.items():
        tensors[f"{prefix}s.{name}"] = t
    return {"kind": "snapshot", "cls": payload.cls, "meta": payload.meta, "names": sorted(payload.state)}


def _restore(desc: dict[str, Any], prefix: str, tensors: dict[str, torch.Tensor]) -> Payload:
    kind = desc["kind"]
    if kind == "window":
        return WindowDelta(tensors[f"{prefix}keys"], tensors[f"{prefix}values"], int(desc["window"]))
    if kind == "delta":
        return Delta(tensors[f"{prefix}keys"], tensors[f"{prefix}values"])
    if kind == "hybrid":
        recurrent = _restore(desc["recurrent"], prefix + "r.", tensors)
        assert isinstance(recurrent, Snapshot)
        return HybridPayload(_restore(desc["attention"], prefix + "a.", tensors), recurrent)  # type: ignore[arg-type]
    if kind != "snapshot":
        raise CacheFormatError(f"unknown payload kind {kind!r}")
    return Snapshot(str(desc["cls"]), dict(desc["meta"]), {n: tensors[f"{prefix}s.{n}"] for n in desc["names"]})


def _digest(tensors: dict[str, torch.Tensor]) -> str:
    h = xxhash.xxh3_128()
    for name in sorted(tensors):
        h.update(name.encode())
        h.update(tensors[name].contiguous().view(torch.uint8).numpy().tobytes() if tensors[name].numel() else b"")
    return h.hexdigest()


def encode(entry: Entry) -> bytes:
    tensors: dict[str, torch.Tensor] = {}
    layers = [_describe(p, f"L{i}.", tensors) for i, p in enumerate(entry.payloads)]
    tensors = {k: v.contiguous() for k, v in tensors.items()}
    meta = {"parent": None if entry.parent is None else entry.parent.hex(), "layers": layers,
            "nbytes": entry.nbytes, "digest": _digest(tensors)}  # fmt: skip
    return safetensors_save(tensors, metadata={"kvcache_store": json.dumps(meta)})


def decode(data: bytes) -> Entry:
    """An entry from its file's bytes; `CacheFormatError` when they are not a whole, valid entry."""
    try:
        tensors = safetensors_load(data)
        header_len = int.from_bytes(data[:8], "little")
        meta = json.loads(json.loads(data[8 : 8 + header_len])["__metadata__"]["kvcache_store"])
        if _digest(tensors) != meta["digest"]:
            raise CacheFormatError("digest mismatch")
        payloads = [_restore(d, f"L{i}.", tensors) for i, d in enumerate(meta["layers"])]
        parent = None if meta["parent"] is None else bytes.fromhex(meta["parent"])
        return Entry(parent, payloads, int(meta["nbytes"]), time.time())
    except CacheFormatError:
        raise
    except Exception as exc:  # safetensors, JSON, missing keys: a damaged or foreign file
        raise CacheFormatError(f"not a valid store entry ({type(exc).__name__}: {exc})") from exc


class DirectoryBackend:
    """One `<key>.kvstore` safetensors file per entry in `path` (created if missing); sizes are the
    files' sizes. `strict`: a damaged entry or a failed write raises `CacheFormatError` instead of
    warning (the entry is dropped either way)."""

    SUFFIX = ".kvstore"

    def __init__(self, path: str | os.PathLike[str], *, strict: bool = False) -> None:
        self.path = Path(path)
        if self.path.exists() and not self.path.is_dir():
            raise CacheInputError(f"prefix store directory {str(path)!r} is a file, not a directory")
        try:
            self.path.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise CacheInputError(f"prefix store directory {str(path)!r}: {exc.strerror or exc}") from exc
        if not self.path.is_dir():
            raise CacheInputError(f"prefix store directory {str(path)!r} is not a directory")
        self.strict = strict
        self._encoded: tuple[int, bytes] | None = None  # (id of the entry, its file's bytes), from `size`

    @property
    def location(self) -> str:
        return str(self.path)

    def _file(self, key: bytes) -> Path:
        return self.path / (key.hex() + self.SUFFIX)

    def _failed(self, key: bytes, why: str) -> None:
        message = f"prefix store entry {key.hex()[:16]}... in {self.path}: {why}; dropped"
        self.delete(key)
        if self.strict:
            raise CacheFormatError(message)
        warnings.warn(message, stacklevel=3)

    def get(self, key: bytes) -> Entry | None:
        path = self._file(key)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as exc:
            self._failed(key, f"cannot be read ({exc.strerror or exc})")
            return None
        try:
            entry = decode(data)
        except CacheFormatError as exc:
            self._failed(key, str(exc))
            return None
        with contextlib.suppress(OSError):
            os.utime(path)  # recency, for every process sharing the directory
        return entry

    def put(self, key: bytes, entry: Entry) -> None:
        path = self._file(key)
        if path.exists():
            return
        tmp = self.path / f".{key.hex()}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
        data = self._encoded[1] if self._encoded and self._encoded[0] == id(entry) else encode(entry)
        self._encoded = None
        try:
            tmp.write_bytes(data)
            os.replace(tmp, path)
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            if self.strict:
                raise CacheFormatError(f"prefix store: cannot write {path}: {exc.strerror or exc}") from exc
            warnings.warn(f"prefix store: cannot write {path}: {exc.strerror or exc}", stacklevel=3)

    def exists(self, key: bytes) -> bool:
        return self._file(key).exists()

    def delete(self, key: bytes) -> None:
        self._file(key).unlink(missing_ok=True)

    def infos(self) -> Iterator[EntryInfo]:
        for path in self.path.glob("*" + self.SUFFIX):
            try:
                stat = path.stat()
                with open(path, "rb") as f:
                    header_len = int.from_bytes(f.read(8), "little")
                    meta = json.loads(json.loads(f.read(header_len))["__metadata__"]["kvcache_store"])
                parent = None if meta["parent"] is None else bytes.fromhex(meta["parent"])
                yield EntryInfo(bytes.fromhex(path.name[: -len(self.SUFFIX)]), parent, stat.st_size, stat.st_mtime)
            except (OSError, ValueError, KeyError, TypeError):
                continue  # removed meanwhile, or damaged: `get` drops it when asked for it

    def size(self, entry: Entry) -> int:
        data = encode(entry)
        self._encoded = (id(entry), data)
        return len(data)

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """An exclusive lock on the directory (`flock` on its lock file): the budget holds across
        processes."""
        import fcntl

        with open(self.path / ".lock", "a+b") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    def count(self, lookups: int, hits: int, tokens: int) -> None:
        """Add to the directory's lookup counters (`stats.json`), shared by every process using it."""
        with self.locked():
            counts = self.counters()
            for name, value in (("lookups", lookups), ("hits", hits), ("tokens_reused", tokens)):
                counts[name] = counts.get(name, 0) + value
            tmp = self.path / f".stats.{os.getpid()}.tmp"
            with contextlib.suppress(OSError):
                tmp.write_text(json.dumps(counts))
                os.replace(tmp, self.path / "stats.json")

    def counters(self) -> dict[str, int]:
        try:
            counts = json.loads((self.path / "stats.json").read_text())
            return {k: int(v) for k, v in counts.items()} if isinstance(counts, dict) else {}
        except (OSError, ValueError, TypeError):
            return {}

    def nbytes(self) -> int:
        total = 0
        for path in self.path.glob("*" + self.SUFFIX):
            try:
                total += path.stat().st_size
            except OSError:
                continue
        return total
