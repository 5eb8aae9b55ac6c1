"""What the prefix-store tests share: the reference hybrid model (recurrent, full, parallel-hybrid
and sliding layers), prompts, the store's own entry bytes made into hostile ones, what a backend
really holds (counted from disk or from Redis, not from the store's counters), and worker
processes that share a store."""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import torch

from kvcache.models import HybridConfig, HybridLM
from kvcache.store import codec
from kvcache.store.backends import Entry
from kvcache.store.payloads import Delta, HybridPayload, Snapshot, WindowDelta

CHUNK = 8
ROOT = Path(__file__).resolve().parent.parent


def model(seed: int = 0, **config: Any) -> HybridLM:
    torch.manual_seed(seed)
    return HybridLM(HybridConfig(**config)).eval()


def prompt(seed: int = 1, length: int = 37) -> torch.Tensor:
    return torch.randint(1, 256, (1, length), generator=torch.Generator().manual_seed(seed))


def chunked_reference(m: Any, ids: torch.Tensor, new: int) -> Any:
    """What a store run computes, without a store: the prompt's whole chunks fed one by one (the
    last token left over), then `generate` on that cache (greedy, with scores)."""
    from kvcache.generation import generate

    tokens = ids[0].tolist()
    limit = (len(tokens) - 1) // CHUNK * CHUNK
    cache = m.new_cache()
    with torch.no_grad():
        for start in range(0, limit, CHUNK):
            m(ids[:, start : start + CHUNK], cache=cache, position_ids=torch.arange(start, start + CHUNK)[None])
    return generate(m, ids, cache=cache, max_new_tokens=new, output_scores=True)


# --------------------------------------------------------------------------- hostile entries
def _map_tensors(payload: Any, fn: Any) -> Any:
    if isinstance(payload, WindowDelta):
        return WindowDelta(fn(payload.keys), fn(payload.values), payload.window)
    if isinstance(payload, Delta):
        return Delta(fn(payload.keys), fn(payload.values))
    if isinstance(payload, HybridPayload):
        return HybridPayload(_map_tensors(payload.attention, fn), _map_tensors(payload.recurrent, fn))
    return Snapshot(payload.cls, payload.meta, {k: fn(v) for k, v in payload.state.items()})


def _first(entry: Entry, kind: type) -> int:
    return next(i for i, p in enumerate(entry.payloads) if type(p) is kind)


def tamper(entry: Entry, how: str) -> Entry:
    """`entry` changed the way a stranger's or another model's entry differs, still well formed."""
    payloads = list(entry.payloads)
    if how == "float64 keys":
        payloads = [_map_tensors(p, lambda t: t.double()) for p in payloads]
    elif how == "twice the kv heads":
        i = _first(entry, Delta)
        payloads[i] = _map_tensors(payloads[i], lambda t: torch.cat([t, t], dim=1))
    elif how == "3 tokens where the chunk has 8":
        i = _first(entry, Delta)
        payloads[i] = _map_tensors(payloads[i], lambda t: t[:, :, :3].clone())
    elif how == "a sliding layer claiming 1000 more tokens":
        i = next(j for j, p in enumerate(payloads) if type(p) is Snapshot and p.cls == "SlidingWindowLayer")
        snap = payloads[i]
        payloads[i] = Snapshot(snap.cls, {**snap.meta, "seq_length": snap.meta["seq_length"] + 1000}, snap.state)
    elif how == "a StaticLayer of 10**12 tokens":
        i = next(j for j, p in enumerate(payloads) if type(p) is Snapshot and p.cls == "SlidingWindowLayer")
        snap = payloads[i]
        payloads[i] = Snapshot("StaticLayer", {"max_cache_len": 10**12, "seq_length": snap.meta["kept_length"],
                                               "record_past": False}, snap.state)  # fmt: skip
    elif how == "layer kinds swapped":
        payloads[0], payloads[1] = payloads[1], payloads[0]
    elif how == "a layer missing":
        payloads = payloads[:-1]
    else:
        raise ValueError(how)
    return Entry(entry.parent, payloads, sum(p.nbytes for p in payloads))


HOSTILE = ["float64 keys", "twice the kv heads", "3 tokens where the chunk has 8",
           "a sliding layer claiming 1000 more tokens", "a StaticLayer of 10**12 tokens", "layer kinds swapped",
           "a layer missing"]  # fmt: skip


def hostile_bytes(key: bytes, data: bytes, how: str, mac_key: bytes | None = None) -> bytes:
    """A well-formed entry with a valid digest (anyone can compute it) that does not fit the model."""
    return codec.encode(key, tamper(codec.decode(key, data, mac_key), how), mac_key)


