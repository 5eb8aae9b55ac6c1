"""Reading a kvcache file: its safetensors layout parsed and checked here, every byte read once
into memory the cache then owns, and the whole-file digest verified before anything is built.

The loaded cache therefore never shares memory with the file: rewriting or truncating the file
afterwards changes nothing (a memory map would let it, or kill the process with SIGBUS).
"""

from __future__ import annotations

import json
import math
import os
import struct
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
_READ_CHUNK = 64 * 1024 * 1024


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


def _read_exact(file: BinaryIO, buffer: memoryview, digest: FileDigest | None) -> None:
    done = 0
    while done < len(buffer):
        chunk = buffer[done : done + _READ_CHUNK]
        got = file.readinto(chunk)
        if not got:
            raise CacheFormatError("truncated file: it ended while being read (was it changed during the load?)")
        if digest is not None:
            digest.update(chunk[:got])
        done += got


class FileReader:
    """An open kvcache file, read front to back: layout, metadata, then tensors."""

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

    def read_all(self, integrity: str | None, key: bytes | None, verify: bool) -> dict[str, torch.Tensor]:
        """Every tensor but the digest, read into fresh CPU memory; with `verify`, the digest of
        every byte of the file checked first (`CacheFormatError` on a mismatch)."""
        digest = None
        if verify and integrity is not None:
            digest = FileDigest(key, scheme=integrity)
            digest.update(self._prefix)
        tensors: dict[str, torch.Tensor] = {}
        stored = b""
        for entry in self.entries:
            if entry.name == DIGEST_TENSOR:
                expected = [DIGEST_BYTES.get(integrity or "", -1)]
                if entry is not self.entries[-1] or entry.dtype != "U8" or entry.shape != expected:
                    raise CacheFormatError("the file digest is misplaced or of the wrong size")
                raw = bytearray(entry.end - entry.begin)
                _read_exact(self._file, memoryview(raw), None)
                stored = bytes(raw)
                continue
            tensor = torch.empty(entry.shape, dtype=TORCH_DTYPES[entry.dtype])
            if tensor.numel():
                _read_exact(self._file, memoryview(tensor.view(-1).view(torch.uint8).numpy()), digest)
            tensors[entry.name] = tensor
        if integrity is not None and not stored:
            raise CacheFormatError("the file digest is missing")
        if digest is not None:
            digest.verify(stored, key)
        return tensors


class LoadedTensors:
    """The `TensorSource` a cache is built from: tensors handed out once each after checking dtype
    and shape, moved to the target device, and an allocation budget layers charge before allocating."""

    def __init__(self, tensors: dict[str, torch.Tensor], specs: dict[str, tuple[str, list[int]]],
                 device: str, budget: int) -> None:  # fmt: skip
        self._tensors, self.specs, self._device, self._budget = tensors, specs, device, budget

    def take(self, name: str, dtype: str, shape: list[int], where: str) -> torch.Tensor:
        if name not in self.specs:
            raise CacheFormatError(f"{where}: tensor {name!r} is missing from the file")
        if name not in self._tensors:
            raise CacheFormatError(f"{where}: tensor {name!r} is used twice")
        if self.specs[name] != (dtype, shape):
            file_dtype, file_shape = self.specs[name]
            raise CacheFormatError(
                f"{where}: tensor {name!r} is {file_dtype}{file_shape} in the file but the description "
                f"says {dtype}{shape}"[:400]
            )
        return self._tensors.pop(name).to(self._device)  # popped: the layer's copy is then the only one

    def charge(self, nbytes: int, where: str) -> None:
        """Count `nbytes` a layer is about to allocate; `CacheFormatError` past the budget."""
        self._budget -= nbytes
        if self._budget < 0:
            raise CacheFormatError(
                f"{where}: the file asks for {nbytes} bytes of storage, past what a file of its size may "
                "allocate; pass load_cache(..., max_alloc_bytes=N) to allow it"
            )

    def check_all_taken(self) -> None:
        unused = sorted(self._tensors)
        if unused:
            raise CacheFormatError(f"the file holds tensors no layer describes: {unused[:5]}")


def default_budget(file_size: int) -> int:
    return ALLOC_PER_FILE_BYTE * file_size + ALLOC_SLACK
