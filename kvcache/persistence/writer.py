"""Streaming safetensors writer and atomic file replacement.

The writer emits the safetensors layout (8-byte little-endian header length, JSON header, raw
little-endian bytes) straight from the live tensors: a tensor whose trailing dimensions are
contiguous (a cache's live window inside larger storage) is written as its contiguous rows, so
saving neither packs a copy of the cache nor needs all tensors at once. Files are read back with
safetensors' own reader.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import math
import os
import re
import socket
import struct
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import BinaryIO

import torch

from ..errors import CacheInputError
from .integrity import DIGEST_TENSOR, FileDigest

#: torch dtype -> safetensors dtype name (the ones both sides know).
DTYPE_NAMES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.complex64: "C64",
}
for _attr, _name in (
    ("float8_e4m3fn", "F8_E4M3"),
    ("float8_e5m2", "F8_E5M2"),
    ("uint16", "U16"),
    ("uint32", "U32"),
    ("uint64", "U64"),
):
    if hasattr(torch, _attr):
        DTYPE_NAMES[getattr(torch, _attr)] = _name

#: A tensor is written row by row when that takes at most this many rows ...
MAX_ROWS_PER_TENSOR = 4096
#: ... and each row holds at least this many bytes; smaller rows are gathered into slices of
#: at most this many bytes (or one leading index's worth, if larger) and written from one buffer.
MIN_ROW_BYTES = 64 * 1024
PACK_BYTES = 4 * 1024 * 1024
#: Bytes are written in pieces of at most this size; a piece of at least `OVERLAP_BYTES` is hashed
#: in a second thread while it is written (measured: a save then costs what the write costs).
WRITE_PIECE = 4 * 1024 * 1024
OVERLAP_BYTES = 256 * 1024


def dtype_name(dtype: torch.dtype, what: str) -> str:
    """The safetensors name of `dtype`; `CacheInputError` for a dtype the format cannot hold."""
    name = DTYPE_NAMES.get(dtype)
    if name is None:
        raise CacheInputError(f"{what}: dtype {dtype} cannot be saved (supported: {sorted(DTYPE_NAMES.values())})")
    return name


def _rows(tensor: torch.Tensor) -> Iterator[memoryview]:
    """The bytes of `tensor` in row-major order, as views of its own storage where possible."""
    tensor = tensor.detach()
    if tensor.device.type != "cpu":
        tensor = tensor.cpu()  # one tensor at a time, never the whole cache
    if tensor.numel() == 0:
        return
    lead = 0  # the fewest leading dims to iterate over so that each row is contiguous
    while not tensor[(0,) * lead].is_contiguous():
        lead += 1
    row_bytes = math.prod(tensor.shape[lead:]) * tensor.element_size()
    if not lead or (math.prod(tensor.shape[:lead]) <= MAX_ROWS_PER_TENSOR and row_bytes >= MIN_ROW_BYTES):
        for index in itertools.product(*(range(n) for n in tensor.shape[:lead])):
            yield memoryview(tensor[index].reshape(-1).view(torch.uint8).numpy())
        return
    # Rows too small to write one by one (many short (batch, head) blocks of a small cache):
    # gather slices of about PACK_BYTES into one reused buffer (no whole-tensor copy, no fresh
    # pages per tensor), each written before the next overwrites it.
    def slice_bytes(dims: int) -> int:
        return math.prod(tensor.shape[dims:]) * tensor.element_size()

    k = 0
    while k < lead and slice_bytes(k) > PACK_BYTES and slice_bytes(k + 1) >= MIN_ROW_BYTES:
        k += 1
    buffer = torch.empty(tensor.shape[k:], dtype=tensor.dtype)
    flat = buffer.view(-1).view(torch.uint8).numpy()
    for index in itertools.product(*(range(n) for n in tensor.shape[:k])):
        buffer.copy_(tensor[index])
        yield memoryview(flat)


def write_safetensors(
    file: BinaryIO, tensors: dict[str, torch.Tensor], metadata: dict[str, str], digest: FileDigest
) -> None:
    """Write `tensors` (in order) and string `metadata` to `file` in safetensors format, then the
    digest of every byte before it as the last tensor (`DIGEST_TENSOR`)."""
    if sys.byteorder != "little":
        raise CacheInputError("saving caches is only supported on little-endian machines")
    header: dict[str, object] = {"__metadata__": metadata}
    offset = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        header[name] = {
            "dtype": dtype_name(tensor.dtype, name),
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    header[DIGEST_TENSOR] = {"dtype": "U8", "shape": [digest.nbytes], "data_offsets": [offset, offset + digest.nbytes]}
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned

    def emit(data: bytes | memoryview) -> None:
        """Write `data`; large pieces are hashed in another thread while the write runs (the hash
        releases the GIL), and both finish before the caller reuses the memory."""
        if len(data) < OVERLAP_BYTES:
            file.write(data)
            digest.update(data)
            return
        for lo in range(0, len(data), WRITE_PIECE):
            piece = data[lo : lo + WRITE_PIECE]
            hashed = _hasher().submit(digest.update, piece)
            file.write(piece)
            hashed.result()

    emit(struct.pack("<Q", len(encoded)))
    emit(encoded)
    for tensor in tensors.values():
        for row in _rows(tensor):
            emit(row)
    file.write(digest.digest())


_HASHER: tuple[int, ThreadPoolExecutor] | None = None


def _hasher() -> ThreadPoolExecutor:
    """The thread that hashes pieces while they are written: one per process, started on first use
    (a forked child starts its own: the parent's thread does not exist there)."""
    global _HASHER
    if _HASHER is None or _HASHER[0] != os.getpid():
        _HASHER = (os.getpid(), ThreadPoolExecutor(1, thread_name_prefix="kvcache-digest"))
    return _HASHER[1]


def _umask() -> int:
    with contextlib.suppress(OSError, ValueError, StopIteration):  # Linux: read it without changing it
        status = Path("/proc/self/status").read_text()
        return int(next(line for line in status.splitlines() if line.startswith("Umask:")).split()[1], 8)
    umask = os.umask(0o022)  # elsewhere: set and restore (not atomic against other threads)
    os.umask(umask)
    return umask


def _new_file_mode(path: Path) -> int:
    """Permissions for the file: those of the file it replaces, else the default under the umask."""
    with contextlib.suppress(OSError):
        return path.stat().st_mode & 0o7777
    return 0o666 & ~_umask()


#: Temporary files of saves in progress: `.<name>.<host tag>.<pid>.<random>` + this suffix.
TEMP_SUFFIX = ".kvcache-tmp"
_TEMP_NAME = re.compile(r"^\..*\.([0-9a-f]{8})\.(\d+)\.[A-Za-z0-9_]+" + re.escape(TEMP_SUFFIX) + "$")
_HOST = hashlib.blake2b(socket.gethostname().encode(), digest_size=4).hexdigest()
#: A temporary file of a save whose process is gone is removed once it is this old (seconds) ...
STALE_AFTER_DEAD_S = 60.0
#: ... and one whose writer cannot be checked (another host, or a reused pid) once it is this old.
STALE_AFTER_S = 24 * 3600.0


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, OSError):
        return True  # exists (another user's), or cannot tell: keep the file
    return True