# ------------------------------------------------------------------------- what is held
def directory_bytes(path: Path, *, locked: bool = False) -> int:
    """Every byte under a directory store's entry and temporary folders, from the disk. `locked`:
    walk them while holding the index's write lock, so no entry comes or goes during the walk (a
    walk alongside writers could count a file twice or miss one; it would not show what the disk
    held at any one moment)."""

    def walk() -> int:
        total = 0
        for folder in ("entries", "tmp"):
            for p in (path / folder).rglob("*"):
                with contextlib.suppress(FileNotFoundError):
                    total += p.stat().st_size if p.is_file() else 0
        return total

    if not locked:
        return walk()
    db = sqlite3.connect(f"file:{path / 'index.sqlite'}?mode=rw", uri=True, timeout=30, isolation_level=None)
    try:
        db.execute("BEGIN IMMEDIATE")
        try:
            return walk()
        finally:
            db.execute("ROLLBACK")
    finally:
        db.close()


HELD_SCRIPT = """
local total, cursor = 0, '0'
repeat
  local page = redis.call('SCAN', cursor, 'MATCH', ARGV[1], 'COUNT', 1000)
  cursor = page[1]
  for _, name in ipairs(page[2]) do total = total + redis.call('STRLEN', name) end
until cursor == '0'
return total
"""


def redis_bytes(node: Any, prefix: str = "kvcache") -> int:
    """Bytes of every entry value a Redis server (the node holding the store's slot) holds, summed
    atomically by one script."""
    out = node.cli("EVAL", HELD_SCRIPT, "0", f"{{{prefix}}}:e:*")
    return int(out.strip() or 0)


# ------------------------------------------------------------------------------ workers
WORKER = textwrap.dedent(
    """
    import json, sys, warnings, torch
    sys.path.insert(0, {root!r}); sys.path.insert(0, {tests!r})
    from store_kit import CHUNK, chunked_reference, model, prompt
    from kvcache.generation import generate
    from kvcache.store import open_store
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    m = model()
    store = open_store({where!r}, chunk_size=CHUNK, max_bytes={budget})
    wrong = 0
    for i in range({count}):
        shared = prompt(100 + i % 3, 24)  # three system prompts every worker shares
        own = prompt({seed} * 1000 + i, 8 + i % 11)
        ids = torch.cat([shared, own], dim=1)
        got = generate(m, ids, max_new_tokens=6, output_scores=True, prefix_store=store)
        want = chunked_reference(m, ids, 6)
        same = got.sequences.tolist() == want.sequences.tolist() and all(
            torch.equal(a, b) for a, b in zip(got.scores, want.scores, strict=True))
        wrong += not same
    print(json.dumps({{"wrong": wrong, "hits": store.stats.hits, "inserted": store.stats.chunks_inserted,
                      "evicted": store.stats.evictions, "unavailable": store.stats.unavailable,
                      "refused": store.stats.refused}}))
    """
)


#: Requests per worker process: 8 by default, 24 with KVCACHE_SLOW=1 (a longer soak).
WORKER_REQUESTS = 24 if os.environ.get("KVCACHE_SLOW") == "1" else 8


def run_workers(where: str, budget: int, held: Any, count: int = WORKER_REQUESTS) -> tuple[list[dict[str, int]], int]:
    """Four workers (`WORKER`) at once on the store at `where`, while `held()` (what the backend
    really holds, in bytes) is sampled every 5 ms; their results and the peak of `held()`. Fails
    when a worker fails."""
    peak, stop = [0], threading.Event()

    def watch() -> None:
        while not stop.is_set():
            with contextlib.suppress(FileNotFoundError, sqlite3.OperationalError):
                peak[0] = max(peak[0], held())
            time.sleep(0.005)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        procs = start_workers(where, budget, count)
        outs = [p.communicate(timeout=300) for p in procs]
    finally:
        stop.set()
        watcher.join()
    assert all(p.returncode == 0 for p in procs), [err[-2000:] for _, err in outs]
    return [json.loads(out.strip().splitlines()[-1]) for out, _ in outs], peak[0]


def check_workers(results: list[dict[str, int]]) -> None:
    """No wrong hit and no backend failure in any worker; hits and evictions happened."""
    assert [r["wrong"] for r in results] == [0] * len(results), results
    assert [r["unavailable"] for r in results] == [0] * len(results), results
    assert sum(r["hits"] for r in results) > 0 and sum(r["evicted"] for r in results) > 0, results


def start_workers(where: str, budget: int, count: int, n: int = 4) -> list[subprocess.Popen[str]]:
    """`n` processes, each running `count` requests against the store at `where`."""
    procs = []
    for seed in range(n):
        code = WORKER.format(root=str(ROOT), tests=str(ROOT / "tests"), where=where, budget=budget, count=count,
                             seed=seed + 1)  # fmt: skip
        procs.append(subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True))  # fmt: skip
    return procs
