"""Reading a kvcache file: its safetensors layout parsed and checked here, then every byte read
once, front to back, straight into the memory the cache will own (each layer says where its
tensors land, so a file saved in the layers' own layout is copied by the kernel's read alone), the
whole-file digest computed as the bytes stream past and checked before a cache is returned.

The loaded cache therefore never shares memory with the file: rewriting or truncating the file
afterwards changes nothing (a memory map would let it, or kill the process with SIGBUS).
"""

from __future__ import annotations

import itertools
import json
import math
import os
import struct
from collections.abc import Callable
from typing import Any, BinaryIO

import torch

from ..errors import CacheFormatError
from .integrity import DIGEST_BYTES, DIGEST_TENSOR, FileDigest
from .writer import DTYPE_NAMES

#: safetensors dtype name -> torch dtype
TORCH_DTYPES = {name: dtype for dtype, name in DTYPE_NAMES.items()}
#: safetensors refuses headers larger than this; so do we.
MAX_HEADER_BYTES = 100 * 1024 * 1024
#: Default bound on what a file's layers may allocate beyond the data the file holds (a
#: `StaticLayer` preallocates `max_cache_len`): this many times the file size, plus `ALLOC_SLACK`.
ALLOC_PER_FILE_BYTE = 8
ALLOC_SLACK = 64 * 1024 * 1024


class _Entry:
    __slots__ = ("begin", "dtype", "end", "name", "shape")

    def __init__(self, name: str, dtype: str, shape: list[int], begin: int, end: int) -> None:
        self.name, self.dtype, self.shape, self.begin, self.end = name, dtype, shape, begin, end