def remove_stale_temporaries(directory: Path) -> list[str]:
    """Remove the temporary files that killed saves left in `directory`; return their names.

    Only files named as `atomic_write` names them are considered, and only when they are old: their
    writer on this host is gone and they are a minute old, or they are a day old (a writer on another
    host, or a pid reused since). A save in progress is never touched.
    """
    removed = []
    now = time.time()
    with contextlib.suppress(OSError):
        for entry in os.scandir(directory):
            match = _TEMP_NAME.match(entry.name)
            if match is None or not entry.is_file(follow_symlinks=False):
                continue
            host, pid = match.group(1), int(match.group(2))
            with contextlib.suppress(OSError):
                age = now - entry.stat(follow_symlinks=False).st_mtime
                gone = host == _HOST and pid != os.getpid() and not _process_alive(pid)
                if (gone and age > STALE_AFTER_DEAD_S) or age > STALE_AFTER_S:
                    os.unlink(entry.path)
                    removed.append(entry.name)
    return removed


def atomic_write(path: Path, write: Callable[[BinaryIO], None], *, fsync: bool = True) -> None:
    """Create `path` through `write(file)` so that it either appears complete or not at all.

    Stale temporary files of earlier, killed saves in that directory are removed first
    (`remove_stale_temporaries`). The data goes to a temporary file in the same directory, is
    flushed (to disk with `fsync`, so that a power loss cannot leave a renamed but empty file),
    then renamed over `path`. On any failure the temporary file is removed and `path` is left as
    it was; an `OSError` names `path`, not the temporary file.
    """
    try:
        _write_via_temporary(path, write, fsync)
    except OSError as err:
        if err.errno is None:
            raise
        raise OSError(err.errno, f"cannot save {path}: {err.strerror}") from err


def _write_via_temporary(path: Path, write: Callable[[BinaryIO], None], fsync: bool) -> None:
    remove_stale_temporaries(path.parent)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name[:100]}.{_HOST}.{os.getpid()}.", suffix=TEMP_SUFFIX,
                                    dir=path.parent)  # fmt: skip
    try:
        with os.fdopen(fd, "wb") as file:
            write(file)
            file.flush()
            if fsync:
                os.fsync(file.fileno())
        os.chmod(tmp_name, _new_file_mode(path))
        os.replace(tmp_name, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp_name)
        raise
    if not fsync:
        return
    with contextlib.suppress(OSError):  # make the rename itself durable (not possible everywhere)
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
