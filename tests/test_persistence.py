"""Round trips of every cache kind through save_cache/load_cache, copies, atomic saves, devices.

The reference for a loaded cache is the original object: both are driven by the same seeded
inputs (updates, crops, commits, new lazy layers) and must return bitwise-identical tensors and end
in identical descriptions.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file

from kvcache import (
    Cache,
    CacheFormatError,
    CacheInputError,
    DynamicCache,
    DynamicLayer,
    EncoderDecoderCache,
    HybridLayer,
    RecurrentLayer,
    RollbackError,
    SlidingWindowLayer,
    StaticCache,
    StaticLayer,
    load_cache,
    save_cache,
)
from kvcache.persistence import composite_kinds, inspect_cache_file
from kvcache.persistence.composite import describe_cache
from kvcache.persistence.integrity import DIGEST_TENSOR

B, H, D = 2, 3, 4
CONV_CHANNELS, KERNEL, REC_SHAPE = 6, 4, (5, 3)


# ------------------------------------------------------------------------------------ driving
def _layers(cache: Any) -> list:
    return cache.self_attention_cache.layers if isinstance(cache, EncoderDecoderCache) else cache.layers


def step(cache: Any, num_layers: int, gen: torch.Generator, n: int, dtype: torch.dtype, inter: bool) -> list:
    """Feed `n` tokens to layers 0..num_layers-1 through the composite API; return clones of
    everything the cache handed back (what a model would have read)."""
    out = []
    for idx in range(num_layers):
        layers = _layers(cache)
        layer = layers[idx] if idx < len(layers) else None
        if layer is None or layer.has_attention:
            k = torch.randn(B, H, n, D, generator=gen).to(dtype)
            v = torch.randn(B, H, n, D, generator=gen).to(dtype)
            out += [t.clone() for t in cache.update(k, v, idx)]
        if layer is not None and layer.has_recurrent:
            for s in range(getattr(layer, "num_states", 1)):
                conv_in = torch.randn(B, CONV_CHANNELS, n, generator=gen).to(dtype)
                out.append(cache.update_conv_state(conv_in, idx, state_idx=s, conv_kernel_size=KERNEL).clone())
                new = torch.randn(B, *REC_SHAPE, generator=gen).to(dtype)
                kwargs = {}
                if inter:
                    inner = torch.randn(B, n, *REC_SHAPE, generator=gen).to(dtype)
                    inner[:, -1] = new
                    kwargs["intermediate_states"] = inner
                out.append(cache.update_recurrent_state(new, idx, state_idx=s, **kwargs).clone())
    return out


def snapshot(cache: Any) -> tuple[str, dict[str, torch.Tensor]]:
    """Everything that defines a cache: its description and the content of its tensors."""
    description, tensors = describe_cache(cache)
    return json.dumps(description, sort_keys=True), {k: v.clone() for k, v in tensors.items()}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def assert_same_tensors(a: list | dict, b: list | dict) -> None:
    """Same names (for dicts), dtypes, shapes and bytes: bitwise, so -0.0 or NaN cannot hide a difference."""
    assert len(a) == len(b)
    if isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b)
        a, b = list(a.values()), list(b.values())
    for x, y in zip(a, b, strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape
        assert torch.equal(_bits(x), _bits(y))


def assert_same_cache(a: Any, b: Any) -> None:
    desc_a, tensors_a = snapshot(a)
    desc_b, tensors_b = snapshot(b)
    assert desc_a == desc_b
    assert_same_tensors(tensors_a, tensors_b)


def continue_both(original: Any, loaded: Any, num_layers: int, dtype: torch.dtype, inter: bool, seed: int) -> int:
    """Drive both caches the same way (grow, roll back, commit, regrow); outputs must match bitwise.
    Returns how many crops were made."""
    plan: list[tuple[str, int]] = [("step", 2), ("crop_last", 0), ("step", 1), ("step", 3), ("crop_last", 0)]
    plan += [("commit", 0), ("step", 2), ("record", 0), ("step", 1), ("crop_last", 0), ("step", 2)]
    gens = [torch.Generator().manual_seed(seed) for _ in range(2)]
    last_n = crops = 0
    for action, n in plan:
        assert original.max_rollback == loaded.max_rollback
        assert original.is_croppable == loaded.is_croppable
        if action == "step":
            outs = [step(c, num_layers, g, n, dtype, inter) for c, g in zip((original, loaded), gens, strict=True)]
            assert_same_tensors(outs[0], outs[1])
            last_n = n
        elif action == "crop_last":
            if original.is_croppable and original.max_rollback >= last_n > 0:
                original.crop(-last_n)
                loaded.crop(-last_n)
                crops += 1
            last_n = 0
        elif action == "commit":
            original.crop(0)
            loaded.crop(0)
        elif action == "record":
            original.activate_past_recording()
            loaded.activate_past_recording()
        assert original.get_seq_length() == loaded.get_seq_length()
        assert_same_cache(original, loaded)
    return crops


# ---------------------------------------------------------------------------------- scenarios
def _recurrent(num_states: int = 1) -> RecurrentLayer:
    return RecurrentLayer(num_states)


SCENARIOS: dict[str, tuple[Callable[[], Any], int, int]] = {
    # name: (build, layers fed before saving, layers fed after loading)
    "dynamic_lazy": (DynamicCache, 2, 3),
    "dynamic_types": (lambda: DynamicCache(["full_attention", "sliding_attention"], sliding_window=4), 2, 2),
    "static_lazy": (lambda: StaticCache(64), 2, 3),
    "static_fixed": (lambda: StaticCache(64, num_layers=2), 2, 2),
    "plain_layers": (lambda: Cache([DynamicLayer(), SlidingWindowLayer(3), StaticLayer(64)]), 3, 3),
    "plain_lazy_sliding": (lambda: Cache(layer_factory=lambda: SlidingWindowLayer(5)), 2, 3),
    "recurrent": (lambda: Cache([_recurrent(), _recurrent(2)]), 2, 2),
    "hybrid": (
        lambda: Cache([HybridLayer(SlidingWindowLayer(4), _recurrent()), HybridLayer(DynamicLayer(), _recurrent(2))]),
        2,
        2,
    ),
    "mixed": (lambda: Cache([DynamicLayer(), _recurrent(), HybridLayer(StaticLayer(64), _recurrent())]), 3, 3),
    "encoder_decoder": (None, 2, 2),  # built by _encoder_decoder (needs a cross part)
}


def _encoder_decoder(dtype: torch.dtype) -> EncoderDecoderCache:
    gen = torch.Generator().manual_seed(7)
    cache = EncoderDecoderCache(DynamicCache(), DynamicCache())
    for idx in range(2):
        k = torch.randn(B, H, 9, D, generator=gen).to(dtype)
        cache.cross_attention_cache.update(k, -k, idx)
        cache.is_updated[idx] = True
    return cache


def build(name: str, dtype: torch.dtype, record_at: int, inter: bool, steps: int = 4) -> tuple[Any, int]:
    """A cache of kind `name` grown by `steps` steps, recording from step `record_at` on."""
    factory, before, after = SCENARIOS[name]
    cache = _encoder_decoder(dtype) if factory is None else factory()
    gen = torch.Generator().manual_seed(1)
    for i in range(steps):
        if i == record_at:
            cache.activate_past_recording()
        step(cache, before, gen, 1 + i % 3, dtype, inter)
    return cache, after


CASES = [
    pytest.param(name, dtype, record_at, inter, id=f"{name}-{str(dtype)[6:]}-rec{record_at}{'-inter' if inter else ''}")
    for name in SCENARIOS
    for dtype, record_at, inter in [
        (torch.float32, 2, False),
        (torch.bfloat16, 0, False),
        (torch.float16, 99, False),
        (torch.float32, 1, True),
    ]
    if not inter or name in ("recurrent", "hybrid", "mixed")
]


@pytest.mark.parametrize(("name", "dtype", "record_at", "inter"), CASES)
def test_round_trip_continues_bitwise(
    tmp_path: Path, name: str, dtype: torch.dtype, record_at: int, inter: bool
) -> None:
    original, num_layers = build(name, dtype, record_at, inter)
    before = snapshot(original)
    path = tmp_path / "cache.safetensors"
    save_cache(original, path, metadata={"kind": name, "tokens": [1, 2, 3]})
    assert_same_tensors(before[1], snapshot(original)[1])  # saving does not touch the cache
    loaded, metadata = load_cache(path, return_metadata=True)
    assert metadata == {"kind": name, "tokens": [1, 2, 3]}
    assert type(loaded) is type(original)
    assert_same_cache(original, loaded)
    if isinstance(original, EncoderDecoderCache):
        assert loaded.is_updated == original.is_updated
    crops = continue_both(original, loaded, num_layers, dtype, inter, seed=5)
    recording_all_along = record_at < 4 and SCENARIOS[name][1] == num_layers  # no fresh lazy layer
    assert crops >= (3 if recording_all_along else 1)  # rollback was exercised on the loaded cache


def test_round_trip_empty_and_lazy_caches(tmp_path: Path) -> None:
    path = tmp_path / "c.safetensors"
    cropped_to_nothing = DynamicCache()
    cropped_to_nothing.update(torch.ones(B, H, 3, D), torch.ones(B, H, 3, D), 0)
    cropped_to_nothing.crop(-3)  # zero-size tensors in the file
    caches = (DynamicCache(), StaticCache(8), Cache([]), Cache([DynamicLayer(), RecurrentLayer()]), cropped_to_nothing)
    for cache in caches:
        save_cache(cache, path)
        loaded = load_cache(path)
        assert type(loaded) is type(cache) and len(loaded) == len(cache)
        assert_same_cache(cache, loaded)
        num_layers = 2 if cache.layer_factory is not None else len(cache)
        continue_both(cache, loaded, num_layers, torch.float32, False, seed=3)


def test_lazy_factories_are_restored(tmp_path: Path) -> None:
    path = tmp_path / "c.safetensors"
    save_cache(DynamicCache(), path)
    assert load_cache(path).layer_factory is DynamicLayer  # the class's own factory, not a stand-in
    save_cache(DynamicCache(["full_attention"]), path)
    assert load_cache(path).layer_factory is None
    save_cache(StaticCache(16), path)
    loaded = load_cache(path)
    assert loaded.max_cache_len == 16 and loaded.layer_factory().get_max_length() == 16
    save_cache(Cache(layer_factory=lambda: SlidingWindowLayer(5)), path)
    fresh = load_cache(path).layer_factory()
    assert isinstance(fresh, SlidingWindowLayer) and fresh.sliding_window == 5
    for recording in (False, True):  # layers created after loading record iff they would have before
        cache = DynamicCache()
        if recording:
            cache.activate_past_recording()
        save_cache(cache, path)
        loaded = load_cache(path)
        for c in (cache, loaded):
            c.update(torch.zeros(1, 1, 1, 2), torch.zeros(1, 1, 1, 2), 0)
            assert c.is_recording_past(0) is recording


def test_file_is_plain_safetensors(tmp_path: Path) -> None:
    """Any safetensors reader sees the live tensors under their documented names, plus the digest."""
    cache, _ = build("mixed", torch.float32, 1, True)
    path = tmp_path / "c.safetensors"
    save_cache(cache, path)
    _, tensors = describe_cache(cache)
    plain = load_file(path)
    assert plain.pop(DIGEST_TENSOR).shape == (16,)  # the whole-file digest, always the last tensor
    assert sorted(plain) == sorted(tensors)
    for name, tensor in tensors.items():
        assert torch.equal(plain[name], tensor)
    assert "layers.0.keys" in plain and "layers.1.recurrent.0" in plain


def test_non_contiguous_and_transposed_states_are_written_correctly(tmp_path: Path) -> None:
    big = torch.randn(3, 4, 40, 8)
    layer = DynamicLayer.from_state({"seq_length": 40, "record_past": False}, {"keys": big, "values": big.clone()})
    layer._kv.start = 5  # live window in the middle of larger storage: a strided view
    layer._kv.end = 33
    transposed = torch.randn(2, 3, 20, 8).transpose(2, 3).contiguous().transpose(2, 3)  # not row-contiguous
    meta = {"seq_length": 20, "record_past": False}
    other = DynamicLayer.from_state(meta, {"keys": transposed, "values": transposed})
    cache = Cache([layer, other])
    path = tmp_path / "c.safetensors"
    save_cache(cache, path)
    loaded = load_cache(path)
    assert torch.equal(loaded.layers[0].keys, big[:, :, 5:33]) and torch.equal(loaded.layers[1].values, transposed)


# --------------------------------------------------------------------------------- copies
@pytest.mark.parametrize("name", list(SCENARIOS))
@pytest.mark.parametrize("how", ["copy", "deepcopy"])
def test_copy_is_independent(name: str, how: str) -> None:
    original, num_layers = build(name, torch.float32, 1, name in ("recurrent", "hybrid", "mixed"))
    fork = original.copy() if how == "copy" else copy.deepcopy(original)
    assert type(fork) is type(original)
    assert_same_cache(original, fork)
    _, tensors = describe_cache(original)
    _, fork_tensors = describe_cache(fork)
    originals = {t.untyped_storage().data_ptr() for t in tensors.values()}
    assert not originals & {t.untyped_storage().data_ptr() for t in fork_tensors.values()}
    frozen = snapshot(original)
    gen = torch.Generator().manual_seed(11)
    step(fork, num_layers, gen, 2, torch.float32, False)  # the fork moves on ...
    fork.crop(-2)
    fork.crop(0)
    step(fork, num_layers, gen, 3, torch.float32, False)
    if isinstance(fork, EncoderDecoderCache):
        fork.is_updated[0] = False
        fork.cross_attention_cache.reset()
    desc, tensors_now = snapshot(original)  # ... the original did not
    assert desc == frozen[0]
    assert_same_tensors(frozen[1], tensors_now)
    if isinstance(original, EncoderDecoderCache):
        assert original.is_updated == {0: True, 1: True}
    twin = original.copy() if how == "copy" else copy.deepcopy(original)
    assert continue_both(original, twin, num_layers, torch.float32, False, seed=2) >= 1


# ----------------------------------------------------------------------------- bad input
def test_user_metadata_is_validated_before_touching_disk(tmp_path: Path) -> None:
    cache, _ = build("dynamic_lazy", torch.float32, 99, False)
    path = tmp_path / "c.safetensors"
    bad_metadata: list[Any] = [
        ["not", "a", "dict"],
        {1: "int key"},
        {"t": torch.tensor([1, 2])},
        {"t": (1, 2)},
        {"nan": float("nan")},
        {"nested": {"deep": object()}},
        {"set": {1, 2}},
    ]
    for metadata in bad_metadata:
        with pytest.raises(CacheInputError, match="metadata"):
            save_cache(cache, path, metadata=metadata)
    assert list(tmp_path.iterdir()) == []
    good = {"model": "m", "prompt": list(range(50)), "temperature": 0.5, "flags": {"a": [None, True]}, "ü": "ß"}
    save_cache(cache, path, metadata=good)
    assert load_cache(path, return_metadata=True)[1] == good


def test_unsupported_caches_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "c.safetensors"

    class MyCache(DynamicCache):
        pass

    class MyLayer(DynamicLayer):  # not registered
        pass

    for cache, match in [
        (MyCache(), "MyCache"),
        ({"layers": []}, "dict"),
        (Cache([MyLayer()]), "not a registered layer"),
        (Cache(layer_factory=lambda: "nope"), "not a CacheLayer"),
        (EncoderDecoderCache(DynamicCache(), MyCache()), "MyCache"),
    ]:
        with pytest.raises(CacheInputError, match=match):
            save_cache(cache, path)
    bad_dtype = DynamicCache()
    wide = torch.zeros(1, 1, 1, 2, dtype=torch.complex128)
    bad_dtype.update(wide, wide, 0)
    with pytest.raises(CacheInputError, match="complex128"):
        save_cache(bad_dtype, path)
    with pytest.raises(CacheInputError, match="directory"):
        save_cache(DynamicCache(), tmp_path)
    with pytest.raises(CacheInputError, match="path"):
        save_cache(DynamicCache(), 42)  # type: ignore[arg-type]
    assert list(tmp_path.iterdir()) == []
    assert set(composite_kinds()) == {"Cache", "DynamicCache", "StaticCache", "EncoderDecoderCache"}


def test_devices(tmp_path: Path) -> None:
    cache, _ = build("hybrid", torch.float32, 1, False)
    path = tmp_path / "c.safetensors"
    save_cache(cache, path)
    for device in ("cpu", torch.device("cpu")):
        loaded = load_cache(path, device=device)
        assert all(t.device.type == "cpu" for t in describe_cache(loaded)[1].values())
    for device in ("nonsense", "cuda:99" if not torch.cuda.is_available() else "nonsense:0", 3.5):
        with pytest.raises(CacheInputError, match="device"):
            load_cache(path, device=device)  # type: ignore[arg-type]
    if torch.cuda.is_available():  # pragma: no cover - no GPU in CI
        loaded = load_cache(path, device="cuda")
        assert all(t.device.type == "cuda" for t in describe_cache(loaded)[1].values())
        assert_same_cache(cache, load_cache(path))


def test_missing_file_is_an_os_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        load_cache(tmp_path / "absent.safetensors")


# ---------------------------------------------------------------------------- atomic save
def _files(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in directory.iterdir()}


def test_failed_save_leaves_earlier_file_intact(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "c.safetensors"
    first, _ = build("mixed", torch.float32, 1, True)
    save_cache(first, path, metadata={"v": 1})
    before = _files(tmp_path)
    second, _ = build("dynamic_types", torch.float32, 1, False, steps=6)

    # 1. a tensor that cannot be written (fails in the middle of the data section)
    class Boom(RuntimeError):
        pass

    import kvcache.persistence.writer as writer

    calls = {"n": 0}
    real_rows = writer._rows

    def failing_rows(tensor: torch.Tensor):
        calls["n"] += 1
        if calls["n"] == 3:
            raise Boom("cannot write this tensor")
        yield from real_rows(tensor)

    monkeypatch.setattr(writer, "_rows", failing_rows)
    with pytest.raises(Boom):
        save_cache(second, path)
    monkeypatch.undo()
    assert _files(tmp_path) == before

    # 2. the disk fills up during fsync / the rename fails
    import kvcache.persistence.writer as w

    for name in ("fsync", "replace"):
        def fail(*args: Any, _name: str = name) -> None:
            raise OSError(28, f"No space left on device ({_name})")

        monkeypatch.setattr(w.os, name, fail)
        with pytest.raises(OSError, match="No space"):
            save_cache(second, path)
        monkeypatch.undo()
        assert _files(tmp_path) == before

    # 3. an interrupt (KeyboardInterrupt is not an Exception) mid-write
    def interrupted(tensor: torch.Tensor):
        raise KeyboardInterrupt

    monkeypatch.setattr(writer, "_rows", interrupted)
    with pytest.raises(KeyboardInterrupt):
        save_cache(second, path)
    monkeypatch.undo()
    assert _files(tmp_path) == before
    assert load_cache(path, return_metadata=True)[1] == {"v": 1}

    # and a successful save replaces the file, keeping its permissions
    os.chmod(path, 0o640)
    save_cache(second, path)
    assert (path.stat().st_mode & 0o777) == 0o640
    assert_same_cache(second, load_cache(path))
    assert [p.name for p in tmp_path.iterdir()] == ["c.safetensors"]


@pytest.mark.skipif(sys.platform == "win32", reason="needs RLIMIT_FSIZE")
def test_save_into_full_disk_leaves_earlier_file_intact(tmp_path: Path) -> None:
    """A real write error: the process may write at most 64 KiB per file (RLIMIT_FSIZE)."""
    path = tmp_path / "c.safetensors"
    small, _ = build("dynamic_lazy", torch.float32, 99, False)
    save_cache(small, path)
    before = _files(tmp_path)
    script = textwrap.dedent(
        f"""
        import resource, signal, sys, torch
        from kvcache import DynamicCache, save_cache
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (65536, 65536))
        cache = DynamicCache()
        cache.update(torch.randn(1, 4, 4096, 16), torch.randn(1, 4, 4096, 16), 0)
        try:
            save_cache(cache, {str(path)!r})
        except OSError as err:
            print("OSError", err.errno)
            sys.exit(0)
        sys.exit(1)
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("OSError")
    assert _files(tmp_path) == before


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores directory permissions")
def test_read_only_directory(tmp_path: Path) -> None:  # pragma: no cover - CI runs as root
    path = tmp_path / "c.safetensors"
    save_cache(DynamicCache(), path)
    before = _files(tmp_path)
    tmp_path.chmod(0o500)
    try:
        with pytest.raises(PermissionError):
            save_cache(build("dynamic_lazy", torch.float32, 99, False)[0], path)
    finally:
        tmp_path.chmod(0o700)
    assert _files(tmp_path) == before


