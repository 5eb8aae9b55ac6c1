"""Which model a store entry belongs to: the fingerprint every chunk key chains from.

It covers the namespace, the model's class and config (less the path it was loaded from), the
chunk size, each cache layer's kind and parameters, and a digest of the weights themselves (every
parameter and buffer: names, dtypes, shapes and bytes), so the same model object with new weights
never hits the old entries.
The weights are hashed once per model object (xxh3, about 10 GB/s of weights on one core, plus a
copy to the host for weights on an accelerator) and again only when a parameter changes: each
call compares every parameter's identity, address and version counter, which `load_state_dict`,
in-place updates and reassignment all change (writes through `.data` bypass version counters; call
`forget(model)` after those). With a store key the fingerprint is an HMAC under that key, so
without the key one cannot even compute the names of a keyed store's entries.
"""

from __future__ import annotations

import hashlib
import hmac
import threading
import weakref
from typing import Any

import torch
import xxhash

from .payloads import kind_of, model_module


def _signature(module: torch.nn.Module) -> tuple:
    tensors = [*module.named_parameters(), *module.named_buffers()]
    return tuple((name, id(t), t.data_ptr(), t._version, t.dtype, tuple(t.shape)) for name, t in tensors)


class WeightDigests:
    """xxh3-128 digests of models' weights, cached per module object until a parameter changes."""

    def __init__(self) -> None:
        self._cache: weakref.WeakKeyDictionary[torch.nn.Module, tuple[tuple, bytes]] = weakref.WeakKeyDictionary()
        self._lock = threading.Lock()

    def digest(self, module: torch.nn.Module | None) -> bytes:
        if module is None:
            return b""
        signature = _signature(module)
        with self._lock:
            cached = self._cache.get(module)
        if cached is not None and cached[0] == signature:
            return cached[1]
        h = xxhash.xxh3_128()
        with torch.no_grad():
            for name, tensor in (*module.named_parameters(), *module.named_buffers()):
                h.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}\x00".encode())
                data = tensor.detach().cpu().contiguous().reshape(-1)
                if data.numel():
                    h.update(memoryview(data.view(torch.uint8).numpy()))
        digest = h.digest()
        with self._lock:
            self._cache[module] = (signature, digest)
        return digest

    def forget(self, module: torch.nn.Module) -> None:
        with self._lock:
            self._cache.pop(module, None)


#: One cache for the process: several stores serving one model hash its weights once.
WEIGHTS = WeightDigests()


def fingerprint(model: Any, cache: Any, *, namespace: str, chunk_size: int, key: bytes | None) -> bytes:
    """The root every chunk key of `model` chains from (see the module docstring)."""
    config = getattr(model, "config", None)
    config = _without_origin(config.to_dict()) if hasattr(config, "to_dict") else config
    module = model_module(model)
    param = next(iter(module.parameters()), None) if module is not None else None
    parts = [namespace, type(model).__name__, repr(config), str(getattr(param, "dtype", None)), str(chunk_size),
             WEIGHTS.digest(module).hex(), *(kind_of(layer) for layer in cache)]  # fmt: skip
    plain = "\x1f".join(parts).encode()
    if key is None:
        return xxhash.xxh3_128_digest(plain)
    return hmac.new(key, plain, hashlib.sha256).digest()[:16]


#: Config fields that say where a model was loaded from, not what it computes.
ORIGIN_FIELDS = frozenset({"_name_or_path", "name_or_path", "_commit_hash"})


def _without_origin(config: Any) -> Any:
    """A config dict without the fields naming its directory (nested configs too): the same weights
    loaded from another path, on another machine, share their entries."""
    if isinstance(config, dict):
        return {k: _without_origin(v) for k, v in config.items() if k not in ORIGIN_FIELDS}
    return config


def forget(model: Any) -> None:
    """Hash `model`'s weights again at its next use (after writes the version counters miss)."""
    module = model_module(model)
    if module is not None:
        WEIGHTS.forget(module)
