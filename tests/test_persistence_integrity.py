"""Every byte of a saved file is covered: flipped bits, truncation, rewrites after loading, a keyed
MAC, old-version files, what a header may allocate, and the temporary files of killed saves."""

from __future__ import annotations

import json
import os
import signal
import struct
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from kvcache import (
    Cache,
    CacheFormatError,
    CacheInputError,
    DynamicLayer,
    HybridLayer,
    RecurrentLayer,
    SlidingWindowLayer,
    StaticLayer,
    load_cache,
    save_cache,
)
from kvcache.persistence import writer
from kvcache.persistence.composite import describe_cache
from kvcache.persistence.header import _digest, make_header
from kvcache.persistence.integrity import DIGEST_TENSOR, FileDigest
from kvcache.persistence.writer import TEMP_SUFFIX, write_safetensors


def small_mixed_cache() -> Cache:
    """Every layer kind, recording, with rollback history, in a few KB."""
    gen = torch.Generator().manual_seed(0)
    cache = Cache([DynamicLayer(), SlidingWindowLayer(3), StaticLayer(6), RecurrentLayer(),
                   HybridLayer(DynamicLayer(), RecurrentLayer())])  # fmt: skip
    for step in range(3):
        for i, layer in enumerate(cache.layers):
            if layer.has_attention:
                cache.update(torch.randn(1, 2, 1, 4, generator=gen), torch.randn(1, 2, 1, 4, generator=gen), i)
            if layer.has_recurrent:
                cache.update_conv_state(torch.randn(1, 3, 1, generator=gen), i, conv_kernel_size=2)
                cache.update_recurrent_state(torch.randn(1, 2, 2, generator=gen), i)
        if step == 0:
            cache.activate_past_recording()
    return cache


def state_of(cache: Cache) -> list:
    return [(layer.meta_state, {k: v.clone() for k, v in layer.state.items()}) for layer in cache.layers]


def assert_same_state(a: list, b: list) -> None:
    assert len(a) == len(b)
    for (meta_a, tensors_a), (meta_b, tensors_b) in zip(a, b, strict=True):
        assert meta_a == meta_b and tensors_a.keys() == tensors_b.keys()
        assert all(torch.equal(tensors_a[k], tensors_b[k]) for k in tensors_a)


@pytest.fixture
def saved(tmp_path: Path) -> Path:
    path = tmp_path / "c.safetensors"
    save_cache(small_cache := small_mixed_cache(), path, metadata={"model": "m"})
    assert_same_state(state_of(load_cache(path)), state_of(small_cache))
    return path


# ------------------------------------------------------------------------------- bit flips
def test_a_flipped_bit_anywhere_is_a_format_error(saved: Path) -> None:
    """Every byte of the file, header and data, with one bit flipped (a different bit per byte;
    all 8 bits of every 7th byte with KVCACHE_SLOW=1, of every 47th otherwise): each is refused by
    the default load."""
    original = saved.read_bytes()
    (header_len,) = struct.unpack("<Q", original[:8])
    assert len(original) - 8 - header_len > 500  # the data region is well covered too
    every = 7 if os.environ.get("KVCACHE_SLOW") == "1" else 47
    flips = [(i, i % 8) for i in range(len(original))] + [(i, b) for i in range(0, len(original), every)
                                                          for b in range(8)]  # fmt: skip
    for position, bit in flips:
        damaged = bytearray(original)
        damaged[position] ^= 1 << bit
        saved.write_bytes(damaged)
        with pytest.raises(CacheFormatError):
            load_cache(saved)
    saved.write_bytes(original)
    load_cache(saved)


def test_data_damage_passes_only_with_verify_false(saved: Path) -> None:
    data = bytearray(saved.read_bytes())
    data[-40] ^= 0x10  # inside the tensor data, before the digest
    saved.write_bytes(data)
    with pytest.raises(CacheFormatError, match=r"digest .* does not match"):
        load_cache(saved)
    load_cache(saved, verify=False)  # the header is intact; the data is taken as it is


