"""The kvcache part of a safetensors header: format name, version, cache description, user metadata.

safetensors metadata maps strings to strings, so the description and the user metadata are JSON
text. A SHA-256 of those strings is stored next to them, so even a load that skips the whole-file
digest (`verify=False`) refuses an edited or damaged header. Like the xxh3 file digest it guards
against accidents only: anyone can recompute it (see `integrity` for the keyed MAC).

Versions: 1 (kvcache 0.1) had no file digest; 2 adds `integrity` (the digest scheme) and the digest
tensor; 3 stores a tensor in its memory layout, its dims in the order its description's `order`
names. Version-1 files load only with `verify=False`, since nothing covers their data.
"""

from __future__ import annotations

import hashlib
import json
import math
from typing import Any

from ..errors import CacheFormatError, CacheInputError

FORMAT_NAME = "kvcache"
#: Files are written in this version; files of a newer version are refused.
FORMAT_VERSION = 3
#: The metadata keys kvcache writes (version 1 had all but "integrity").
KEYS = ("format", "format_version", "cache", "user", "integrity", "sha256")


#: How deeply metadata may nest (JSON readers, ours included, recurse per level).
MAX_JSON_DEPTH = 64


def check_json_value(value: Any, where: str, depth: int = 0) -> None:
    """Raise `CacheInputError` unless `value` is plain JSON: None, bool, int, finite float, str,
    list, or dict with str keys, nested at most `MAX_JSON_DEPTH` deep (tuples and tensors are
    refused so a round trip gives equal values)."""
    if depth > MAX_JSON_DEPTH:
        raise CacheInputError(f"{where}: nested deeper than {MAX_JSON_DEPTH} levels")
    if value is None or isinstance(value, (bool, int, str)):
        return
    if isinstance(value, float):
        if not math.isfinite(value):
            raise CacheInputError(f"{where}: {value} is not a finite number (JSON cannot hold it)")
        return
    if isinstance(value, list):
        for i, item in enumerate(value):
            check_json_value(item, f"{where}[{i}]", depth + 1)
        return
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise CacheInputError(f"{where}: key {key!r} is not a str")
            check_json_value(item, f"{where}[{key!r}]", depth + 1)
        return
    hint = " (use .tolist())" if hasattr(value, "tolist") else " (use a list)" if isinstance(value, tuple) else ""
    raise CacheInputError(f"{where}: {type(value).__name__} is not a JSON value{hint}")


def encode_user_metadata(metadata: Any) -> str:
    """User metadata (a dict of str -> JSON values, or None) as JSON text."""
    if metadata is None:
        metadata = {}
    if not isinstance(metadata, dict):
        raise CacheInputError(f"metadata must be a dict of str -> JSON values, got {type(metadata).__name__}")
    check_json_value(metadata, "metadata")
    return json.dumps(metadata, separators=(",", ":"), allow_nan=False)


def _digest(version: str, description_json: str, user_json: str, integrity: str | None) -> str:
    parts = (FORMAT_NAME, version, description_json, user_json) + (() if integrity is None else (integrity,))
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def make_header(description: dict[str, Any], user_json: str, integrity: str) -> dict[str, str]:
    """The safetensors string metadata for a cache `description`, encoded user metadata and the
    file digest scheme."""
    description_json = json.dumps(description, separators=(",", ":"), allow_nan=False)
    return {
        "format": FORMAT_NAME,
        "format_version": str(FORMAT_VERSION),
        "cache": description_json,
        "user": user_json,
        "integrity": integrity,
        "sha256": _digest(str(FORMAT_VERSION), description_json, user_json, integrity),
    }


def _reject_constant(name: str) -> None:
    raise ValueError(f"{name} is not allowed")


def _parse_json(text: str, what: str) -> Any:
    try:
        return json.loads(text, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as err:
        raise CacheFormatError(f"{what} is not valid JSON: {err}") from None


class Header:
    """A checked kvcache header: format version, file digest scheme (None in version 1),
    cache description and user metadata."""

    def __init__(self, version: int, integrity: str | None, description: dict[str, Any], user: dict[str, Any]):
        self.version, self.integrity, self.description, self.user = version, integrity, description, user


def parse_header(metadata: dict[str, str] | None, known_integrity: tuple[str, ...]) -> Header:
    """Check the kvcache metadata of a safetensors file (format, version, SHA-256 of its strings)."""
    if not isinstance(metadata, dict) or metadata.get("format") != FORMAT_NAME:
        found = metadata.get("format") if isinstance(metadata, dict) else None
        raise CacheFormatError(f"not a kvcache file: no format '{FORMAT_NAME}' in its metadata (found {found!r})")
    missing = [key for key in KEYS if key not in metadata and key != "integrity"]
    if missing:
        raise CacheFormatError(f"kvcache metadata incomplete: missing {missing}")
    version_text = metadata.get("format_version")
    if not isinstance(version_text, str) or not version_text.isdigit() or not version_text.isascii():
        raise CacheFormatError(f"format_version {version_text!r} is not a version number")
    version = int(version_text)
    if version > FORMAT_VERSION:
        raise CacheFormatError(
            f"file has format version {version}, newer than this kvcache reads ({FORMAT_VERSION}): "
            "upgrade kvcache to load it"
        )
    if version < 1:
        raise CacheFormatError(f"format_version {version_text!r} does not exist")
    keys = KEYS if version >= 2 else tuple(k for k in KEYS if k != "integrity")
    missing = [key for key in keys if key not in metadata]
    if missing:
        raise CacheFormatError(f"kvcache metadata incomplete: missing {missing}")
    integrity = metadata.get("integrity") if version >= 2 else None
    if version >= 2 and integrity not in known_integrity:
        raise CacheFormatError(f"unknown integrity scheme {integrity!r} (known: {list(known_integrity)})")
    if metadata["sha256"] != _digest(version_text, metadata["cache"], metadata["user"], integrity):
        raise CacheFormatError("kvcache metadata corrupted: its SHA-256 does not match (edited or damaged header)")
    description = _parse_json(metadata["cache"], "cache description")
    user = _parse_json(metadata["user"], "user metadata")
    if not isinstance(description, dict):
        raise CacheFormatError(f"cache description must be a JSON object, got {type(description).__name__}")
    if not isinstance(user, dict):
        raise CacheFormatError(f"user metadata must be a JSON object, got {type(user).__name__}")
    return Header(version, integrity, description, user)
