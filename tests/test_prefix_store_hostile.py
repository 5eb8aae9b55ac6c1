"""Entries a store did not write: well formed, with a valid digest (anyone can compute one), but
not fitting the model (another dtype, other head counts, too few tokens, a window claiming more
tokens than it has seen, a StaticLayer asking for 10**12 tokens, layers swapped or missing). Each
is refused before any layer is built: a miss from that chunk on and one warning, the entry
dropped, the output exactly a cold run's, a `KVCacheError` with a strict backend. Identity: the
same model object with new weights never hits the old entries. Keys: a keyed store takes only
entries MAC'd under its key."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from servers import Server, need_redis_server
from store_kit import CHUNK, HOSTILE, hostile_bytes, model, prompt

from kvcache import KVCacheError
from kvcache.generation import generate
from kvcache.store import DirectoryBackend, PrefixStore, RedisBackend, codec

pytestmark = pytest.mark.usefixtures("one_thread")


class Files:
    """A directory store, and writing raw bytes under an entry's name as a stranger would."""

    def __init__(self, tmp_path: Path) -> None:
        self.path = tmp_path / "store"

    def backend(self, **kwargs):
        return DirectoryBackend(self.path, **kwargs)

    def _file(self, key: bytes) -> Path:
        return self.path / "entries" / key.hex()[:2] / f"{key.hex()}.kvstore"

    def read(self, key: bytes) -> bytes:
        return self._file(key).read_bytes()

    def plant(self, key: bytes, data: bytes) -> None:
        self._file(key).parent.mkdir(parents=True, exist_ok=True)
        self._file(key).write_bytes(data)

    def held(self, key: bytes) -> bool:
        return self._file(key).exists()

    def close(self) -> None:
        pass


class Redis:
    """A Redis store on a server of the test's own, and SET of raw bytes under an entry's name."""

    def __init__(self, tmp_path: Path) -> None:
        need_redis_server()
        import redis

        self.server = Server(tmp_path / "redis")
        self.server.start()
        self.client = redis.Redis.from_url(self.server.url)

    def backend(self, **kwargs):
        return RedisBackend(self.server.url, **kwargs)

    def read(self, key: bytes) -> bytes:
        return self.client.get(f"{{kvcache}}:e:{key.hex()}")

    def plant(self, key: bytes, data: bytes) -> None:
        self.client.set(f"{{kvcache}}:e:{key.hex()}", data)

    def held(self, key: bytes) -> bool:
        return bool(self.client.exists(f"{{kvcache}}:e:{key.hex()}"))

    def close(self) -> None:
        self.client.close()
        self.server.stop()


@pytest.fixture(params=["directory", "redis"])
def where(request, tmp_path: Path):
    place = Files(tmp_path) if request.param == "directory" else Redis(tmp_path)
    yield place
    place.close()


@pytest.mark.parametrize("how", HOSTILE)
def test_an_entry_that_does_not_fit_the_model_is_a_miss_before_anything_is_built(where, how: str) -> None:
    m, ids = model(), prompt()
    cold = generate(m, ids, max_new_tokens=8, output_scores=True, prefix_store=PrefixStore(chunk_size=CHUNK))
    store = PrefixStore(chunk_size=CHUNK, backend=where.backend())
    generate(m, ids, max_new_tokens=8, prefix_store=store)
    keys = store.chunk_keys(m, ids[0].tolist())
    where.plant(keys[2], hostile_bytes(keys[2], where.read(keys[2]), how))
    fresh = PrefixStore(chunk_size=CHUNK, backend=where.backend())
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        matched, cache = fresh.lookup(ids[0].tolist(), m)
    assert matched == 16 and len(seen) == 1 and "does not fit the model" in str(seen[0].message)
    assert all(layer.get_seq_length() == 16 for layer in cache)  # what it reports is what every layer holds
    assert not where.held(keys[2]) and fresh.stats.dropped == 1
    where.plant(keys[2], hostile_bytes(keys[2], codec.encode(keys[2], _entry(m, ids, 3), None), how))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = generate(m, ids, max_new_tokens=8, output_scores=True, prefix_store=fresh)
    assert out.sequences.tolist() == cold.sequences.tolist()
    assert all(torch.equal(a, b) for a, b in zip(out.scores, cold.scores, strict=True))
    where.plant(keys[2], hostile_bytes(keys[2], where.read(keys[2]), how))
    strict = PrefixStore(chunk_size=CHUNK, backend=where.backend(strict=True))
    with pytest.raises(KVCacheError, match="does not fit the model"):
        strict.lookup(ids[0].tolist(), m)


def _entry(m, ids, chunks: int):
    """The model's own entry for the boundary after `chunks` chunks of `ids`."""
    store = PrefixStore(chunk_size=CHUNK)
    store.prefill(m, ids[0, : chunks * CHUNK + 1].tolist())
    return store.backend.entries()[store.chunk_keys(m, ids[0].tolist())[chunks - 1]]


def test_new_weights_in_the_same_model_object_never_hit_old_entries(where) -> None:
    """`load_state_dict` into the model that filled the store: every lookup misses (the
    fingerprint covers the weights); the old weights back: hits again. Writes through `.data`
    bypass version counters: `forget(model)` makes the store hash the weights again."""
    from kvcache.store import forget

    m, ids = model(), prompt()
    store = PrefixStore(chunk_size=CHUNK, backend=where.backend())
    store.prefill(m, ids[0].tolist())
    original = {k: v.clone() for k, v in m.state_dict().items()}
    m.load_state_dict(model(seed=1).state_dict())
    assert store.lookup(ids[0].tolist(), m)[0] == 0
    cold = generate(m, ids, max_new_tokens=8, output_scores=True)
    assert generate(m, ids, max_new_tokens=8, prefix_store=store).sequences.tolist() == cold.sequences.tolist()
    m.load_state_dict(original)
    assert store.lookup(ids[0].tolist(), m)[0] == 32
    with torch.no_grad():
        m.embed.weight.data.mul_(2)
    forget(m)
    assert store.lookup(ids[0].tolist(), m)[0] == 0


def test_a_keyed_store_takes_only_entries_under_its_key(where) -> None:
    """With `key=`: its entries carry a MAC and live under names only the key gives. A stranger's
    unkeyed entry copied under such a name, or one MAC'd under another key, is a miss and dropped."""
    m, ids = model(), prompt()
    key, other = b"k" * 32, b"o" * 32
    keyed = PrefixStore(chunk_size=CHUNK, backend=where.backend(), key=key)
    keyed.prefill(m, ids[0].tolist())
    plain = PrefixStore(chunk_size=CHUNK, backend=where.backend())
    assert plain.lookup(ids[0].tolist(), m)[0] == 0  # other names: the plain store cannot even find them
    assert PrefixStore(chunk_size=CHUNK, backend=where.backend(), key=key).lookup(ids[0].tolist(), m)[0] == 32
    plain.prefill(m, ids[0].tolist())
    names, plain_names = keyed.chunk_keys(m, ids[0].tolist()), plain.chunk_keys(m, ids[0].tolist())
    assert not set(names) & set(plain_names)
    entry = codec.decode(plain_names[1], where.read(plain_names[1]), None)
    entry.parent = names[0]
    for mac in (None, other):
        where.plant(names[1], codec.encode(names[1], entry, mac))
        with pytest.warns(UserWarning, match="MAC|does not match"):
            assert keyed.lookup(ids[0].tolist(), m)[0] == 8
        assert not where.held(names[1])
    with pytest.raises(KVCacheError):
        PrefixStore(chunk_size=CHUNK, key=b"short")
