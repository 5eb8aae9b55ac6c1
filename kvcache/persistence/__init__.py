"""Saving and loading caches as one `.safetensors` file (SPEC section 7).

`save_cache` writes the tensors of every layer plus string metadata: the format name and version,
a JSON description of the cache (composite class, per layer its class, `meta_state` and tensor
dtypes/shapes) and the user's metadata. `load_cache` builds only allow-listed composite classes and
registered layer classes, checks every tensor against the description, and raises
`CacheFormatError` for anything that does not fit. Nothing is unpickled or imported by name.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from ..errors import CacheFormatError, CacheInputError
from .composite import build_cache, composite_kinds, describe_cache
from .header import FORMAT_VERSION, encode_user_metadata, make_header, parse_header
from .writer import atomic_write, write_safetensors

__all__ = ["FORMAT_VERSION", "CacheFile", "composite_kinds", "inspect_cache_file", "load_cache", "save_cache"]


def _as_path(path: Any) -> Path:
    if not isinstance(path, (str, os.PathLike)):
        raise CacheInputError(f"path must be a str or os.PathLike, got {type(path).__name__}")
    return Path(path)


def save_cache(
    cache: Any, path: str | os.PathLike[str], *, metadata: dict[str, Any] | None = None, fsync: bool = True
) -> None:
    """Save `cache` (any allow-listed composite, any registered layers) to `path` atomically.

    `metadata`: a dict of str -> JSON values (model name, prompt tokens ...) stored with the cache.
    Everything is validated before the disk is touched; the file is written to a temporary file in
    the same directory, flushed to disk and renamed, so a failed save leaves an earlier file at
    `path` byte-identical and no temporary file behind. `fsync=False` skips the flush to the
    device: still atomic for the processes reading the file, faster, but a power loss right after
    the save may lose it.
    """
    target = _as_path(path)
    user_json = encode_user_metadata(metadata)
    description, tensors = describe_cache(cache)
    header = make_header(description, user_json)
    if target.is_dir():
        raise CacheInputError(f"{target} is a directory")
    atomic_write(target, lambda file: write_safetensors(file, tensors, header), fsync=fsync)


class _FileTensors:
    """Tensors of an open safetensors file, handed out once each after checking dtype and shape."""

    def __init__(self, handle: Any) -> None:
        self._handle = handle
        self.specs: dict[str, tuple[str, list[int]]] = {}
        for name in handle.keys():  # noqa: SIM118 (safe_open is not iterable)
            view = handle.get_slice(name)
            self.specs[name] = (view.get_dtype(), list(view.get_shape()))
        self._taken: set[str] = set()

    def take(self, name: str, dtype: str, shape: list[int], where: str) -> torch.Tensor:
        if name not in self.specs:
            raise CacheFormatError(f"{where}: tensor {name!r} is missing from the file")
        if name in self._taken:
            raise CacheFormatError(f"{where}: tensor {name!r} is used twice")
        file_dtype, file_shape = self.specs[name]
        if (file_dtype, file_shape) != (dtype, shape):
            raise CacheFormatError(
                f"{where}: tensor {name!r} is {file_dtype}{file_shape} in the file but the description "
                f"says {dtype}{shape}"[:400]
            )
        self._taken.add(name)
        try:
            return self._handle.get_tensor(name)
        except Exception as err:  # safetensors' own errors (damaged data region)
            raise CacheFormatError(f"{where}: cannot read tensor {name!r}: {err}") from err

    def check_all_taken(self) -> None:
        unused = sorted(set(self.specs) - self._taken)
        if unused:
            raise CacheFormatError(f"the file holds tensors no layer describes: {unused[:5]}")


def _check_device(device: Any) -> str:
    if device is None:
        return "cpu"
    try:
        device = torch.device(device)
        torch.empty(0, device=device)
    except (RuntimeError, TypeError, AssertionError) as err:
        raise CacheInputError(f"cannot load onto device {device!r}: {err}") from None
    return str(device)


class CacheFile:
    """A loaded kvcache file: the cache, the user metadata, the description and tensor specs."""

    def __init__(self, cache: Any, metadata: dict[str, Any], description: dict[str, Any], specs: dict[str, Any]):
        self.cache = cache
        self.metadata = metadata
        self.description = description
        #: tensor name -> (safetensors dtype, shape), in file order
        self.specs = specs


def _read(path: Any, device: Any) -> CacheFile:
    target = _as_path(path)
    where = _check_device(device)
    with open(target, "rb"):  # a missing or unreadable file is an OSError, not a format error
        pass
    try:
        return _read_checked(target, where)
    except CacheFormatError as err:
        raise CacheFormatError(f"{target}: {err}") from err.__cause__


def _read_checked(target: Path, device: str) -> CacheFile:
    try:
        handle = safe_open(target, framework="pt", device=device)
    except Exception as err:  # SafetensorError and friends: truncated, damaged header ...
        raise CacheFormatError(f"not a valid safetensors file: {err}") from None
    with handle as opened:
        try:
            raw_metadata = opened.metadata()
            tensors = _FileTensors(opened)
        except Exception as err:
            raise CacheFormatError(f"not a valid safetensors file: {err}") from None
        description, user = parse_header(raw_metadata)
        cache = build_cache(description, tensors)
        tensors.check_all_taken()
    return CacheFile(cache, user, description, tensors.specs)


def load_cache(
    path: str | os.PathLike[str], *, device: str | torch.device | None = None, return_metadata: bool = False
) -> Any:
    """Load a cache saved by `save_cache`, its tensors on `device` (default CPU).

    Tensors come from safetensors' zero-copy (memory-mapped, copy-on-write) path and become the
    layers' storage directly, so the data is not held twice (a `StaticLayer` copies its tokens
    into its preallocated buffer, layer by layer, and drops the mapping). Writes to a loaded cache
    never reach the file. Returns the cache, or `(cache, metadata)` with
    `return_metadata=True`. Raises `CacheFormatError` for a file that is not a valid kvcache file.
    """
    loaded = _read(path, device)
    return (loaded.cache, loaded.metadata) if return_metadata else loaded.cache


def inspect_cache_file(path: str | os.PathLike[str]) -> CacheFile:
    """Load and fully validate a kvcache file (on CPU), keeping its description for display."""
    return _read(path, None)
