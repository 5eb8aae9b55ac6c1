"""Reuse of computed prefixes across requests: chunks of token ids, keyed by a chained hash.

A prompt is split into chunks of `chunk_size` tokens. Chunk i's key hashes the key of chunk i - 1,
the chunk's token ids and a fingerprint of the model and its cache layout, so a key names one
exact prefix of one model (as LMCache, SGLang and vLLM key theirs) and two models never exchange
entries. An entry holds, for every layer, what the cache needs at the chunk's end boundary
(`payloads`): full-attention layers a slice of keys/values, every other kind its state *at* the
boundary. Entries are taken during a chunked prefill (`prefill`), so a recurrent state is never
guessed: a lookup only ever lands on a boundary where every layer's state was taken, and the cache
it rebuilds continues bitwise as the one that prefilled those chunks did.

Memory is a hard bound: the store counts the bytes of the tensors it holds and evicts least
recently used entries, leaves first (a longer prefix is evicted before the chunk it extends), so it
never holds more than `max_bytes`.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import xxhash

from ..cache import Cache
from ..errors import CacheInputError, GenerationError
from .backends import Backend, Entry, MemoryBackend
from .payloads import Payload, capture, kind_of, rebuild, storable


@dataclass
class StoreStats:
    """What a store did: lookups, hits (a lookup that reused at least one chunk), tokens reused,
    chunks inserted and evicted, bytes held now, and inserts refused for the budget."""

    lookups: int = 0
    hits: int = 0
    tokens_reused: int = 0
    chunks_inserted: int = 0
    evictions: int = 0
    bytes_held: int = 0
    refused: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def hit_rate(self) -> float:
        return self.hits / self.lookups if self.lookups else 0.0


class PrefixStore:
    """A store of prefix caches for one or more models (see the module docstring).

    `chunk_size`: tokens per chunk (prefixes are reused in whole chunks). `max_bytes`: the budget,
    counted as the backend stores entries (tensor bytes in memory, file bytes in a directory).
    `namespace`: mixed into every key, to keep apart models whose configs coincide (two fine-tunes
    of one architecture). `backend`: `MemoryBackend()` (the default) or `DirectoryBackend(path)`.
    """

    def __init__(
        self, *, chunk_size: int = 64, max_bytes: int = 1 << 30, namespace: str = "", backend: Backend | None = None
    ) -> None:
        check_store_params(chunk_size, max_bytes, namespace)
        self.chunk_size, self.max_bytes, self.namespace = chunk_size, max_bytes, namespace
        self.backend: Backend = MemoryBackend() if backend is None else backend
        self.stats = StoreStats()

    def __len__(self) -> int:
        return sum(1 for _ in self.backend.infos())

    @property
    def location(self) -> str:
        """Where the entries are, fit to print (a URL's password redacted)."""
        return getattr(self.backend, "location", type(self.backend).__name__)

    @property
    def nbytes(self) -> int:
        """Bytes the store holds (never above `max_bytes`)."""
        return self.backend.nbytes()

    # ------------------------------------------------------------------------------- keys
    def fingerprint(self, model: Any, cache: Cache) -> bytes:
        """The model and layout part of every key: the namespace, the model's class and config (its
        shapes), its parameter dtype, and each cache layer's kind and parameters."""
        config = getattr(model, "config", None)
        config = config.to_dict() if hasattr(config, "to_dict") else config
        param = next(iter(_module(model).parameters()), None) if _module(model) is not None else None
        parts = [self.namespace, type(model).__name__, repr(config), str(getattr(param, "dtype", None)),
                 *(kind_of(layer) for layer in cache)]  # fmt: skip
        return xxhash.xxh3_128_digest("\x1f".join(parts).encode())

    def _keys(self, tokens: Sequence[int], fingerprint: bytes) -> list[bytes]:
        """The chained key of each whole chunk of `tokens`."""
        keys, parent = [], fingerprint
        for start in range(0, len(tokens) - self.chunk_size + 1, self.chunk_size):
            chunk = torch.tensor(tokens[start : start + self.chunk_size], dtype=torch.int64).numpy().tobytes()
            parent = xxhash.xxh3_128_digest(parent + chunk)
            keys.append(parent)
        return keys

    # ----------------------------------------------------------------------------- lookup
    def lookup(self, tokens: Sequence[int], model: Any, *, max_tokens: int | None = None) -> tuple[int, Cache]:
        """`(matched, cache)`: the longest stored prefix of `tokens` (at most `max_tokens` tokens) and a
        fresh cache holding it, as one that had prefilled `tokens[:matched]` chunk by chunk holds it
        (`matched` is 0 and the cache empty on a miss). The cache shares nothing with the store."""
        tokens = _check_tokens(tokens, model)
        bad_max = isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 0
        if max_tokens is not None and bad_max:
            raise CacheInputError(f"prefix store: max_tokens must be a non-negative int, got {max_tokens!r}")
        cache = _new_cache(model)
        keys = self._keys(tokens[: len(tokens) if max_tokens is None else max_tokens], self.fingerprint(model, cache))
        path = []
        for key in keys:
            entry = self.backend.get(key)
            if entry is None or len(entry.payloads) != len(cache.layers):
                break
            path.append(entry)
        self.stats.lookups += 1
        matched = len(path) * self.chunk_size
        self.backend.count(1, int(bool(path)), matched)
        if not path:
            return 0, cache
        layers = [rebuild([entry.payloads[i] for entry in path]) for i in range(len(cache.layers))]
        self.stats.hits += 1
        self.stats.tokens_reused += matched
        return matched, Cache(layers)

    # ---------------------------------------------------------------------------- prefill
    def prefill(
        self, model: Any, tokens: Sequence[int], *, keep_last: int = 1, progress: Any = None
    ) -> tuple[int, Cache]:
        """Look `tokens` up, then feed the model the whole chunks after the match that leave at
        least `keep_last` tokens unfed (a generation driver feeds those itself, to get their
        logits), inserting each chunk's boundary. Returns `(reused, cache)`: tokens taken from the
        store, and a cache holding the first `len(cache tokens)` tokens (a multiple of the chunk).
        `progress` (a `kvcache.progress.Progress`) is told of every token done, reused ones first."""
        tokens = _check_tokens(tokens, model)
        if isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1:
            raise CacheInputError(f"prefix store: keep_last must be a positive int, got {keep_last!r}")
        if any(not storable(layer) for layer in _new_cache(model)):
            raise CacheInputError("prefix store: the model's cache has static layers, which a store cannot keep")
        limit = max((len(tokens) - keep_last) // self.chunk_size * self.chunk_size, 0)
        reused, cache = self.lookup(tokens, model, max_tokens=limit)
        fingerprint = self.fingerprint(model, cache)
        keys = self._keys(tokens[:limit], fingerprint)
        device = _device(model)
        if progress is not None:
            progress.update(reused)
        for start in range(reused, limit, self.chunk_size):
            end = start + self.chunk_size
            ids = torch.tensor([tokens[start:end]], dtype=torch.long, device=device)
            with torch.no_grad():
                model(ids, cache=cache, position_ids=torch.arange(start, end, device=device)[None])
            parent = keys[start // self.chunk_size - 1] if start else None
            self._insert(keys[start // self.chunk_size], parent, [capture(layer, start, end) for layer in cache])
            if progress is not None:
                progress.update(self.chunk_size)
        return reused, cache

    def _insert(self, key: bytes, parent: bytes | None, payloads: list[Payload]) -> bool:
        """Store one chunk, evicting least recently used leaves (never its own prefix) to fit."""
        backend = self.backend
        with backend.locked():
            if backend.exists(key):
                return True
            if parent is not None and not backend.exists(parent):
                return False  # its parent was evicted or refused: a chunk is only kept with its whole prefix
            entry = Entry(parent, payloads, sum(p.nbytes for p in payloads), time.time())
            size = backend.size(entry)
            protected = self._ancestors(parent)
            while backend.nbytes() + size > self.max_bytes:
                if not self._evict_one(protected):
                    self.stats.refused += 1
                    return False
            backend.put(key, entry)
        self.stats.chunks_inserted += 1
        self.stats.bytes_held = backend.nbytes()
        return True

    def _ancestors(self, key: bytes | None) -> set[bytes]:
        parents = {info.key: info.parent for info in self.backend.infos()}
        seen = set()
        while key is not None and key in parents and key not in seen:
            seen.add(key)
            key = parents[key]
        return seen

    def _evict_one(self, protected: set[bytes]) -> bool:
        """Drop the least recently used leaf not in `protected`; False when there is none."""
        infos = list(self.backend.infos())
        parents = {info.parent for info in infos}
        leaves = [(info.last_used, info.key) for info in infos if info.key not in parents and info.key not in protected]
        if not leaves:
            return False
        self.backend.delete(min(leaves)[1])
        self.stats.evictions += 1
        return True

    def clear(self) -> None:
        for info in list(self.backend.infos()):
            self.backend.delete(info.key)
        self.stats.bytes_held = 0


def check_store_params(chunk_size: Any, max_bytes: Any, namespace: Any) -> None:
    """A store's parameters, checked before anything (a directory, a connection) is made."""
    for name, value in (("chunk_size", chunk_size), ("max_bytes", max_bytes)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise CacheInputError(f"{name} must be a positive int, got {value!r} (PrefixStore)", param=name)
    if not isinstance(namespace, str):
        raise CacheInputError(f"namespace must be a str, got {namespace!r} (PrefixStore)", param="namespace")


def open_store(
    where: str, *, chunk_size: int = 64, max_bytes: int = 1 << 30, namespace: str = "", strict: bool = False,
    create: bool = True,
) -> PrefixStore:
    """A store at `where`: a Redis URL ("redis://host:port/db") or a directory path (created when
    missing, unless `create=False`). Any other URL scheme is a `CacheInputError`."""
    from .backends import DirectoryBackend
    from .location import kind_of_location
    from .redis_backend import RedisBackend

    check_store_params(chunk_size, max_bytes, namespace)
    if kind_of_location(where) == "redis":
        backend: Backend = RedisBackend(where, strict=strict)
    else:
        if not create and not os.path.isdir(where):
            what = "is a file, not a directory" if os.path.exists(where) else "does not exist"
            raise CacheInputError(f"no prefix store at {where!r}: it {what}")
        backend = DirectoryBackend(where, strict=strict)
    return PrefixStore(chunk_size=chunk_size, max_bytes=max_bytes, namespace=namespace, backend=backend)


def prefill_for_generation(store: Any, model: Any, input_ids: torch.Tensor, attention_mask: Any, cache: Any,
                           encoder_decoder: bool) -> Cache:  # fmt: skip
    """What `generate(..., prefix_store=store)` / `speculative_generate` start from: the prompt's
    longest stored prefix, the rest of its whole chunks prefilled and stored; the generation driver
    feeds the remaining tokens (at least one) itself."""
    if not isinstance(store, PrefixStore):
        raise GenerationError(f"prefix_store must be a PrefixStore, got {type(store).__name__}")
    if encoder_decoder or cache is not None:
        raise GenerationError("prefix_store= is for decoder-only models, without cache=")
    if input_ids.shape[0] != 1 or (attention_mask is not None and not bool((attention_mask == 1).all())):
        raise GenerationError("prefix_store= takes one unpadded prompt (batch size 1)")
    return store.prefill(model, input_ids[0].tolist())[1]


def _check_tokens(tokens: Any, model: Any) -> list[int]:
    if isinstance(tokens, torch.Tensor):
        if tokens.dim() != 1 or tokens.is_floating_point():
            raise CacheInputError(f"prefix store: tokens must be a 1-D integer sequence, got {tuple(tokens.shape)}")
        tokens = tokens.tolist()
    if not isinstance(tokens, (list, tuple)) or any(isinstance(t, bool) or not isinstance(t, int) for t in tokens):
        raise CacheInputError("prefix store: tokens must be a sequence of ints")
    vocab = getattr(model, "vocab_size", None)
    if isinstance(vocab, int) and any(not 0 <= t < vocab for t in tokens):
        raise CacheInputError(f"prefix store: token ids must be in [0, {vocab}) for this model")
    return list(tokens)


def _new_cache(model: Any) -> Cache:
    new_cache = getattr(model, "new_cache", None)
    if new_cache is None:
        raise GenerationError(f"prefix store: {type(model).__name__} has no new_cache(): it is not a kvcache model")
    cache = new_cache()
    if not isinstance(cache, Cache) or getattr(model, "is_encoder_decoder", False):
        raise GenerationError("prefix store: decoder-only models with a kvcache Cache only")
    if not cache.layers:
        raise GenerationError("prefix store: the model's new_cache() builds its layers lazily; it needs them upfront")
    return cache


def _module(model: Any) -> Any:
    """The torch module behind a model (a transformers model behind `wrap_model`), or None."""
    for candidate in (model, getattr(model, "model", None)):
        if isinstance(candidate, torch.nn.Module):
            return candidate
    return None


def _device(model: Any) -> torch.device:
    module = _module(model)
    param = None if module is None else next(iter(module.parameters()), None)
    return torch.device("cpu") if param is None else param.device