def test_inspect_cache_file_reports_description(tmp_path: Path) -> None:
    cache, _ = build("encoder_decoder", torch.float32, 1, False)
    path = tmp_path / "c.safetensors"
    save_cache(cache, path, metadata={"m": 1})
    info = inspect_cache_file(path)
    assert info.metadata == {"m": 1}
    assert info.description["class"] == "EncoderDecoderCache"
    assert info.specs["cross_attention_cache.layers.1.keys"] == ("F32", [B, H, 9, D])
    path.write_bytes(b"garbage")
    with pytest.raises(CacheFormatError):
        inspect_cache_file(path)


def test_new_file_permissions_and_long_names(tmp_path: Path) -> None:
    path = tmp_path / ("x" * 240 + ".safetensors")  # 252 chars: the temporary name must still fit
    save_cache(DynamicCache(), path)
    umask = os.umask(0o022)
    os.umask(umask)
    assert path.stat().st_mode & 0o777 == 0o666 & ~umask  # not mkstemp's private 0o600
    assert [p.name for p in tmp_path.iterdir()] == [path.name]


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_every_composite_attribute_is_persisted(name: str) -> None:
    """Tripwire: composite state persistence does not know about would be lost by a round trip."""
    cache, num_layers = build(name, torch.float32, 1, False)
    step(cache, num_layers, torch.Generator().manual_seed(0), 2, torch.float32, False)
    cache.crop(-2)
    known = {"layers", "layer_factory", "_record_new_layers", "max_cache_len"}
    if isinstance(cache, EncoderDecoderCache):
        assert set(vars(cache)) <= {"self_attention_cache", "cross_attention_cache", "is_updated"}
        parts = [cache.self_attention_cache, cache.cross_attention_cache]
    else:
        parts = [cache]
    for part in parts:
        assert set(vars(part)) <= known, f"persist {set(vars(part)) - known} in kvcache/persistence/composite.py"


