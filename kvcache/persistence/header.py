"""The kvcache part of a safetensors header: format name, version, cache description, user metadata.

safetensors metadata maps strings to strings, so the description and the user metadata are JSON
text. A SHA-256 of those strings is stored next to them: a flipped byte anywhere in them is then
an error rather than a silently different cache or metadata.
"""

from __future__ import annotations

import hashlib
import json
import math
from typing import Any

from ..errors import CacheFormatError, CacheInputError

FORMAT_NAME = "kvcache"
#: Files are written in this version; files of a newer version are refused.
FORMAT_VERSION = 1
#: The metadata keys kvcache writes.
KEYS = ("format", "format_version", "cache", "user", "sha256")


def check_json_value(value: Any, where: str) -> None:
    """Raise `CacheInputError` unless `value` is plain JSON: None, bool, int, finite float, str,
    list, or dict with str keys (tuples and tensors are refused so a round trip gives equal values)."""
    if value is None or isinstance(value, (bool, int, str)):
        return
    if isinstance(value, float):
        if not math.isfinite(value):
            raise CacheInputError(f"{where}: {value} is not a finite number (JSON cannot hold it)")
        return
    if isinstance(value, list):
        for i, item in enumerate(value):
            check_json_value(item, f"{where}[{i}]")
        return
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise CacheInputError(f"{where}: key {key!r} is not a str")
            check_json_value(item, f"{where}[{key!r}]")
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


def _digest(version: str, description_json: str, user_json: str) -> str:
    text = "\n".join((FORMAT_NAME, version, description_json, user_json))
    return hashlib.sha256(text.encode()).hexdigest()


def make_header(description: dict[str, Any], user_json: str) -> dict[str, str]:
    """The safetensors string metadata for a cache `description` and encoded user metadata."""
    description_json = json.dumps(description, separators=(",", ":"), allow_nan=False)
    return {
        "format": FORMAT_NAME,
        "format_version": str(FORMAT_VERSION),
        "cache": description_json,
        "user": user_json,
        "sha256": _digest(str(FORMAT_VERSION), description_json, user_json),
    }


def _reject_constant(name: str) -> None:
    raise ValueError(f"{name} is not allowed")


def _parse_json(text: str, what: str) -> Any:
    try:
        return json.loads(text, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as err:
        raise CacheFormatError(f"{what} is not valid JSON: {err}") from None


def parse_header(metadata: dict[str, str] | None) -> tuple[dict[str, Any], dict[str, Any]]:
    """Check the kvcache metadata of a safetensors file; return (cache description, user metadata)."""
    if not metadata or metadata.get("format") != FORMAT_NAME:
        found = None if not metadata else metadata.get("format")
        raise CacheFormatError(f"not a kvcache file: no format '{FORMAT_NAME}' in its metadata (found {found!r})")
    missing = [key for key in KEYS if key not in metadata]
    if missing:
        raise CacheFormatError(f"kvcache metadata incomplete: missing {missing}")
    version_text = metadata["format_version"]
    if not version_text.isdigit() or not version_text.isascii():
        raise CacheFormatError(f"format_version {version_text!r} is not a version number")
    if int(version_text) > FORMAT_VERSION:
        raise CacheFormatError(
            f"file has format version {int(version_text)}, newer than this kvcache reads ({FORMAT_VERSION}): "
            "upgrade kvcache to load it"
        )
    if int(version_text) < 1:
        raise CacheFormatError(f"format_version {version_text!r} does not exist")
    if metadata["sha256"] != _digest(version_text, metadata["cache"], metadata["user"]):
        raise CacheFormatError("kvcache metadata corrupted: its SHA-256 does not match (edited or damaged header)")
    description = _parse_json(metadata["cache"], "cache description")
    user = _parse_json(metadata["user"], "user metadata")
    if not isinstance(description, dict):
        raise CacheFormatError(f"cache description must be a JSON object, got {type(description).__name__}")
    if not isinstance(user, dict):
        raise CacheFormatError(f"user metadata must be a JSON object, got {type(user).__name__}")
    return description, user
