"""Save/load throughput of `save_cache`/`load_cache` against plain safetensors (and torch.save).

A `DynamicCache` of 24 layers with `[1, 8, N, 128]` fp32 keys and values (~0.5 GiB; `--quick`:
~64 MiB) grown the way prefill grows it (live views inside larger storage). The baselines get the
same tensors, already contiguous (their best case): `safetensors.torch.save_file`/`load_file` and
`torch.save`/`torch.load`. `save_cache` flushes the file to disk (fsync) before its atomic rename
by default, compared with the disk's own limit (the same bytes written raw and fsynced, what
`dd conv=fsync` measures); `save_cache(fsync=False)` with plain `save_file`. A kvcache load reads
every byte into memory the cache owns (so it never changes with its file): it is measured verified
(the default, xxh3 over the whole file) and with `verify=False`, against `load_file(path,
backend="pread")`, which also reads into memory it owns, each followed by reading every byte of
what it returned; safetensors' default memory-mapped load is shown beside it. Medians of
`--repeats` runs, round-robin, ratios from the same run; the files go to a temporary directory
(`--dir`) and are deleted.

Method, so that one contender's disk traffic does not land on another's clock: every save writes a
fresh file; before each save (untimed) `os.sync()` writes back what earlier samples left dirty.
Before each load, memory freed by earlier samples goes back to the OS (`malloc_trim`), so every
loader writes into fresh pages (their faults cost as much as the copy here). Loads are reported
warm (the file in the page cache) and cold (the file dropped from the page cache with
`posix_fadvise(DONTNEED)` before each sample, where available).

    python benchmarks/persistence.py [--quick] [--repeats 5] [--dir /tmp]
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import ctypes.util
import gc
import os
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from kvcache import DynamicCache, load_cache, save_cache

try:
    from .common import Timing, rotate_timings, timed_after
except ImportError:  # run as a script: python benchmarks/persistence.py
    from common import Timing, rotate_timings, timed_after  # type: ignore[no-redef]

LAYERS, HEADS, HEAD_DIM = 24, 8, 128
#: Targets, as multiples of each row's baseline: a flushed save of the disk's own limit, a save
#: without fsync of safetensors' save_file, a verified and an unverified load of safetensors'
#: load_file(backend="pread") (each load followed by reading every byte it returned).
SAVE_FSYNC_WITHIN, SAVE_WITHIN, LOAD_WITHIN, LOAD_UNVERIFIED_WITHIN = 1.2, 1.3, 1.3, 1.1


@dataclass(frozen=True)
class Row:
    """One operation: our timing, the baseline its target is a multiple of, and two more for context
    (safetensors' save with fsync or its memory-mapped load; torch's)."""

    name: str
    ours: Timing
    baseline: Timing
    baseline_name: str
    within: float
    other: Timing | None
    torch: Timing | None


def build_cache(tokens: int, layers: int = LAYERS) -> DynamicCache:
    """A DynamicCache of `layers` x [1, HEADS, tokens, HEAD_DIM] fp32 keys/values, prefilled in one update."""
    cache = DynamicCache()
    gen = torch.Generator().manual_seed(0)
    for idx in range(layers):
        keys = torch.randn(1, HEADS, tokens, HEAD_DIM, generator=gen)
        cache.update(keys, keys * 0.5, idx)
    return cache


def release_free_memory() -> None:
    """Hand memory freed by earlier samples back to the OS (glibc's `malloc_trim`), so that every
    load writes into fresh pages: which contender happens to reuse another's freed (already
    faulted) memory otherwise decides the ratios more than the loaders do."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)


def read_all(tensors: Any) -> float:
    """Touch every byte (so a lazy, memory-mapped load pays for its reads)."""
    return float(sum(t.sum() for t in tensors))


def cache_tensors(cache: Any) -> list[torch.Tensor]:
    """The tensors a cache holds, as its layers hand them out."""
    return [tensor for layer in cache.layers for tensor in layer.state.values()]


