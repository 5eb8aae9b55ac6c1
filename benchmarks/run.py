"""The benchmark suite's entry point: every scenario, kvcache next to what one would use instead.

    python -m benchmarks --quick          # about 90 s on 2 cores: smaller sizes, fewer scenarios
    python -m benchmarks                  # full run
    python -m benchmarks --only rollback memory --out /tmp/bench

Prints Markdown (one section per scenario, then the targets) to stdout, and writes the raw figures
to OUT/results.json and, when matplotlib is installed (the `bench` extra), PNG plots to OUT
(default: benchmarks/results/). Run it from the repository root.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from benchmarks.common import Section

DEFAULT_OUT = Path(__file__).resolve().parent / "results"
#: Scenarios a quick run leaves out (the full run and `--only` run them): kvcache serve against
#: `transformers serve` starts servers and takes about two minutes; startup times subprocesses;
#: suffix drafting runs a sequence of requests three times over; predicted outputs start a server.
FULL_ONLY = ("serve_anchor", "startup", "suffix", "prediction")


def scenarios() -> dict[str, Callable[[str], Section]]:
    """The registry: scenario name -> function(mode) returning its `Section`, in the issue's order."""
    from benchmarks.batch_speculation import batch_speculation_scenario
    from benchmarks.first_step import first_step_scenario
    from benchmarks.per_call import per_call_scenario
    from benchmarks.prediction import prediction_scenario
    from benchmarks.prefill import prefill_scenario
    from benchmarks.prefix_store import prefix_store_scenario
    from benchmarks.quantized import quantized_scenario
    from benchmarks.scenarios_io import generation_scenario, persistence_scenario
    from benchmarks.scenarios_layers import append_scenario, memory_scenario, rollback_scenario
    from benchmarks.serve import serve_scenario
    from benchmarks.serve_anchor import serve_anchor_scenario
    from benchmarks.startup import startup_scenario
    from benchmarks.stateful_speculation import speculation_scenario
    from benchmarks.suffix import suffix_scenario

    return {
        "append": append_scenario,
        "rollback": rollback_scenario,
        "memory": memory_scenario,
        "persistence": persistence_scenario,
        "generation": generation_scenario,
        "first_step": first_step_scenario,
        "speculation": speculation_scenario,
        "per_call": per_call_scenario,
        "prefix_store": prefix_store_scenario,
        "batch_speculation": batch_speculation_scenario,
        "startup": startup_scenario,
        "serve": serve_scenario,
        "quantized": quantized_scenario,
        "prefill": prefill_scenario,
        "serve_anchor": serve_anchor_scenario,
        "suffix": suffix_scenario,
        "prediction": prediction_scenario,
    }


def machine(mode: str, threads: int) -> dict[str, object]:
    from benchmarks.kinds import transformers_version

    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "mode": mode,
        "cpus": os.cpu_count(),
        "torch_threads": threads,
        "processor": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers_version(),
        "load_average_at_start": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
    }


def main(argv: list[str] | None = None) -> int:
    from benchmarks.common import MODES, targets_table, write_json, write_plots

    registry = scenarios()
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.split("\n\n")[0])
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_const", dest="mode", const="quick",
                      help="about 90 s on 2 cores: smaller sizes, no " + ", ".join(FULL_ONLY))  # fmt: skip
    size.add_argument("--full", action="store_const", dest="mode", const="full", help="the full run (default)")
    size.add_argument("--smoke", action="store_const", dest="mode", const="smoke", help="tiny sizes, for tests")
    parser.add_argument("--only", nargs="+", choices=list(registry), help="run only these scenarios")
    parser.add_argument(
        "--out", type=Path, default=DEFAULT_OUT, help=f"where results.json and plots go ({DEFAULT_OUT})"
    )
    parser.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1: steadier timings)")
    args = parser.parse_args(argv)
    mode = args.mode or "full"
    assert mode in MODES
    torch.set_num_threads(args.threads)

    meta = machine(mode, args.threads)
    print(f"# kvcache benchmarks ({mode} run)\n")
    print(
        f"{meta['date']}; {meta['cpus']} CPU(s) ({meta['processor']}), {args.threads} torch thread(s), "
        f"Python {meta['python']}, torch {meta['torch']}, transformers {meta['transformers'] or 'not installed'}; "
        f"load average {meta['load_average_at_start']:.1f} at start.\n"
    )
    sections: list[Section] = []
    walls: dict[str, float] = {}
    with torch.no_grad():
        chosen = args.only or [n for n in registry if mode != "quick" or n not in FULL_ONLY]
        if set(registry) - set(chosen) and not args.only:
            print(f"(left to the full run: {', '.join(n for n in registry if n not in chosen)})\n")
        for name in chosen:
            start = time.perf_counter()
            section = registry[name](mode)
            walls[name] = time.perf_counter() - start
            sections.append(section)
            print(section.markdown(), flush=True)
    meta["wall_seconds"] = walls
    print("## Targets\n")
    print(targets_table(sections).markdown())
    missed = [(s.name, t) for s in sections for t in s.targets if not t.met]
    print("\n" + (f"{len(missed)} target(s) missed; see the notes column." if missed else "Every target met.") + "\n")

    write_json(args.out / "results.json", meta, sections)
    plots = [] if args.no_plots else write_plots(args.out, sections)
    where = f"Raw figures: {args.out / 'results.json'}"
    if not args.no_plots:
        where += f"; {len(plots)} plot(s) in {args.out}" if plots else "; no plots (matplotlib not installed)"
    print(f"{where}. Wall time per scenario: " + ", ".join(f"{k} {v:.0f} s" for k, v in walls.items()) + ".")
    return 0


if __name__ == "__main__":  # python benchmarks/run.py: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    sys.exit(main())
