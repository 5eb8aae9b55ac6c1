"""A file's layout is the cache's memory layout: head-major keys/values `[batch, heads, seq, dim]`
are stored as they lie in memory, one contiguous block per batch row and head, so a save writes
them without packing a copy and a load reads each block straight into the storage its layer keeps
(with append headroom, no second copy). Files in 0.2's layout (format 2), files of 0.3-0.4 whose
tensors were stored sequence-major (`order`), and files whose tensors lie in another order than
their description lists them, still load exactly."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from kvcache import Cache, DynamicLayer, HybridLayer, RecurrentLayer, SlidingWindowLayer, load_cache, save_cache
from kvcache.persistence.composite import describe_cache
from kvcache.persistence.header import _digest
from kvcache.persistence.integrity import FileDigest
from kvcache.persistence.writer import write_safetensors

H, D = 3, 8


def grown(batch: int, layers: list, seed: int = 0) -> Cache:
    """`layers` fed a 13-token prefill and 4 decode steps (recording from the third), through the
    composite API."""
    cache = Cache(layers)
    gen = torch.Generator().manual_seed(seed)
    for step, n in enumerate((13, 1, 1, 1, 1)):
        if step == 3:
            cache.activate_past_recording()
        feed(cache, gen, batch, n)
    return cache


def feed(cache: Cache, gen: torch.Generator, batch: int, n: int) -> list[torch.Tensor]:
    out = []
    for i, layer in enumerate(cache.layers):
        if layer.has_attention:
            keys, values = torch.randn(batch, H, n, D, generator=gen), torch.randn(batch, H, n, D, generator=gen)
            out += cache.update(keys, values, i)
        if layer.has_recurrent:
            cache.update_conv_state(torch.randn(batch, 4, n, generator=gen), i, conv_kernel_size=3)
            out.append(cache.update_recurrent_state(torch.randn(batch, 2, 2, generator=gen), i))
    return out


def attention_parts(cache: Cache) -> list:
    return [layer.attention if isinstance(layer, HybridLayer) else layer for layer in cache.layers]


def kv_layers() -> list:
    return [DynamicLayer(), SlidingWindowLayer(5), HybridLayer(DynamicLayer(), RecurrentLayer())]


@pytest.mark.parametrize("batch", [1, 3])
def test_keys_and_values_are_stored_as_they_lie_in_memory(tmp_path: Path, batch: int) -> None:
    cache = grown(batch, kv_layers())
    path = tmp_path / "c.safetensors"
    save_cache(cache, path)
    description = describe_cache(cache)[0]
    with safe_open(path, framework="pt") as f:
        for i, part in enumerate(attention_parts(cache)):
            prefix = "attention." if isinstance(cache.layers[i], HybridLayer) else ""
            for name, live in (("keys", part.keys), ("values", part.values)):
                assert "order" not in description["layers"][i]["tensors"][prefix + name]  # as in storage
                stored = f.get_tensor(f"layers.{i}.{prefix}{name}")
                assert stored.shape == (batch, H, live.shape[2], D) and torch.equal(stored, live)
                assert live.stride()[2:] == (D, 1)  # each (batch, head) block contiguous in memory


def test_a_load_reads_each_tensor_into_the_storage_its_layer_keeps(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No tensor is copied after the read, the loaded storage has the headroom a grown buffer has, and
    the next steps return what the original's return, with the same strides, without regrowing."""
    batch = 2
    cache = grown(batch, [DynamicLayer(), SlidingWindowLayer(5), DynamicLayer()])
    path = tmp_path / "c.safetensors"
    save_cache(cache, path)
    copies: list[tuple[int, ...]] = []
    original_copy = torch.Tensor.copy_

    def counting_copy(self: torch.Tensor, src: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        copies.append(tuple(self.shape))
        return original_copy(self, src, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "copy_", counting_copy)
    loaded = load_cache(path)
    monkeypatch.undo()
    assert copies == []
    storage = []
    for mine, theirs in zip(loaded.layers, cache.layers, strict=True):
        assert mine._kv.capacity == mine.headroom().capacity(len(mine._kv))
        assert mine.keys.stride()[2:] == theirs.keys.stride()[2:] and torch.equal(mine.keys, theirs.keys)
        storage.append(mine._kv.keys.data_ptr())
    gen_a, gen_b = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
    for _ in range(3):
        ours, reference = feed(loaded, gen_a, batch, 1), feed(cache, gen_b, batch, 1)
        for a, b in zip(ours, reference, strict=True):
            assert a.stride()[2:] == b.stride()[2:] and torch.equal(a, b)
    full = [i for i, layer in enumerate(loaded.layers) if not layer.is_sliding]  # a window slides when it must
    assert [loaded.layers[i]._kv.keys.data_ptr() for i in full] == [storage[i] for i in full]  # no regrowth


def _write(path: Path, cache: Cache, version: str, reorder: bool = False, seq_major: bool = False) -> None:
    """`cache` written as kvcache `version` files are: version 2 (kvcache 0.2) stored every tensor in
    its logical `[batch, heads, seq, dim]` order, with no `order` in the description. `reorder`
    stores the tensors in the reverse of the description's order."""
    description, tensors = describe_cache(cache)
    if version == "2":
        live = {f"layers.{i}.{name}": t for i, layer in enumerate(cache.layers) for name, t in layer.state.items()}
        tensors = {name: live[name].contiguous() for name in tensors}
        for entry in description["layers"]:
            for spec in entry["tensors"].values():
                spec.pop("order", None)
    if seq_major:  # as kvcache 0.3-0.4 stored keys/values: `[seq, batch, heads, dim]`, order [2, 0, 1, 3]
        for entry, layer_index in zip(description["layers"], range(len(description["layers"])), strict=True):
            for name, spec in entry["tensors"].items():
                if len(spec["shape"]) == 4 and name.split(".")[-1] in ("keys", "values"):
                    spec["order"] = [2, 0, 1, 3]
                    key = f"layers.{layer_index}.{name}"
                    tensors[key] = tensors[key].permute(2, 0, 1, 3).contiguous()
    if reorder:
        tensors = dict(reversed(tensors.items()))
    description_json = json.dumps(description, separators=(",", ":"))
    digest = FileDigest(None)
    sha = _digest(version, description_json, "{}", digest.scheme)
    header = {"format": "kvcache", "format_version": version, "cache": description_json, "user": "{}",
              "integrity": digest.scheme, "sha256": sha}  # fmt: skip
    with open(path, "wb") as f:
        write_safetensors(f, tensors, header, digest)


@pytest.mark.parametrize(("version", "reorder", "seq_major"),
                         [("2", False, False), ("3", True, False), ("2", True, False), ("3", False, True)])  # fmt: skip
def test_other_layouts_load_exactly(tmp_path: Path, version: str, reorder: bool, seq_major: bool) -> None:
    """A 0.2 file (logical layout), a 0.3-0.4 file (sequence-major keys/values, `order`), and a
    file whose tensors lie in another order than described, load (verified) into caches that
    continue exactly as the original."""
    cache = grown(2, [*kv_layers(), RecurrentLayer()])
    path = tmp_path / "c.safetensors"
    _write(path, cache, version, reorder, seq_major)
    loaded = load_cache(path)
    assert [layer.meta_state for layer in loaded.layers] == [layer.meta_state for layer in cache.layers]
    gen_a, gen_b = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    for n in (1, 2, 1):
        for a, b in zip(feed(loaded, gen_a, 2, n), feed(cache, gen_b, 2, n), strict=True):
            assert torch.equal(a, b)
    loaded.crop(-3)
    cache.crop(-3)
    for a, b in zip(feed(loaded, gen_a, 2, 1), feed(cache, gen_b, 2, 1), strict=True):
        assert torch.equal(a, b)


def _big_cache() -> Cache:
    """Keys/values of 2 MiB each: saved in pieces hashed in the writer's second thread."""
    cache = Cache([DynamicLayer()])
    gen = torch.Generator().manual_seed(5)
    cache.update(torch.randn(1, 8, 512, 128, generator=gen), torch.randn(1, 8, 512, 128, generator=gen), 0)
    return cache


def test_large_tensors_hashed_while_written_are_verified(tmp_path: Path) -> None:
    from kvcache import CacheFormatError
    from kvcache.persistence.writer import OVERLAP_BYTES

    cache = _big_cache()
    assert cache.layers[0].keys.nbytes >= 4 * OVERLAP_BYTES
    path = tmp_path / "big.safetensors"
    save_cache(cache, path)
    assert torch.equal(load_cache(path).layers[0].keys, cache.layers[0].keys)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(data)
    with pytest.raises(CacheFormatError, match="digest"):
        load_cache(path)


_FORK_CACHE: list[Cache] = []


def _save_in_child(path: str) -> None:
    save_cache(_FORK_CACHE[0], path)  # built before the fork: a forked child must not run torch's thread pools


def test_a_forked_child_saves_with_a_hashing_thread_of_its_own(tmp_path: Path) -> None:
    """The parent's hashing thread does not exist in a forked child: the child must not wait on it."""
    import multiprocessing

    _FORK_CACHE[:] = [_big_cache()]
    save_cache(_FORK_CACHE[0], tmp_path / "parent.safetensors")  # the parent's thread is running now
    child = multiprocessing.get_context("fork").Process(target=_save_in_child, args=(str(tmp_path / "c.safetensors"),))
    child.start()
    child.join(timeout=30)
    if child.is_alive():
        child.kill()
        pytest.fail("the forked child's save hung")
    assert child.exitcode == 0
    assert torch.equal(load_cache(tmp_path / "c.safetensors").layers[0].keys, _FORK_CACHE[0].layers[0].keys)


def test_adopt_state_keeps_landing_storage_and_copies_anything_else() -> None:
    """`adopt_state` keeps storage `load_target` handed out (no copy); keys and values that share
    storage, or a plain contiguous tensor, are copied, so appends to one never show in the other."""
    from kvcache.layers.kv_buffer import KVBuffer

    gen = torch.Generator().manual_seed(9)
    keys, values = (KVBuffer.landing([2, H, 5, D], torch.float32) for _ in range(2))
    keys.copy_(torch.randn(2, H, 5, D, generator=gen))
    values.copy_(torch.randn(2, H, 5, D, generator=gen))
    layer = DynamicLayer.adopt_state({"seq_length": 5}, {"keys": keys, "values": values})
    assert layer._kv.keys.data_ptr() == keys.data_ptr() and layer._kv.values.data_ptr() == values.data_ptr()
    same = DynamicLayer.adopt_state({"seq_length": 5}, {"keys": keys, "values": keys})
    plain = DynamicLayer.adopt_state({"seq_length": 5}, {"keys": keys.contiguous(), "values": values.contiguous()})
    for adopted in (same, plain):
        new_k, new_v = torch.ones(2, H, 1, D), torch.zeros(2, H, 1, D)
        out_k, out_v = adopted.update(new_k, new_v)
        assert torch.equal(out_k[:, :, -1:], new_k) and torch.equal(out_v[:, :, -1:], new_v)
        assert torch.equal(out_k[:, :, :5], keys)


@pytest.mark.parametrize("layer_cls", [DynamicLayer, SlidingWindowLayer, HybridLayer, RecurrentLayer])
def test_load_target_and_adopt_state_refuse_bad_input(layer_cls: type) -> None:
    from kvcache import CacheInputError

    for shape, dtype in (([1, -2, 3, 4], torch.float32), ("keys", torch.float32), ([1, 2, 3, 4], "float32")):
        with pytest.raises(CacheInputError, match="load_target"):
            layer_cls.load_target({}, "keys", shape, dtype)
    with pytest.raises(CacheInputError):
        layer_cls.adopt_state({"seq_length": -1, "sliding_window": 0}, {"keys": torch.zeros(1, 1, 1, 1)})