def measure(size_mib: int, repeats: int, directory: str | None = None) -> dict[str, Any]:
    """Save/load timings of a ~`size_mib` MiB cache: ours, safetensors' and torch's, round-robin
    (`rotate`) so that drift in machine load hits all alike; checks the loaded tensors are equal."""
    tokens = size_mib * 2**20 // (LAYERS * 2 * HEADS * HEAD_DIM * 4)
    cache = build_cache(tokens)
    plain = {f"t{i}": t.contiguous() for i, t in enumerate(cache_tensors(cache))}

    with tempfile.TemporaryDirectory(dir=directory) as tmp:
        ours, theirs, torch_path = Path(tmp) / "cache.safetensors", Path(tmp) / "plain.safetensors", Path(tmp) / "t.pt"
        raw = bytes(sum(t.nbytes for t in plain.values()))

        def fresh(path: Path) -> Callable[[], Path]:
            """Untimed: remove `path` (every save makes a new file) and write back whatever earlier
            samples left dirty: a few unflushed 0.5 GiB saves reach the kernel's dirty-page limit,
            after which a save waits for the writeback of the ones before it."""

            def setup() -> Path:
                path.unlink(missing_ok=True)
                os.sync()
                return path

            return setup

        def fsynced(write: Callable[[Path], Any]) -> Callable[[Path], None]:
            def run(path: Path) -> None:
                write(path)
                fd = os.open(path, os.O_RDONLY)
                os.fsync(fd)
                os.close(fd)

            return run

        def write_raw(path: Path) -> None:
            with open(path, "wb") as f:
                f.write(raw)

        save = rotate_timings(
            {
                "ours": timed_after(fresh(ours), lambda p: save_cache(cache, p)),
                "theirs": timed_after(fresh(theirs), fsynced(lambda p: save_file(plain, p))),
                "raw": timed_after(fresh(Path(tmp) / "raw.bin"), fsynced(write_raw)),
                "ours_nosync": timed_after(fresh(ours), lambda p: save_cache(cache, p, fsync=False)),
                "theirs_nosync": timed_after(fresh(theirs), lambda p: save_file(plain, p)),
                "torch": timed_after(fresh(torch_path), lambda p: torch.save(plain, p)),
            },
            repeats,
            warmup=1,
        )
        save_cache(cache, ours)
        save_file(plain, theirs)
        torch.save(plain, torch_path)
        os.sync()

        def warm(path: Path) -> Callable[[], Path]:
            def setup() -> Path:
                release_free_memory()
                return path

            return setup

        def cold(path: Path) -> Callable[[], Path]:
            def setup() -> Path:
                release_free_memory()
                if hasattr(os, "posix_fadvise"):
                    fd = os.open(path, os.O_RDONLY)
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                    os.close(fd)
                return path

            return setup

        loads: dict[str, Callable[[Path], Any]] = {
            "ours": lambda p: read_all(cache_tensors(load_cache(p))),
            "ours_unverified": lambda p: read_all(cache_tensors(load_cache(p, verify=False))),
            "theirs": lambda p: read_all(load_file(p, backend="pread").values()),
            "theirs_mmap": lambda p: read_all(load_file(p).values()),
            "torch": lambda p: read_all(torch.load(p, weights_only=True).values()),
        }
        paths = {"ours": ours, "ours_unverified": ours, "theirs": theirs, "theirs_mmap": theirs, "torch": torch_path}
        samplers = {}
        for how, prepare in (("warm", warm), ("cold", cold)):
            for name, load in loads.items():
                samplers[f"{name}_{how}"] = timed_after(prepare(paths[name]), load)
        loaded_t = rotate_timings(samplers, repeats, warmup=1)
        loaded = load_cache(ours)
        assert all(torch.equal(a, b) for a, b in zip(cache_tensors(loaded), plain.values(), strict=True))
        file_sizes = (ours.stat().st_size, theirs.stat().st_size)

    rows = [
        Row("save, flushed to disk (fsync)", save["ours"], save["raw"], "raw write + fsync", SAVE_FSYNC_WITHIN,
            save["theirs"], None),
        Row("save, no fsync", save["ours_nosync"], save["theirs_nosync"], "safetensors save_file", SAVE_WITHIN,
            None, save["torch"]),
    ]  # fmt: skip
    for how in ("warm", "cold"):
        pread, mmap, torch_t = loaded_t[f"theirs_{how}"], loaded_t[f"theirs_mmap_{how}"], loaded_t[f"torch_{how}"]
        rows += [
            Row(f"load {how}, verified (default) + read every byte", loaded_t[f"ours_{how}"], pread,
                "safetensors load_file(pread)", LOAD_WITHIN, mmap, torch_t),
            Row(f"load {how}, verify=False + read every byte", loaded_t[f"ours_unverified_{how}"], pread,
                "safetensors load_file(pread)", LOAD_UNVERIFIED_WITHIN, mmap, torch_t),
        ]  # fmt: skip
    return {
        "tokens": tokens,
        "bytes": sum(t.nbytes for t in plain.values()),
        "file_sizes": file_sizes,
        "rows": rows,
        "disk_limit": save["raw"],
        "cold_reads": hasattr(os, "posix_fadvise"),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="~64 MiB instead of ~0.5 GiB")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dir", default=None, help="where to write the temporary files")
    args = parser.parse_args(argv)

    result = measure(64 if args.quick else 512, args.repeats, args.dir)
    gib, (ours_size, theirs_size) = result["bytes"] / 2**30, result["file_sizes"]
    print(
        f"### Persistence: {LAYERS} layers x [1, {HEADS}, {result['tokens']}, {HEAD_DIM}] fp32 keys+values = "
        f"{gib:.3f} GiB"
    )
    print(f"(medians of {args.repeats}; files {ours_size:,d} B (kvcache) vs {theirs_size:,d} B (safetensors); "
          f"torch {torch.__version__}, {os.cpu_count()} CPU(s), page cache warm)\n")
    print("| operation | kvcache s | baseline | baseline s | kvcache / baseline | target | torch s | kvcache GiB/s |")
    print("| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: |")
    for row in result["rows"]:
        torch_cell = "" if row.torch is None else f"{row.torch.median:.4f}"
        ours_s, base_s = row.ours.median, row.baseline.median
        print(
            f"| {row.name} | {ours_s:.4f} | {row.baseline_name} | {base_s:.4f} | {ours_s / base_s:.2f}x | "
            f"<= {row.within}x | {torch_cell} | {gib / ours_s:.2f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
