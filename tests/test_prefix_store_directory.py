"""`DirectoryBackend`: a prefix store that survives restarts and is shared by processes, with
damaged entries (truncated, flipped bits, a killed writer's leftovers) read as clean misses."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch

from kvcache import CacheFormatError
from kvcache.generation import generate
from kvcache.models import HybridConfig, HybridLM
from kvcache.store import DirectoryBackend, PrefixStore

pytestmark = pytest.mark.usefixtures("one_thread")
CHUNK = 8
ROOT = Path(__file__).resolve().parent.parent


def model() -> HybridLM:
    torch.manual_seed(0)
    return HybridLM(HybridConfig()).eval()


def prompt(seed: int = 1, length: int = 37) -> torch.Tensor:
    return torch.randint(1, 256, (1, length), generator=torch.Generator().manual_seed(seed))


def store_at(path: Path, **kwargs) -> PrefixStore:
    return PrefixStore(chunk_size=CHUNK, backend=DirectoryBackend(path, **kwargs))


@pytest.mark.parametrize("wide_window", [False, True])
def test_a_store_survives_a_restart_and_hits_exactly(tmp_path: Path, wide_window: bool) -> None:
    m, ids = model(), prompt()
    if wide_window:  # a sliding window wider than a chunk is stored as per-chunk deltas
        torch.manual_seed(0)
        m = HybridLM(HybridConfig(sliding_window=20)).eval()
    cold = generate(m, ids, max_new_tokens=10, output_scores=True, prefix_store=store_at(tmp_path))
    assert len(list(tmp_path.glob("*.kvstore"))) == 4
    restarted = store_at(tmp_path)  # a new process would see the same
    hit = generate(m, ids, max_new_tokens=10, output_scores=True, prefix_store=restarted)
    assert restarted.stats.tokens_reused == 32
    assert hit.sequences.tolist() == cold.sequences.tolist()
    assert all(torch.equal(a, b) for a, b in zip(hit.scores, cold.scores, strict=True))
    assert restarted.nbytes == sum(p.stat().st_size for p in tmp_path.glob("*.kvstore"))


_WRITER = textwrap.dedent(
    """
    import sys, torch
    sys.path.insert(0, {root!r})
    from kvcache.models import HybridConfig, HybridLM
    from kvcache.store import DirectoryBackend, PrefixStore
    torch.manual_seed(0)
    model = HybridLM(HybridConfig()).eval()
    ids = torch.randint(1, 256, (1, 37), generator=torch.Generator().manual_seed(1))[0].tolist()
    store = PrefixStore(chunk_size={chunk}, backend=DirectoryBackend({path!r}))
    store.prefill(model, ids)
    print(store.stats.chunks_inserted, store.stats.tokens_reused)
    """
)


def _writer(path: Path) -> subprocess.Popen[str]:
    code = _WRITER.format(root=str(ROOT), chunk=CHUNK, path=str(path))
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_two_processes_share_one_directory(tmp_path: Path) -> None:
    """Two writers at once insert the same prefix: one valid file per chunk, and a third party hits it."""
    procs = [_writer(tmp_path), _writer(tmp_path)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err for _, err in outs]
    assert len(list(tmp_path.glob("*.kvstore"))) == 4 and not list(tmp_path.glob(".*.tmp"))
    m, ids = model(), prompt()
    store = store_at(tmp_path)
    matched, cache = store.lookup(ids[0].tolist(), m)
    assert matched == 32
    reference = store_at(tmp_path / "fresh")
    reference.prefill(m, ids[0].tolist())
    want = reference.lookup(ids[0].tolist(), m)[1]
    for a, b in zip(cache, want, strict=True):
        assert all(torch.equal(a.state[k], b.state[k]) for k in a.state)


def _damage(path: Path, how: str) -> None:
    data = bytearray(path.read_bytes())
    if how == "truncate":
        path.write_bytes(bytes(data[: len(data) // 2]))
    elif how == "flip":
        data[-10] ^= 0x40  # inside the tensor data: only the digest notices
        path.write_bytes(bytes(data))
    else:
        path.write_bytes(b"not a safetensors file")


@pytest.mark.parametrize("how", ["truncate", "flip", "garbage"])
def test_a_damaged_entry_is_a_miss_and_is_dropped(tmp_path: Path, how: str) -> None:
    m, ids = model(), prompt()
    cold = generate(m, ids, max_new_tokens=8, prefix_store=store_at(tmp_path))
    files = sorted(tmp_path.glob("*.kvstore"), key=lambda p: p.stat().st_mtime)
    chain = PrefixStore(chunk_size=CHUNK)._keys(ids[0].tolist(), store_at(tmp_path).fingerprint(m, m.new_cache()))
    third = tmp_path / (chain[2].hex() + ".kvstore")
    assert third in files
    _damage(third, how)
    store = store_at(tmp_path)
    with pytest.warns(UserWarning, match="dropped"):
        matched, _ = store.lookup(ids[0].tolist(), m)
    assert matched == 16 and not third.exists()  # the chunks before it still hit
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # re-inserted: no more warnings
        again = generate(m, ids, max_new_tokens=8, prefix_store=store)
    assert again.sequences.tolist() == cold.sequences.tolist() and third.exists()
    _damage(third, how)
    with pytest.raises(CacheFormatError, match="dropped"):
        store_at(tmp_path, strict=True).lookup(ids[0].tolist(), m)
    assert not third.exists()


def test_a_killed_writers_leftovers_load_nothing_wrong(tmp_path: Path) -> None:
    m, ids = model(), prompt()
    store_at(tmp_path).prefill(m, ids[0].tolist())
    (tmp_path / ".deadbeef.12345.abcd.tmp").write_bytes(b"half an entry")  # a writer killed before its rename
    store = store_at(tmp_path)
    assert store.lookup(ids[0].tolist(), m)[0] == 32
    assert len(store) == 4  # temporaries are not entries


def test_the_directory_budget_counts_file_bytes(tmp_path: Path) -> None:
    m = model()
    probe = store_at(tmp_path / "probe")
    probe.prefill(m, prompt(9, 17)[0].tolist())
    budget = int(probe.nbytes * 2.5)  # room for about 5 chunk files
    store = PrefixStore(chunk_size=CHUNK, max_bytes=budget, backend=DirectoryBackend(tmp_path / "s"))
    for seed in range(6):
        store.prefill(m, prompt(seed, 25)[0].tolist())
        on_disk = sum(p.stat().st_size for p in (tmp_path / "s").glob("*.kvstore"))
        assert on_disk == store.nbytes <= budget
    assert store.stats.evictions > 0
