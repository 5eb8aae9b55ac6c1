"""Saving and loading caches as one `.safetensors` file (format: docs/persistence.md).

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

from ..errors import CacheFormatError, CacheInputError
from .composite import build_cache, composite_kinds, describe_cache
from .header import FORMAT_VERSION, encode_user_metadata, make_header, parse_header
from .integrity import DIGEST_BYTES, KEYED, FileDigest, check_key
from .reader import FileReader, LoadedTensors, default_budget
from .writer import atomic_write, write_safetensors

__all__ = ["FORMAT_VERSION", "CacheFile", "composite_kinds", "inspect_cache_file", "load_cache", "save_cache"]


def _as_path(path: Any) -> Path:
    if not isinstance(path, (str, os.PathLike)):
        raise CacheInputError(f"path must be a str or os.PathLike, got {type(path).__name__}")
    return Path(path)


def save_cache(
    cache: Any,
    path: str | os.PathLike[str],
    *,
    metadata: dict[str, Any] | None = None,
    fsync: bool = True,
    key: bytes | None = None,
) -> None:
    """Save `cache` (any allow-listed composite, any registered layers) to `path` atomically.

    `metadata`: a dict of str -> JSON values (model name, prompt tokens ...) stored with the cache.
    Everything is validated before the disk is touched; the file is written to a temporary file in
    the same directory, flushed to disk and renamed, so a failed save leaves an earlier file at
    `path` byte-identical and no temporary file behind (temporary files of killed saves are
    removed by a later save to the same directory). Every byte of the file is covered by an xxh3
    digest that `load_cache` checks; with `key` (bytes, at least 16) an HMAC-SHA256 too, which
    `load_cache(..., key=key)` checks for tamper evidence. `fsync=False` skips the flush to the
    device: still atomic for the processes reading the file, faster, but a power loss right after
    the save may lose it.
    """
    target = _as_path(path)
    mac_key = check_key(key)
    user_json = encode_user_metadata(metadata)
    description, tensors = describe_cache(cache)
    digest = FileDigest(mac_key)
    header = make_header(description, user_json, digest.scheme)
    if target.is_dir():
        raise CacheInputError(f"{target} is a directory")
    atomic_write(target, lambda file: write_safetensors(file, tensors, header, digest), fsync=fsync)


def _check_device(device: Any) -> str:
    if device is None:
        return "cpu"
    try:
        device = torch.device(device)
        torch.empty(0, device=device)
    except (RuntimeError, TypeError, AssertionError, ValueError) as err:
        raise CacheInputError(f"cannot load onto device {device!r}: {err}") from None
    return str(device)


class CacheFile:
    """A loaded kvcache file: the cache, the user metadata, the description, tensor specs and the
    header's format version and digest scheme."""

    def __init__(self, cache: Any, metadata: dict[str, Any], description: dict[str, Any], specs: dict[str, Any],
                 version: int = FORMAT_VERSION, integrity: str | None = None):  # fmt: skip
        self.cache = cache
        self.metadata = metadata
        self.description = description
        #: tensor name -> (safetensors dtype, shape as the layer holds it), in file order
        self.specs = specs
        self.version = version
        self.integrity = integrity


def _read(path: Any, device: Any, *, verify: bool = True, key: Any = None, max_alloc_bytes: Any = None) -> CacheFile:
    target = _as_path(path)
    where = _check_device(device)
    mac_key = check_key(key)
    if max_alloc_bytes is not None and (isinstance(max_alloc_bytes, bool) or not isinstance(max_alloc_bytes, int)
                                        or max_alloc_bytes < 0):  # fmt: skip
        raise CacheInputError(f"max_alloc_bytes must be a non-negative int or None, got {max_alloc_bytes!r}")
    if not isinstance(verify, bool):
        raise CacheInputError(f"verify must be a bool, got {verify!r}")
    with open(target, "rb") as file:  # a missing or unreadable file is an OSError, not a format error
        try:
            return _read_checked(file, where, verify, mac_key, max_alloc_bytes)
        except CacheFormatError as err:
            raise CacheFormatError(f"{target}: {err}") from err.__cause__


def _read_checked(file: Any, device: str, verify: bool, key: bytes | None, max_alloc_bytes: int | None) -> CacheFile:
    reader = FileReader(file)
    header = parse_header(reader.metadata, tuple(DIGEST_BYTES))
    if key is not None and header.integrity != KEYED:
        raise CacheFormatError("a key was given but the file carries no MAC (saved without key=)")
    if verify and header.integrity is None:
        raise CacheFormatError(
            f"format version {header.version} has no file digest, so its data cannot be verified; "
            "load it with verify=False to accept it unverified (and save it again to add one)"
        )
    reader.start(header.integrity, key, verify or key is not None)  # a key asks for the MAC check
    budget = default_budget(reader.file_size) if max_alloc_bytes is None else max_alloc_bytes
    source = LoadedTensors(reader, device, budget)
    try:
        cache = build_cache(header.description, source)
    except CacheFormatError:
        source.raise_if_damaged()  # a damaged file says so, whatever broke first
        raise
    specs = source.finish()  # the digest (and MAC) checked: only now is the cache handed out
    return CacheFile(cache, header.user, header.description, specs, header.version, header.integrity)


def load_cache(
    path: str | os.PathLike[str],
    *,
    device: str | torch.device | None = None,
    return_metadata: bool = False,
    verify: bool = True,
    key: bytes | None = None,
    max_alloc_bytes: int | None = None,
) -> Any:
    """Load a cache saved by `save_cache`, its tensors on `device` (default CPU).

    The file is read once, front to back, into memory the cache owns (no memory map: a loaded cache
    never changes when its file does), and by default every byte is checked against the file's
    xxh3 digest before the cache is built. `verify=False` skips that check (the header's own
    SHA-256 is still checked): faster, for files you trust. `key`: also check the file's
    HMAC-SHA256 (tamper evidence; the file must have been saved with the same key). A key always
    means the whole file is checked: `verify=False` does not skip the MAC.
    `max_alloc_bytes` bounds what the file's layers may allocate beyond its data (a `StaticLayer`
    preallocates `max_cache_len`); the default allows 8x the file size plus 64 MiB. Returns the
    cache, or `(cache, metadata)` with `return_metadata=True`. Raises `CacheFormatError` for a
    file that is not a valid kvcache file, naming the file.
    """
    loaded = _read(path, device, verify=verify, key=key, max_alloc_bytes=max_alloc_bytes)
    return (loaded.cache, loaded.metadata) if return_metadata else loaded.cache


def inspect_cache_file(path: str | os.PathLike[str], *, verify: bool = True) -> CacheFile:
    """Load and fully validate a kvcache file (on CPU), keeping its description for display."""
    return _read(path, None, verify=verify)
