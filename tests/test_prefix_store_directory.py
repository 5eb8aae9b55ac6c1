"""`DirectoryBackend`: a prefix store in a directory that survives restarts and is shared by
processes, against what the disk really holds: four processes inserting and reading at once
under a small budget, damaged and planted entries (truncated, flipped, garbage, a FIFO, a huge
header length, bad header JSON), writers SIGKILLed mid-write, a read-only directory, a lower
budget at reopening, and healing a whole path of damaged entries in one run."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path

import pytest
import torch
from store_kit import CHUNK, ROOT, check_workers, chunked_reference, directory_bytes, model, prompt, run_workers

from kvcache import CacheFormatError
from kvcache.generation import generate
from kvcache.store import DirectoryBackend, PrefixStore

pytestmark = pytest.mark.usefixtures("one_thread")


def store_at(path: Path, **kwargs) -> PrefixStore:
    budget = kwargs.pop("max_bytes", 1 << 30)
    return PrefixStore(chunk_size=CHUNK, max_bytes=budget, backend=DirectoryBackend(path, **kwargs))


def entry_file(path: Path, key: bytes) -> Path:
    return path / "entries" / key.hex()[:2] / f"{key.hex()}.kvstore"


def entry_files(path: Path) -> list[Path]:
    return sorted((path / "entries").glob("*/*.kvstore"))


@pytest.mark.parametrize("wide_window", [False, True])
def test_a_store_survives_a_restart_and_hits_exactly(tmp_path: Path, wide_window: bool) -> None:
    m, ids = (model(sliding_window=20) if wide_window else model()), prompt()
    cold = generate(m, ids, max_new_tokens=10, output_scores=True, prefix_store=store_at(tmp_path))
    assert len(entry_files(tmp_path)) == 5  # 4 prompt chunks and the boundary at 40 tokens decoding reached
    restarted = store_at(tmp_path)  # a new process would see the same
    hit = generate(m, ids, max_new_tokens=10, output_scores=True, prefix_store=restarted)
    assert restarted.stats.tokens_reused == 32
    assert hit.sequences.tolist() == cold.sequences.tolist()
    assert all(torch.equal(a, b) for a, b in zip(hit.scores, cold.scores, strict=True))
    assert restarted.nbytes == directory_bytes(tmp_path) == sum(p.stat().st_size for p in entry_files(tmp_path))
    assert len(restarted) == 5 and restarted.backend.summary()["roots"] == 1


def test_four_processes_share_a_small_budget_and_never_get_a_wrong_hit(tmp_path: Path) -> None:
    """Four processes at once, 12 requests each over three shared system prompts, a budget of about
    12 chunks: what the disk holds (entry and temporary files) is sampled all along and never
    exceeds the budget, and every request's tokens and logits equal its chunked recomputation
    without a store (a wrong hit would show)."""
    m = model()
    probe = store_at(tmp_path / "probe")
    probe.prefill(m, prompt(9, 17)[0].tolist())
    budget = probe.nbytes * 10  # the probe holds 2 chunks
    where = tmp_path / "shared"
    # what the disk holds, at moments when no entry is being evicted or reserved
    results, peak = run_workers(str(where), budget, lambda: directory_bytes(where, locked=True))
    check_workers(results)
    assert 0 < peak <= budget
    assert store_at(where, max_bytes=budget).nbytes == directory_bytes(where) <= budget
    assert not list((where / "tmp").iterdir())


def _fifo(path: Path) -> None:
    path.unlink()
    os.mkfifo(path)


def _header_length(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[:8] = (2**63).to_bytes(8, "little")
    path.write_bytes(bytes(data))


def _header_json(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[8:16] = b"{not js!"
    path.write_bytes(bytes(data))


DAMAGE = {
    "truncate": lambda p: p.write_bytes(p.read_bytes()[: p.stat().st_size // 2]),
    "flip": lambda p: p.write_bytes(p.read_bytes()[:-30] + bytes([p.read_bytes()[-30] ^ 0x40]) + p.read_bytes()[-29:]),
    "garbage": lambda p: p.write_bytes(b"not a safetensors file"),
    "fifo": _fifo,
    "header length": _header_length,
    "header json": _header_json,
}


@pytest.mark.parametrize("how", list(DAMAGE))
def test_a_damaged_entry_is_a_miss_dropped_and_counted(tmp_path: Path, how: str) -> None:
    """A damaged third chunk: the lookup stops before it with one warning, the entry is gone from
    disk and from the count, the next run stores it again, and a strict store raises."""
    m, ids = model(), prompt()
    cold = generate(m, ids, max_new_tokens=8, prefix_store=store_at(tmp_path))
    third = entry_file(tmp_path, store_at(tmp_path).chunk_keys(m, ids[0].tolist())[2])
    DAMAGE[how](third)
    store = store_at(tmp_path)
    start = time.monotonic()
    with pytest.warns(UserWarning, match="dropped"):
        matched, _ = store.lookup(ids[0].tolist(), m)
    assert time.monotonic() - start < 10  # a FIFO is never opened for reading
    assert matched == 16 and not third.exists() and not third.is_fifo()
    assert store.nbytes == directory_bytes(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # stored again: no more warnings
        again = generate(m, ids, max_new_tokens=8, prefix_store=store)
    assert again.sequences.tolist() == cold.sequences.tolist() and third.is_file()
    DAMAGE[how](third)
    with pytest.raises(CacheFormatError, match="dropped"):
        store_at(tmp_path, strict=True).lookup(ids[0].tolist(), m)


def test_damaged_entries_are_evictable_and_a_whole_path_heals_in_one_run(tmp_path: Path) -> None:
    """Every entry of a 40-chunk prompt made garbage: one run stores the whole path again (an insert
    replaces a damaged entry, not only a missing one), and garbage is evicted like any entry."""
    m, ids = model(), prompt(3, 40 * CHUNK + 1)
    store_at(tmp_path).prefill(m, ids[0].tolist())
    for path in entry_files(tmp_path):
        path.write_bytes(b"garbage" * 10)
    store = store_at(tmp_path)
    with pytest.warns(UserWarning, match="dropped"):
        reused, _ = store.prefill(m, ids[0].tolist())
    assert reused == 0 and store.lookup(ids[0].tolist(), m)[0] == 40 * CHUNK
    assert store.stats.dropped == 40  # the first by the lookup, 39 on the way
    for path in entry_files(tmp_path):
        path.write_bytes(b"garbage" * 10)
    small = store_at(tmp_path, max_bytes=1)  # reopening with a tiny budget evicts everything, garbage too
    assert small.nbytes == 0 == directory_bytes(tmp_path) and len(small) == 0


_KILLED = textwrap.dedent(
    """
    import os, signal, sys, torch
    sys.path.insert(0, {root!r}); sys.path.insert(0, {tests!r})
    from pathlib import Path
    from store_kit import CHUNK, model, prompt
    from kvcache.store import DirectoryBackend, PrefixStore
    real = Path.write_bytes
    def write_then_die(self, data):
        if self.parent.name == "tmp":
            real(self, data[: len(data) // 2])
            os.kill(os.getpid(), signal.SIGKILL)
        return real(self, data)
    Path.write_bytes = write_then_die
    PrefixStore(chunk_size=CHUNK, backend=DirectoryBackend({path!r})).prefill(model(), prompt(5)[0].tolist())
    """
)


def test_a_writer_killed_mid_write_leaves_counted_bytes_that_the_next_insert_removes(tmp_path: Path) -> None:
    code = _KILLED.format(root=str(ROOT), tests=str(ROOT / "tests"), path=str(tmp_path))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=120)
    assert done.returncode == -signal.SIGKILL
    leftovers = list((tmp_path / "tmp").iterdir())
    assert len(leftovers) == 1 and not entry_files(tmp_path)
    store = store_at(tmp_path)
    assert store.nbytes >= directory_bytes(tmp_path) > 0  # the half-written file was counted before it existed
    store.prefill(model(), prompt(6)[0].tolist())  # another process's insert sweeps the dead writer's row
    assert not list((tmp_path / "tmp").iterdir())
    assert store.nbytes == directory_bytes(tmp_path) and len(store) == 4


_READ_ONLY = textwrap.dedent(
    """
    import sys, warnings, torch
    sys.path.insert(0, {root!r}); sys.path.insert(0, {tests!r})
    from store_kit import CHUNK, model, prompt
    from kvcache.generation import generate
    from kvcache.store import DirectoryBackend, PrefixStore
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        store = PrefixStore(chunk_size=CHUNK, backend=DirectoryBackend({path!r}))
        out = generate(model(), prompt(), max_new_tokens=8, prefix_store=store)
        other = generate(model(), prompt(8), max_new_tokens=8, prefix_store=store)
    print(store.stats.tokens_reused, store.stats.chunks_inserted, len(seen), str(seen[0].message) if seen else "")
    print(out.sequences[0].tolist())
    """
)


def test_a_read_only_directory_serves_hits(tmp_path: Path) -> None:
    """The directory bind-mounted read-only (in a mount namespace of the reader's own): hits still
    come, with one warning that nothing is stored, and no error from `generate`."""
    if shutil.which("unshare") is None or subprocess.run(["unshare", "-m", "true"], capture_output=True).returncode:
        pytest.skip("needs unshare -m (a mount namespace) to mount the store read-only")
    m, ids = model(), prompt()
    cold = generate(m, ids, max_new_tokens=8, prefix_store=store_at(tmp_path))
    code = _READ_ONLY.format(root=str(ROOT), tests=str(ROOT / "tests"), path=str(tmp_path))
    script = tmp_path.parent / "reader.py"
    script.write_text(code)
    shell = f"mount --bind {tmp_path} {tmp_path} && mount -o remount,bind,ro {tmp_path} && {sys.executable} {script}"
    done = subprocess.run(["unshare", "-m", "sh", "-c", shell], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    stats, tokens = done.stdout.strip().splitlines()
    reused, inserted, warned, message = stats.split(" ", 3)
    assert (reused, inserted, warned) == ("32", "0", "1") and "read-only" in message
    assert json.loads(tokens) == cold.sequences[0].tolist()


def test_reopening_with_a_lower_budget_evicts_down_to_it(tmp_path: Path) -> None:
    m = model()
    store = store_at(tmp_path)
    for seed in range(4):
        store.prefill(m, prompt(seed, 25)[0].tolist())
    held = store.nbytes
    lower = store_at(tmp_path, max_bytes=held // 2)
    assert lower.nbytes == directory_bytes(tmp_path) <= held // 2 < held
    last = prompt(3, 25)[0].tolist()  # the most recently used prompt survives
    assert lower.lookup(last, m)[0] == 24


def test_entries_of_the_old_format_are_removed_once(tmp_path: Path) -> None:
    old = tmp_path / ("ab" * 16 + ".kvstore")
    old.write_bytes(b"a kvcache 0.2 entry")
    (tmp_path / "stats.json").write_text("{}")
    with pytest.warns(UserWarning, match="0.2's store format"):
        store = store_at(tmp_path)
    assert not old.exists() and store.nbytes == 0


def test_hits_equal_the_chunked_recomputation_with_a_store_made_elsewhere(tmp_path: Path) -> None:
    """A store filled by another process: a hit's logits equal, bit for bit, the chunked prefill
    computed here without any store."""
    code = textwrap.dedent(f"""
        import sys; sys.path.insert(0, {str(ROOT)!r}); sys.path.insert(0, {str(ROOT / "tests")!r})
        from store_kit import CHUNK, model, prompt
        from kvcache.store import DirectoryBackend, PrefixStore
        store = PrefixStore(chunk_size=CHUNK, backend=DirectoryBackend({str(tmp_path)!r}))
        store.prefill(model(), prompt()[0].tolist())
    """)  # fmt: skip
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=120).returncode == 0
    m, ids = model(), prompt()
    hit = generate(m, ids, max_new_tokens=8, output_scores=True, prefix_store=store_at(tmp_path))
    want = chunked_reference(m, ids, 8)
    assert hit.sequences.tolist() == want.sequences.tolist()
    assert all(torch.equal(a, b) for a, b in zip(hit.scores, want.scores, strict=True))


def test_a_damaged_index_is_a_clear_error_not_a_traceback(tmp_path: Path, capsys) -> None:
    """An `index.sqlite` that is not a database: opening the store is a `KVCacheError` naming the
    index, and `kvcache store` / `kvcache generate --prefix-store` print one line, exit 2."""
    from kvcache import KVCacheError
    from kvcache.cli import main

    store_at(tmp_path).prefill(model(), prompt()[0].tolist())
    # A new file, not the old one rewritten: the first store's connection may live on until the
    # garbage collector meets it, and closing it checkpoints its WAL into the file it has open,
    # which would mend a damaged index written in place.
    for name in ("index.sqlite", "index.sqlite-wal", "index.sqlite-shm"):
        (tmp_path / name).unlink(missing_ok=True)
    (tmp_path / "index.sqlite").write_bytes(b"this is not a database" * 100)
    with pytest.raises(KVCacheError, match=r"index\.sqlite is damaged"):
        store_at(tmp_path)
    for argv in (["store", str(tmp_path)], ["generate", "The value", "--max-new-tokens", "2", "--prefix-store",
                                             str(tmp_path)]):  # fmt: skip
        code = main(argv)
        _, err = capsys.readouterr()
        assert code == 2 and err.count("\n") == 1 and "damaged" in err and "Traceback" not in err, (argv, err)


def test_an_insert_whose_write_and_clean_up_failed_is_swept_at_once(tmp_path: Path, monkeypatch) -> None:
    """The entry's file cannot be written and the transaction that would uncount it fails too: its
    row stays marked as being written by this (live) process. The next insert sweeps it (this
    process knows it writes nothing there), so no bytes stay counted without a file, and the
    entry is stored again."""
    from kvcache.store.backends import StoreUnavailable

    m, tokens = model(), prompt()[0].tolist()
    store = store_at(tmp_path)
    backend = store.backend
    real_write, real_forget = Path.write_bytes, DirectoryBackend._forget
    monkeypatch.setattr(Path, "write_bytes", lambda self, data: (_ for _ in ()).throw(OSError(28, "No space left")))

    def forget_fails(self, db, key, size, parent):
        raise StoreUnavailable("the index is locked")

    monkeypatch.setattr(DirectoryBackend, "_forget", forget_fails)
    with pytest.raises(StoreUnavailable):
        backend.insert(b"k" * 16, None, b"entry bytes", 11, 0, backend.begin(), 1 << 30)
    monkeypatch.setattr(Path, "write_bytes", real_write)
    monkeypatch.setattr(DirectoryBackend, "_forget", real_forget)
    assert backend.nbytes() == 11 and not entry_files(tmp_path)  # counted, no file behind it
    store.prefill(m, tokens)  # another insert sweeps it
    assert backend.nbytes() == directory_bytes(tmp_path) and len(store) == 4
    assert backend.insert(b"k" * 16, None, b"entry bytes", 11, 0, backend.begin(), 1 << 30).outcome == "stored"


def test_a_closed_store_releases_its_index_and_answers_later_calls_as_closed(tmp_path: Path) -> None:
    """`with PrefixStore(...) as store:` closes the index on leaving (its WAL checkpointed and
    removed, as SQLite does when the last connection closes); a later lookup is a miss with a
    warning naming the closed store (a strict backend raises), and nothing is written; a store
    opened there again finds every entry."""
    from kvcache.store import StoreUnavailable

    m, ids = model(), prompt()[0].tolist()
    with store_at(tmp_path) as store:
        store.prefill(m, ids)
        held = len(store)
        assert held > 0 and (tmp_path / "index.sqlite-wal").exists()
    assert not (tmp_path / "index.sqlite-wal").exists()
    with pytest.warns(UserWarning, match="is closed"):
        assert store.lookup(ids, m)[0] == 0
    strict = store_at(tmp_path, strict=True)
    strict.close()
    with pytest.raises(StoreUnavailable, match="is closed"):
        len(strict)
    again = store_at(tmp_path)
    assert len(again) == held
    reused = store_at(tmp_path).prefill(m, ids)[0]  # what a store that was never closed reuses
    assert reused > 0 and again.lookup(ids, m)[0] == reused
    again.close()