_OPS = st.one_of(
    st.tuples(st.just("step"), st.integers(1, 3)),
    st.tuples(st.just("crop"), st.integers(1, 4)),
    st.tuples(st.just("commit"), st.just(0)),
    st.tuples(st.just("record"), st.just(0)),
    st.tuples(st.just("reload"), st.just(0)),
)


@settings(max_examples=200 if os.environ.get("KVCACHE_SLOW") == "1" else 20)
@given(
    name=st.sampled_from(list(SCENARIOS)),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    ops=st.lists(_OPS, min_size=1, max_size=12),
)
def test_random_histories_survive_reloads(name: str, dtype: torch.dtype, ops: list[tuple[str, int]]) -> None:
    """Any sequence of steps, crops, commits and save/load cycles: the reloaded cache behaves
    exactly like the original that was never saved."""
    original, num_layers = build(name, dtype, 1, False, steps=2)
    twin = copy.deepcopy(original)
    gens = [torch.Generator().manual_seed(9) for _ in range(2)]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "c.safetensors"
        for op, n in ops:
            if op == "step":
                outs = [step(c, num_layers, g, n, dtype, False) for c, g in zip((original, twin), gens, strict=True)]
                assert_same_tensors(outs[0], outs[1])
            elif op == "crop":
                assert (original.max_rollback, original.is_croppable) == (twin.max_rollback, twin.is_croppable)
                try:
                    original.check_crop(-n)
                except RollbackError:
                    with pytest.raises(RollbackError):  # the reloaded cache refuses the same crops
                        twin.crop(-n)
                else:
                    original.crop(-n)
                    twin.crop(-n)
            elif op == "commit":
                original.crop(0)
                twin.crop(0)
            elif op == "record":
                original.activate_past_recording()
                twin.activate_past_recording()
            else:
                save_cache(twin, path, fsync=False)
                twin = load_cache(path)
            assert_same_cache(original, twin)


def test_a_cache_larger_than_the_write_buffer_round_trips(tmp_path) -> None:
    """Sequence-major storage makes the saved [batch, heads, seq, dim] rows tiny; the writer gathers
    them through a reused buffer in slices (here 2 slices of 5 MiB): the file holds the same bytes."""
    from kvcache import DynamicCache, load_cache, save_cache

    cache = DynamicCache()
    keys = torch.randn(1, 2, 20000, 64, generator=torch.Generator().manual_seed(0))
    cache.update(keys, keys * 2, 0)
    save_cache(cache, tmp_path / "big.kvc")
    loaded = load_cache(tmp_path / "big.kvc")
    assert torch.equal(loaded.layers[0].keys, keys) and torch.equal(loaded.layers[0].values, keys * 2)
