"""Start-up: how long the command line takes to answer when it only prints, against Python itself
and against importing torch.

Each row is a fresh process (`subprocess.run`), timed from spawn to exit, in rotating rounds:
`python -c pass` (the floor), `import torch` (what a command that needs the model pays anyway),
`import kvcache`, `kvcache --version`, `kvcache --help` and `kvcache generate --help`. Target:
`kvcache --help` and `--version` answer in under 0.5 s (they import neither torch nor the model).

    python benchmarks/startup.py [--quick]
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from typing import Any

try:
    from .common import Section, Table, Target, ratio, rotate_timings, run_as_script, seconds
except ImportError:  # run as a script
    from common import Section, Table, Target, ratio, rotate_timings, run_as_script, seconds  # type: ignore[no-redef]

REPEATS = {"smoke": 1, "quick": 2, "full": 15}
#: The issue's bound for a command line that only prints.
PRINT_ONLY_S = 0.5


def _commands() -> dict[str, list[str]]:
    python = sys.executable
    cli = shutil.which("kvcache")
    kvcache = [cli] if cli else [python, "-m", "kvcache"]
    return {
        "python -c pass": [python, "-c", "pass"],
        "python -c 'import torch'": [python, "-c", "import torch"],
        "python -c 'import kvcache'": [python, "-c", "import kvcache"],
        "kvcache --version": [*kvcache, "--version"],
        "kvcache --help": [*kvcache, "--help"],
        "kvcache generate --help": [*kvcache, "generate", "--help"],
    }


def _sampler(argv: list[str]) -> Any:
    return lambda: seconds(lambda: subprocess.run(argv, check=True, capture_output=True, timeout=120))


def startup_scenario(mode: str) -> Section:
    commands = _commands()
    timings = rotate_timings({name: _sampler(argv) for name, argv in commands.items()}, REPEATS[mode], warmup=1)
    section = Section("startup", "Start-up of the command line", (__doc__ or "").split("\n\n")[1])
    table = Table("Seconds from spawn to exit", ["command", ":s", ":/ python -c pass", ":/ import torch"])
    floor, torch_import = timings["python -c pass"], timings["python -c 'import torch'"]
    for name, timing in timings.items():
        table.add(name, timing.cell(scale=1, digits=3), f"{ratio(timing, floor):.1f}x",
                  f"{ratio(timing, torch_import):.2f}x")  # fmt: skip
    for name in ("kvcache --version", "kvcache --help"):
        t = timings[name]
        section.targets.append(Target(
            f"startup: {name}", f"< {PRINT_ONLY_S} s", f"{t.median:.3f} s", t.median < PRINT_ONLY_S,
            "a command that only prints must not import torch; a miss means something on its import path does "
            "(tests/test_import_graph.py checks that torch stays out), or the machine was loaded",
        ))  # fmt: skip
    section.tables.append(table)
    section.figures = {"seconds": timings}
    return section


if __name__ == "__main__":
    run_as_script(startup_scenario, __doc__)