def test_truncated_files_are_format_errors(saved: Path) -> None:
    original = saved.read_bytes()
    for size in (0, 7, 8, 100, len(original) // 2, len(original) - 17, len(original) - 1):
        saved.write_bytes(original[:size])
        with pytest.raises(CacheFormatError):
            load_cache(saved)


# ------------------------------------------------------------------ loaded caches own memory
@pytest.mark.parametrize("how", ["copyfile", "truncate", "zero-fill"])
def test_loaded_cache_does_not_change_when_its_file_does(saved: Path, tmp_path: Path, how: str) -> None:
    loaded = load_cache(saved)
    before = state_of(loaded)
    other = tmp_path / "other.safetensors"
    save_cache(Cache([DynamicLayer()]), other)
    if how == "copyfile":
        with open(saved, "r+b") as f:  # in place, as cp and shutil.copyfile do
            f.write(other.read_bytes())
            f.truncate()
    elif how == "truncate":
        os.truncate(saved, 10)
    else:
        size = saved.stat().st_size
        with open(saved, "r+b") as f:
            f.write(b"\0" * size)
    assert_same_state(state_of(loaded), before)
    loaded.update(torch.zeros(1, 2, 1, 4), torch.zeros(1, 2, 1, 4), 0)  # still usable


# ------------------------------------------------------------------------------- keyed MAC
def test_keyed_mac_gives_tamper_evidence(saved: Path, tmp_path: Path) -> None:
    key = b"k" * 32
    path = tmp_path / "keyed.safetensors"
    save_cache(small_mixed_cache(), path, key=key)
    assert_same_state(state_of(load_cache(path, key=key)), state_of(small_mixed_cache()))
    load_cache(path)  # without the key the xxh3 part is still checked
    with pytest.raises(CacheFormatError, match="MAC"):
        load_cache(path, key=b"x" * 32)
    with pytest.raises(CacheFormatError, match="no MAC"):
        load_cache(saved, key=key)  # a file saved without a key proves nothing

    # A forger who edits the data and recomputes the (unkeyed) xxh3 part passes a keyless load,
    # as documented, but not a keyed one.
    data = bytearray(path.read_bytes())
    data[-60] ^= 1
    digest = FileDigest(None)
    digest.update(bytes(data[:-48]))
    data[-48:-32] = digest.digest()
    path.write_bytes(data)
    load_cache(path)
    with pytest.raises(CacheFormatError, match="MAC"):
        load_cache(path, key=key)
    with pytest.raises(CacheFormatError, match="MAC"):  # a key asks for tamper evidence: verify=False keeps it
        load_cache(path, key=key, verify=False)
    for bad in (b"short", "a string key of enough length", 12345):
        with pytest.raises(CacheInputError, match="key"):
            save_cache(small_mixed_cache(), tmp_path / "x.safetensors", key=bad)  # type: ignore[arg-type]
    assert not (tmp_path / "x.safetensors").exists()


# ---------------------------------------------------------------------------- old versions
def test_version_1_files_load_only_unverified(tmp_path: Path) -> None:
    """kvcache 0.1 wrote no file digest: such a file is refused by the default (verified) load with
    a message that says how to accept it, and loads exactly with verify=False."""
    cache = small_mixed_cache()
    description, tensors = describe_cache(cache)
    description_json = json.dumps(description, separators=(",", ":"))
    meta = {"format": "kvcache", "format_version": "1", "cache": description_json, "user": "{}"}
    meta["sha256"] = _digest("1", description_json, "{}", None)
    path = tmp_path / "v1.safetensors"
    save_file({k: v.contiguous() for k, v in tensors.items()}, path, metadata=meta)
    with pytest.raises(CacheFormatError, match="verify=False"):
        load_cache(path)
    assert_same_state(state_of(load_cache(path, verify=False)), state_of(cache))


# ------------------------------------------------------------------ allocation bound
def _static_file(path: Path, max_cache_len: int) -> None:
    """A valid file whose one StaticLayer declares `max_cache_len` (header and digests consistent)."""
    layer = StaticLayer(4)
    layer.update(torch.ones(1, 1, 2, 2), torch.ones(1, 1, 2, 2))
    description, tensors = describe_cache(Cache([layer]))
    description["layers"][0]["meta_state"]["max_cache_len"] = max_cache_len
    digest = FileDigest(None)
    with open(path, "wb") as f:
        write_safetensors(f, tensors, make_header(description, "{}", digest.scheme), digest)


def test_a_small_file_cannot_ask_for_a_huge_allocation(tmp_path: Path) -> None:
    path = tmp_path / "static.safetensors"
    _static_file(path, 10**8)  # 800 MB of keys/values declared in a file of ~1 KB
    assert path.stat().st_size < 2000
    started = time.perf_counter()
    with pytest.raises(CacheFormatError, match="max_alloc_bytes"):
        load_cache(path)
    assert time.perf_counter() - started < 1.0  # refused before allocating
    _static_file(path, 10**5)  # 1.6 MB: past the default bound for this file only if we ask for less
    with pytest.raises(CacheFormatError, match="max_alloc_bytes"):
        load_cache(path, max_alloc_bytes=10**6)
    assert load_cache(path, max_alloc_bytes=2 * 10**6).layers[0].max_cache_len == 10**5
    assert load_cache(path).layers[0].max_cache_len == 10**5  # within the default (64 MiB floor)
    with pytest.raises(CacheInputError, match="max_alloc_bytes"):
        load_cache(path, max_alloc_bytes=-1)


# -------------------------------------------------------------------- killed saves
_KILLED_SAVER = textwrap.dedent(
    """
    import os, signal, sys, torch
    from kvcache import DynamicCache, save_cache
    from kvcache.persistence import writer
    cache = DynamicCache()
    cache.update(torch.randn(1, 4, 4096, 64), torch.randn(1, 4, 4096, 64), 0)
    real_rows = writer._rows
    def rows_then_die(tensor):
        for i, row in enumerate(real_rows(tensor)):
            yield row
        os.kill(os.getpid(), signal.SIGKILL)   # killed in the middle of writing the file
    writer._rows = rows_then_die
    save_cache(cache, sys.argv[1])
    """
)


def test_temporaries_of_killed_saves_are_removed_by_the_next_save(tmp_path: Path, monkeypatch) -> None:
    target = tmp_path / "c.safetensors"
    for _ in range(2):
        proc = subprocess.run([sys.executable, "-c", _KILLED_SAVER, str(target)], timeout=120)
        assert proc.returncode == -signal.SIGKILL
    left = sorted(p.name for p in tmp_path.iterdir())
    assert len(left) == 2 and all(name.endswith(TEMP_SUFFIX) for name in left) and not target.exists()

    # one in progress, by a live process on this host: never touched
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        live = tmp_path / f".c.safetensors.{writer._HOST}.{sleeper.pid}.abc123{TEMP_SUFFIX}"
        live.write_bytes(b"partial")
        unrelated = tmp_path / ".c.safetensors.notours.tmp"
        unrelated.write_bytes(b"x")
        save_cache(Cache([DynamicLayer()]), target)  # too fresh: the dead writers' files stay a minute
        assert len(list(tmp_path.glob(f"*{TEMP_SUFFIX}"))) == 3
        monkeypatch.setattr(writer, "STALE_AFTER_DEAD_S", 0.0)
        save_cache(Cache([DynamicLayer()]), target)
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted([target.name, live.name, unrelated.name])
    finally:
        sleeper.kill()
        sleeper.wait()
    load_cache(target)


def test_save_errors_name_the_users_path(tmp_path: Path) -> None:
    """A failing write reports the path the user gave, not the temporary file's."""
    target = tmp_path / "missing-dir" / "c.safetensors"
    with pytest.raises(OSError) as info:
        save_cache(Cache([DynamicLayer()]), target)
    assert str(target) in str(info.value) and TEMP_SUFFIX not in str(info.value)
    assert DIGEST_TENSOR  # the digest tensor's name is part of the documented format
