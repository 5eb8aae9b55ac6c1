"""A prefix-store entry as bytes (a directory's files, Redis values).

The layout is the one kvcache's cache files use (safetensors: header length, JSON header, tensor
bytes) with the same whole-entry digest as the last tensor: xxh3-128 over every byte before it,
plus an HMAC-SHA256 when the store has a key. The header names the entry's own key, so bytes
copied under another key are refused, and only a key holder can make an entry a keyed store
accepts. `decode` raises `CacheFormatError` for anything that is not a whole, verified entry of
this key; whether it fits the model is checked afterwards (`payloads.check_payload`).
"""

from __future__ import annotations

import io
import json
from typing import Any

import torch

from ..errors import CacheFormatError
from ..persistence.integrity import DIGEST_TENSOR, KEYED, PLAIN, FileDigest
from ..persistence.reader import FileReader
from ..persistence.writer import write_safetensors
from .backends import Entry
from .payloads import Delta, HybridPayload, Payload, QuantDelta, Snapshot, WindowDelta

FORMAT = "kvcache-store-entry"
VERSION = "1"


def _describe(payload: Payload, prefix: str, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    if isinstance(payload, WindowDelta):
        tensors[f"{prefix}keys"], tensors[f"{prefix}values"] = payload.keys, payload.values
        return {"kind": "window", "window": payload.window}
    if isinstance(payload, Delta):
        tensors[f"{prefix}keys"], tensors[f"{prefix}values"] = payload.keys, payload.values
        return {"kind": "delta"}
    if isinstance(payload, QuantDelta):
        for name, tensor in payload.tensors.items():
            tensors[f"{prefix}{name}"] = tensor
        return {"kind": "quant", "bits": payload.bits, "group_size": payload.group_size, "residual": payload.residual,
                "window": payload.window, "tokens": payload.tokens, "key_groups": payload.key_groups,
                "value_groups": payload.value_groups}  # fmt: skip
    if isinstance(payload, HybridPayload):
        return {
            "kind": "hybrid",
            "attention": _describe(payload.attention, prefix + "a.", tensors),
            "recurrent": _describe(payload.recurrent, prefix + "r.", tensors),
        }
    for name, t in payload.state.items():
        tensors[f"{prefix}s.{name}"] = t
    return {"kind": "snapshot", "cls": payload.cls, "meta": payload.meta, "names": sorted(payload.state)}


def _restore(desc: Any, prefix: str, tensors: dict[str, torch.Tensor], used: set[str]) -> Payload:
    def take(name: str) -> torch.Tensor:
        used.add(name)
        return tensors[name]

    kind = desc["kind"]
    if kind == "quant":
        numbers = [desc[n] for n in ("bits", "group_size", "residual", "window", "tokens")]
        groups = [desc["key_groups"], desc.get("value_groups", "token")]  # stored before: values per token
        if any(isinstance(n, bool) or not isinstance(n, int) for n in numbers) or any(
                g not in ("channel", "token") for g in groups):  # fmt: skip
            raise TypeError(f"quantization parameters {numbers!r}, keys and values per {groups!r}")
        names = ("data_k", "data_v", "params_k", "params_v", "residual_k", "residual_v")
        return QuantDelta(*(take(f"{prefix}{n}") for n in names), *numbers, *groups)
    if kind in ("window", "delta"):
        keys, values = take(f"{prefix}keys"), take(f"{prefix}values")
        if kind == "delta":
            return Delta(keys, values)
        window = desc["window"]
        if isinstance(window, bool) or not isinstance(window, int):
            raise TypeError(f"window {window!r}")
        return WindowDelta(keys, values, window)
    if kind == "hybrid":
        attention = _restore(desc["attention"], prefix + "a.", tensors, used)
        recurrent = _restore(desc["recurrent"], prefix + "r.", tensors, used)
        if not isinstance(recurrent, Snapshot) or isinstance(attention, HybridPayload):
            raise TypeError("a hybrid payload holds an attention part and a recurrent snapshot")
        return HybridPayload(attention, recurrent)
    if kind != "snapshot" or not isinstance(desc["cls"], str) or not isinstance(desc["meta"], dict):
        raise TypeError(f"payload kind {kind!r}")
    return Snapshot(desc["cls"], desc["meta"], {n: take(f"{prefix}s.{n}") for n in desc["names"]})


def encode(key: bytes, entry: Entry, mac_key: bytes | None) -> bytes:
    """The bytes of `entry` stored under `key` (with a MAC when `mac_key` is given)."""
    tensors: dict[str, torch.Tensor] = {}
    layers = [_describe(p, f"L{i}.", tensors) for i, p in enumerate(entry.payloads)]
    about = {"key": key.hex(), "parent": None if entry.parent is None else entry.parent.hex(), "layers": layers}
    digest = FileDigest(mac_key)
    header = {"format": FORMAT, "version": VERSION, "integrity": digest.scheme,
              "entry": json.dumps(about, separators=(",", ":"), allow_nan=False)}  # fmt: skip
    out = io.BytesIO()
    write_safetensors(out, {k: v.detach().cpu().contiguous() for k, v in tensors.items()}, header, digest)
    return out.getvalue()


def decode(key: bytes, data: bytes, mac_key: bytes | None) -> Entry:
    """The entry `data` holds, after checking that it is whole, verified (digest, and the MAC when
    `mac_key` is given: an unkeyed or wrongly keyed entry is refused) and made for `key`."""
    reader = FileReader(io.BytesIO(data), len(data))
    meta = reader.metadata
    if meta.get("format") != FORMAT or meta.get("version") != VERSION:
        raise CacheFormatError(f"not a store entry of this kvcache (format {meta.get('format')!r})")
    integrity = meta.get("integrity")
    if integrity not in (PLAIN, KEYED):
        raise CacheFormatError(f"unknown integrity scheme {integrity!r}")
    if mac_key is not None and integrity != KEYED:
        raise CacheFormatError("the store has a key but the entry carries no MAC")
    tensors = reader.read_all(integrity, mac_key, True)
    try:
        about = json.loads(meta["entry"])
        if about["key"] != key.hex():
            raise CacheFormatError("the entry was made for another key")
        parent = None if about["parent"] is None else bytes.fromhex(about["parent"])
        used: set[str] = set()
        payloads = [_restore(d, f"L{i}.", tensors, used) for i, d in enumerate(about["layers"])]
    except CacheFormatError:
        raise
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise CacheFormatError(f"not a valid store entry ({type(exc).__name__}: {exc})") from None
    if used != set(tensors) - {DIGEST_TENSOR}:
        raise CacheFormatError("the entry holds tensors its description does not name")
    return Entry(parent, payloads, sum(p.nbytes for p in payloads))
