"""Save/load throughput of `save_cache`/`load_cache` against plain safetensors (and torch.save).

A `DynamicCache` of 24 layers with `[1, 8, N, 128]` fp32 keys and values (~0.5 GiB; `--quick`:
~64 MiB) grown the way prefill grows it (live views inside larger storage). The baselines get the
same tensors, already contiguous (their best case): `safetensors.torch.save_file`/`load_file` and
`torch.save`/`torch.load`. `save_cache` flushes the file to disk (fsync) before its atomic rename
by default, compared with `save_file` + fsync; `save_cache(fsync=False)` with plain `save_file`.
A kvcache load reads every byte into memory the cache owns (so it never changes with its file):
it is measured verified (the default, xxh3 over the whole file) and with `verify=False`, against
`load_file` plus reading every byte of what it maps, the same work for safetensors. Medians of
`--repeats` runs, round-robin, ratios from the same run; the files go to a
temporary directory (`--dir`) and are deleted.

Method, so that one contender's disk traffic does not land on another's clock: every save writes a
fresh file; before each flushed save (untimed) `os.sync()` writes back what earlier samples left
dirty; the disk's own limit is in the same table (the same bytes written raw and fsynced, what
`dd conv=fsync` measures). Loads are reported warm (the file in the page cache) and cold (the file
dropped from the page cache with `posix_fadvise(DONTNEED)` before each sample, where available).

    python benchmarks/persistence.py [--quick] [--repeats 5] [--dir /tmp]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from kvcache import DynamicCache, load_cache, save_cache
from kvcache.persistence.composite import describe_cache

try:
    from .common import rotate_timings, timed_after
except ImportError:  # run as a script: python benchmarks/persistence.py
    from common import rotate_timings, timed_after  # type: ignore[no-redef]

LAYERS, HEADS, HEAD_DIM = 24, 8, 128


def build_cache(tokens: int, layers: int = LAYERS) -> DynamicCache:
    """A DynamicCache of `layers` x [1, HEADS, tokens, HEAD_DIM] fp32 keys/values, prefilled in one update."""
    cache = DynamicCache()
    gen = torch.Generator().manual_seed(0)
    for idx in range(layers):
        keys = torch.randn(1, HEADS, tokens, HEAD_DIM, generator=gen)
        cache.update(keys, keys * 0.5, idx)
    return cache


def read_all(tensors: Any) -> float:
    """Touch every byte (so a lazy, memory-mapped load pays for its reads)."""
    return float(sum(t.sum() for t in tensors))


def cache_tensors(cache: Any) -> list[torch.Tensor]:
    return list(describe_cache(cache)[1].values())


def measure(size_mib: int, repeats: int, directory: str | None = None) -> dict[str, Any]:
    """Save/load timings of a ~`size_mib` MiB cache: ours, safetensors' and torch's, round-robin
    (`rotate`) so that drift in machine load hits all alike; checks the loaded tensors are equal."""
    tokens = size_mib * 2**20 // (LAYERS * 2 * HEADS * HEAD_DIM * 4)
    cache = build_cache(tokens)
    plain = {name: t.contiguous() for name, t in describe_cache(cache)[1].items()}

    with tempfile.TemporaryDirectory(dir=directory) as tmp:
        ours, theirs, torch_path = Path(tmp) / "cache.safetensors", Path(tmp) / "plain.safetensors", Path(tmp) / "t.pt"
        raw = bytes(sum(t.nbytes for t in plain.values()))

        def fresh(path: Path, sync: bool) -> Callable[[], Path]:
            """Untimed: remove `path` (every save makes a new file) and, before a flushed save,
            write back whatever earlier samples left dirty."""

            def setup() -> Path:
                path.unlink(missing_ok=True)
                if sync:
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
                "ours": timed_after(fresh(ours, True), lambda p: save_cache(cache, p)),
                "theirs": timed_after(fresh(theirs, True), fsynced(lambda p: save_file(plain, p))),
                "raw": timed_after(fresh(Path(tmp) / "raw.bin", True), fsynced(write_raw)),
                "ours_nosync": timed_after(fresh(ours, False), lambda p: save_cache(cache, p, fsync=False)),
                "theirs_nosync": timed_after(fresh(theirs, False), lambda p: save_file(plain, p)),
                "torch": timed_after(fresh(torch_path, False), lambda p: torch.save(plain, p)),
            },
            repeats,
            warmup=1,
        )
        save_cache(cache, ours)
        save_file(plain, theirs)
        torch.save(plain, torch_path)
        os.sync()

        def warm(path: Path) -> Callable[[], Path]:
            return lambda: path

        def cold(path: Path) -> Callable[[], Path]:
            def setup() -> Path:
                if hasattr(os, "posix_fadvise"):
                    fd = os.open(path, os.O_RDONLY)
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                    os.close(fd)
                return path

            return setup

        loads: dict[str, Callable[[Path], Any]] = {
            "ours": lambda p: read_all(cache_tensors(load_cache(p))),
            "ours_unverified": lambda p: read_all(cache_tensors(load_cache(p, verify=False))),
            "theirs": lambda p: read_all(load_file(p).values()),
            "torch": lambda p: read_all(torch.load(p, weights_only=True).values()),
        }
        paths = {"ours": ours, "ours_unverified": ours, "theirs": theirs, "torch": torch_path}
        samplers = {}
        for how, prepare in (("warm", warm), ("cold", cold)):
            for name, load in loads.items():
                samplers[f"{name}_{how}"] = timed_after(prepare(paths[name]), load)
        loaded_t = rotate_timings(samplers, repeats, warmup=1)
        loaded = load_cache(ours)
        assert all(torch.equal(a, b) for a, b in zip(cache_tensors(loaded), plain.values(), strict=True))
        file_sizes = (ours.stat().st_size, theirs.stat().st_size)

    rows = [
        ("save, flushed to disk (fsync)", save["ours"], save["theirs"], None),
        ("save, no fsync", save["ours_nosync"], save["theirs_nosync"], save["torch"]),
    ]
    for how in ("warm", "cold"):
        rows += [
            (f"load {how}, verified (default) + read every byte", loaded_t[f"ours_{how}"], loaded_t[f"theirs_{how}"],
             loaded_t[f"torch_{how}"]),
            (f"load {how}, verify=False + read every byte", loaded_t[f"ours_unverified_{how}"],
             loaded_t[f"theirs_{how}"], loaded_t[f"torch_{how}"]),
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
    print(f"The disk's limit: the same bytes written raw and fsynced in {result['disk_limit'].median:.4f} s.\n")
    print("| operation | kvcache s | safetensors s | kvcache / safetensors | torch s | kvcache GiB/s |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for name, ours_t, theirs_t, torch_t in result["rows"]:
        torch_cell = "" if torch_t is None else f"{torch_t.median:.4f}"
        ours_s, theirs_s = ours_t.median, theirs_t.median
        print(
            f"| {name} | {ours_s:.4f} | {theirs_s:.4f} | {ours_s / theirs_s:.2f}x | {torch_cell} | {gib / ours_s:.2f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