def _parse_layout(header: Any, data_bytes: int) -> tuple[dict[str, str], list[_Entry]]:
    """The string metadata and the tensor entries (in file order) of a safetensors JSON header,
    checked to tile the data region exactly."""
    if not isinstance(header, dict):
        raise CacheFormatError("not a valid safetensors file: its header is not a JSON object")
    metadata = header.get("__metadata__", {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise CacheFormatError("not a valid safetensors file: __metadata__ must map strings to strings")
    entries = []
    for name, spec in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(spec, dict) or set(spec) != {"dtype", "shape", "data_offsets"}:
            raise CacheFormatError(f"not a valid safetensors file: tensor {name!r} is not dtype/shape/data_offsets")
        dtype, shape, offsets = spec["dtype"], spec["shape"], spec["data_offsets"]
        ok_shape = isinstance(shape, list) and all(type(n) is int and n >= 0 for n in shape)
        ok_offsets = isinstance(offsets, list) and len(offsets) == 2 and all(type(n) is int for n in offsets)
        if dtype not in TORCH_DTYPES or not ok_shape or not ok_offsets:
            raise CacheFormatError(f"not a valid safetensors file: tensor {name!r} has a bad dtype, shape or offsets")
        size = math.prod(shape) * torch.empty((), dtype=TORCH_DTYPES[dtype]).element_size()
        if offsets[1] - offsets[0] != size:
            raise CacheFormatError(f"not a valid safetensors file: tensor {name!r} spans {offsets} for {size} bytes")
        entries.append(_Entry(name, dtype, shape, offsets[0], offsets[1]))
    entries.sort(key=lambda e: (e.begin, e.end))
    position = 0
    for entry in entries:
        if entry.begin != position:
            raise CacheFormatError(f"not a valid safetensors file: tensor {entry.name!r} does not start at {position}")
        position = entry.end
    if position != data_bytes:
        raise CacheFormatError(
            f"truncated or padded file: tensors cover {position} data bytes, the file holds {data_bytes}"
        )
    return metadata, entries


#: Tensor bytes are read (and hashed) in pieces of this size: small enough that the digest reads
#: each piece from the CPU cache right after the read wrote it, large enough to keep calls few.
READ_PIECE = 1024 * 1024


def _read_exact(file: BinaryIO, buffer: memoryview, digest: FileDigest | None) -> None:
    done = 0
    while done < len(buffer):
        piece = buffer[done : done + READ_PIECE]
        got = file.readinto(piece)
        if not got:
            raise CacheFormatError("truncated file: it ended while being read (was it changed during the load?)")
        if digest is not None:
            digest.update(piece[:got])
        done += got


#: A destination is read block by block when it has at most this many blocks (else: one copy).
MAX_BLOCKS = 1 << 16


def _contiguous_blocks(into: torch.Tensor) -> list[torch.Tensor] | None:
    """`into` as flat views of its contiguous trailing blocks, in row-major order (one view when it
    is contiguous: a head-major cache's `[batch, heads, seq, dim]` view inside larger storage is
    one block per batch row and head), or None when there are too many blocks to read one by one."""
    if into.numel() == 0:
        return []
    if into.is_contiguous():
        return [into.view(-1)]
    lead = 0
    while not into[(0,) * lead].is_contiguous():
        lead += 1
    if math.prod(into.shape[:lead]) > MAX_BLOCKS:
        return None
    return [into[index].view(-1) for index in itertools.product(*(range(n) for n in into.shape[:lead]))]


class FileReader:
    """An open kvcache file, read once, front to back: layout and metadata on opening, then the
    tensors in file order (`take`, `finish`), each into the memory its user chose, with the
    whole-file digest computed as the bytes stream past."""

    def __init__(self, file: BinaryIO, size: int | None = None) -> None:
        """`file` positioned at its start; `size` its length in bytes (default: the file's, by fstat)."""
        self._file = file
        size = os.fstat(file.fileno()).st_size if size is None else size
        head = file.read(8)
        if len(head) != 8:
            raise CacheFormatError(f"not a valid safetensors file: {size} bytes, too short for a header")
        (header_len,) = struct.unpack("<Q", head)
        if header_len > min(MAX_HEADER_BYTES, size - 8):
            raise CacheFormatError(f"not a valid safetensors file: header length {header_len} for a {size}-byte file")
        header_bytes = file.read(header_len)
        if len(header_bytes) != header_len:
            raise CacheFormatError("truncated file: it ended inside the header")
        self.file_size = size
        self._prefix = head + header_bytes
        try:
            header = json.loads(header_bytes)
        except (ValueError, RecursionError) as err:
            raise CacheFormatError(f"not a valid safetensors file: header is not JSON ({err})") from None
        self.metadata, self.entries = _parse_layout(header, size - 8 - header_len)
        self._position = {entry.name: i for i, entry in enumerate(self.entries)}
        self._next = 0  # index of the first entry not read yet
        self._ahead: dict[str, torch.Tensor] = {}  # read before anyone asked for them
        self._integrity: str | None = None
        self._key: bytes | None = None
        self._digest: FileDigest | None = None
        self._stored = b""

    def start(self, integrity: str | None, key: bytes | None, verify: bool) -> None:
        """Begin reading the tensors; with `verify`, every byte is hashed for `finish` to check."""
        self._integrity, self._key = integrity, key
        if verify and integrity is not None:
            self._digest = FileDigest(key, scheme=integrity)
            self._digest.update(self._prefix)

    def take(self, name: str, into: torch.Tensor | None = None) -> torch.Tensor:
        """Tensor `name` (in the file's shape), read into `into` (that shape and dtype, any strides)
        or into fresh memory. Tensors stored before it are read first and kept for later; each
        tensor can be taken once."""
        held = self._ahead.pop(name, None)
        if held is None:
            position = self._position[name]
            if position < self._next:
                raise CacheFormatError(f"tensor {name!r} is read twice")
            while self._next < position:
                skipped = self.entries[self._next]
                self._ahead[skipped.name] = self._read_next(None)
            return self._read_next(into)
        if into is None:
            return held
        return into.copy_(held)

    def _read_next(self, into: torch.Tensor | None) -> torch.Tensor:
        entry = self.entries[self._next]
        self._next += 1
        if entry.name == DIGEST_TENSOR:
            expected = [DIGEST_BYTES.get(self._integrity or "", -1)]
            if entry is not self.entries[-1] or entry.dtype != "U8" or entry.shape != expected:
                raise CacheFormatError("the file digest is misplaced or of the wrong size")
            raw = bytearray(entry.end - entry.begin)
            _read_exact(self._file, memoryview(raw), None)
            self._stored = bytes(raw)
            return torch.empty(0, dtype=torch.uint8)
        blocks = None if into is None else _contiguous_blocks(into)
        if blocks is not None:  # straight into the destination, block by block
            for block in blocks:
                _read_exact(self._file, memoryview(block.view(torch.uint8).numpy()), self._digest)
            return into  # type: ignore[return-value]
        tensor = torch.empty(entry.shape, dtype=TORCH_DTYPES[entry.dtype])
        if tensor.numel():
            _read_exact(self._file, memoryview(tensor.view(-1).view(torch.uint8).numpy()), self._digest)
        if into is not None:  # a destination of other strides: one more copy
            return into.copy_(tensor)
        return tensor

    def finish(self) -> dict[str, torch.Tensor]:
        """Read what is left, check the digest (`CacheFormatError` on a mismatch or when it is
        missing) and return the tensors nobody took."""
        while self._next < len(self.entries):
            name = self.entries[self._next].name
            tensor = self._read_next(None)
            if name != DIGEST_TENSOR:
                self._ahead[name] = tensor
        if self._integrity is not None and not self._stored:
            raise CacheFormatError("the file digest is missing")
        if self._digest is not None:
            self._digest.verify(self._stored, self._key)
        left, self._ahead = self._ahead, {}
        return left

    def read_all(self, integrity: str | None, key: bytes | None, verify: bool) -> dict[str, torch.Tensor]:
        """Every tensor but the digest, read into fresh CPU memory; with `verify`, the digest of
        every byte of the file checked (`CacheFormatError` on a mismatch)."""
        self.start(integrity, key, verify)
        return self.finish()


def physical_shape(shape: list[int], order: list[int] | None) -> list[int]:
    """The shape a tensor of logical `shape` is stored in when its dims are stored in `order`."""
    return shape if order is None else [shape[d] for d in order]


class LoadedTensors:
    """The `TensorSource` a cache is built from: each tensor handed out once after checking its dtype
    and shape, read into the memory its layer chose (`CacheLayer.load_target`) when loading to the
    CPU, or moved to the target device; and an allocation budget layers charge before allocating.

    To a CUDA device each tensor is read into pinned host memory (torch's caching host allocator
    reuses it) and copied without waiting, so the copy of one tensor overlaps the read of the next
    and the file's bytes are copied once on the host, as safetensors' own device load does."""

    def __init__(self, reader: FileReader, device: str, budget: int) -> None:
        self._reader, self._device, self._budget = reader, device, budget
        self._pinned = device != "cpu" and torch.device(device).type == "cuda" and torch.cuda.is_available()
        #: tensor name -> (safetensors dtype, shape as stored), in file order
        self.stored = {e.name: (e.dtype, e.shape) for e in reader.entries if e.name != DIGEST_TENSOR}
        self._taken: dict[str, tuple[str, list[int]]] = {}  # name -> (dtype, logical shape)

    def take(self, name: str, dtype: str, shape: list[int], where: str, order: list[int] | None = None,
             target: Callable[[], torch.Tensor] | None = None) -> torch.Tensor:  # fmt: skip
        """Tensor `name` of `dtype` and logical `shape`, stored with its dims in `order` (None: as
        they are). `target()` allocates where it should land (logical shape, any strides)."""
        if name not in self.stored:
            raise CacheFormatError(f"{where}: tensor {name!r} is missing from the file")
        if name in self._taken:
            raise CacheFormatError(f"{where}: tensor {name!r} is used twice")
        stored = physical_shape(shape, order)
        if self.stored[name] != (dtype, stored):
            file_dtype, file_shape = self.stored[name]
            raise CacheFormatError(
                f"{where}: tensor {name!r} is {file_dtype}{file_shape} in the file but the description "
                f"says {dtype}{stored}"[:400]
            )
        self._taken[name] = (dtype, shape)
        if target is not None and self._device == "cpu":
            landing = target()
            self.charge(landing.untyped_storage().nbytes() - landing.nbytes, where)
            self._reader.take(name, landing if order is None else landing.permute(order))
            return landing
        landing = torch.empty(stored, dtype=TORCH_DTYPES[dtype], pin_memory=True) if self._pinned else None
        tensor = self._reader.take(name, landing)
        if order is not None:
            tensor = tensor.permute(sorted(range(len(order)), key=order.__getitem__))
        return tensor.to(self._device, non_blocking=self._pinned)

    def charge(self, nbytes: int, where: str) -> None:
        """Count `nbytes` a layer is about to allocate; `CacheFormatError` past the budget."""
        self._budget -= nbytes
        if self._budget < 0:
            raise CacheFormatError(
                f"{where}: the file asks for {nbytes} bytes of storage, past what a file of its size may "
                "allocate; pass load_cache(..., max_alloc_bytes=N) to allow it"
            )

    def finish(self) -> dict[str, tuple[str, list[int]]]:
        """Read the rest of the file, check its digest, and refuse tensors no layer took; return
        every tensor's dtype and (logical) shape, in file order."""
        unused = sorted(self._reader.finish())
        if unused:
            raise CacheFormatError(f"the file holds tensors no layer describes: {unused[:5]}")
        return {name: self._taken[name] for name in self.stored}

    def raise_if_damaged(self) -> None:
        """After a failed build: raise the digest's verdict instead when the file is damaged (a
        flipped bit breaks the description before the digest is reached)."""
        self._reader.finish()


def default_budget(file_size: int) -> int:
    return ALLOC_PER_FILE_BYTE * file_size + ALLOC_SLACK
