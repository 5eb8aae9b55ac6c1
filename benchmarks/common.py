"""What every benchmark scenario shares: timing with spread, Markdown tables, targets, JSON, plots.

A scenario measures, then returns a `Section`: its tables (rendered to Markdown on stdout), its raw
figures (written as JSON), the targets it checks (collected into the closing summary) and its plots
(PNG, only when matplotlib is installed). Every timing is a `Timing`: all the samples of one
quantity, summarised by the median and the interquartile spread. Contenders are sampled in rotating
order within each round (`rotate`), so a change in machine load hits all of them alike and the
ratios taken from one run hold on a noisy machine.
"""

from __future__ import annotations

import concurrent.futures
import gc
import json
import math
import statistics
import textwrap
import threading
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypeVar

K = TypeVar("K", bound=Hashable)

#: Run sizes, smallest first: "smoke" (a few seconds per scenario, for the test suite), "quick"
#: (about a minute for the whole suite) and "full".
MODES = ("smoke", "quick", "full")


# ------------------------------------------------------------------------------------ timing
@dataclass(frozen=True)
class Timing:
    """Samples (seconds, or any per-unit figure) of one quantity: median, interquartile spread, min, max."""

    samples: tuple[float, ...]

    @classmethod
    def of(cls, samples: Sequence[float]) -> Timing:
        if not samples:
            raise ValueError("a Timing needs at least one sample")
        return cls(tuple(float(s) for s in samples))

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    @property
    def low(self) -> float:
        return min(self.samples)

    @property
    def high(self) -> float:
        return max(self.samples)

    @property
    def quartiles(self) -> tuple[float, float]:
        """First and third quartiles (inclusive method: within the samples' range)."""
        if len(self.samples) < 2:
            return self.samples[0], self.samples[0]
        q1, _, q3 = statistics.quantiles(self.samples, n=4, method="inclusive")
        return q1, q3

    @property
    def spread(self) -> float:
        """Half the interquartile range relative to the median (0.05 means +-5%): robust to the odd
        outlier a shared machine produces, which min/max (kept in the JSON) are not."""
        q1, q3 = self.quartiles
        return (q3 - q1) / (2 * self.median) if self.median else 0.0

    def scaled(self, factor: float) -> Timing:
        """Every sample times `factor` (per-token figures, unit changes)."""
        return Timing(tuple(s * factor for s in self.samples))

    def cell(self, scale: float = 1e6, digits: int = 1) -> str:
        """`median +-spread%` with the median multiplied by `scale` (default: seconds to us)."""
        return f"{self.median * scale:,.{digits}f} ±{self.spread:.0%}"

    def to_json(self) -> dict[str, Any]:
        q1, q3 = self.quartiles
        return {
            "median": self.median,
            "q1": q1,
            "q3": q3,
            "min": self.low,
            "max": self.high,
            "samples": list(self.samples),
        }


_HTTP = threading.local()


def http_client() -> Any:
    """This thread's HTTP client (httpx): one kept-alive connection per simulated user, as SDKs and
    chat apps keep them. Making a client costs more than a small model's forward (it builds a TLS
    context even for plain HTTP), so a client made per request would time the client library."""
    import httpx

    if getattr(_HTTP, "client", None) is None:
        _HTTP.client = httpx.Client(timeout=600)
    return _HTTP.client


def client_pool(clients: int) -> concurrent.futures.ThreadPoolExecutor:
    """A pool of `clients` threads (simulated users), each with its `http_client` made already,
    so a timed load starts with every user ready."""
    pool = concurrent.futures.ThreadPoolExecutor(clients)
    ready = threading.Barrier(clients)
    list(pool.map(lambda _: (http_client(), ready.wait(60)), range(clients)))
    return pool


def ratio(numerator: Timing, denominator: Timing) -> float:
    """Ratio of medians (both measured in the same run)."""
    return numerator.median / denominator.median


def seconds(fn: Callable[[], Any]) -> float:
    """Seconds one call of `fn` takes, with the garbage collector paused as `timeit` does (its result
    is dropped after the clock stops)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        start = time.perf_counter()
        result = fn()
        elapsed = time.perf_counter() - start
    finally:
        if was_enabled:
            gc.enable()
    del result
    return elapsed


def timed_after(setup: Callable[[], Any], action: Callable[[Any], Any]) -> Callable[[], float]:
    """A sampler: build a fresh object with `setup` (untimed), then time `action(obj)` once."""

    def sample() -> float:
        obj = setup()
        return seconds(lambda: action(obj))

    return sample


def rotate(samplers: dict[K, Callable[[], Any]], reps: int, warmup: int = 0) -> dict[K, list[Any]]:
    """Call every sampler `reps` times, one call each per round, starting each round one further
    along the list; return every sampler's results. `warmup` untimed rounds go first."""
    names = list(samplers)
    for _ in range(warmup):
        for name in names:
            samplers[name]()
    results: dict[K, list[Any]] = {name: [] for name in names}
    for round_ in range(reps):
        shift = round_ % len(names) if names else 0
        for name in names[shift:] + names[:shift]:
            results[name].append(samplers[name]())
    return results


def rotate_timings(samplers: dict[K, Callable[[], float]], reps: int, warmup: int = 0) -> dict[K, Timing]:
    """`rotate` for samplers that return seconds: one `Timing` each."""
    return {name: Timing.of(values) for name, values in rotate(samplers, reps, warmup).items()}


# ------------------------------------------------------------------------------------ report
@dataclass
class Table:
    """A Markdown table: a title line, column names (a leading ':' right-aligns) and string cells."""

    title: str
    columns: list[str]
    rows: list[list[str]] = field(default_factory=list)

    def add(self, *cells: Any) -> None:
        if len(cells) != len(self.columns):
            raise ValueError(f"table {self.title!r}: {len(cells)} cells for {len(self.columns)} columns")
        self.rows.append([str(c) for c in cells])

    def markdown(self) -> str:
        names = [c.lstrip(":") for c in self.columns]
        rule = ["---:" if c.startswith(":") else "---" for c in self.columns]
        lines = [f"**{self.title}**", "", "| " + " | ".join(names) + " |", "| " + " | ".join(rule) + " |"]
        lines += ["| " + " | ".join(row) + " |" for row in self.rows]
        return "\n".join(lines)


@dataclass
class Target:
    """A claim the tables must show, the figure that decides it, and whether it held.

    `if_missed` is written with the claim, before any figure exists: a timing target can miss on a
    noisy run (a smoke run's few repetitions, a busy machine), and a miss must always say why it
    may have happened rather than leave an empty note."""

    claim: str
    target: str
    measured: str
    met: bool
    if_missed: str

    def __post_init__(self) -> None:
        if not self.if_missed.strip():
            raise ValueError(f"target {self.claim!r}: if_missed must say what a miss means")

    @property
    def note(self) -> str:
        return "" if self.met else self.if_missed

    def to_json(self) -> dict[str, Any]:
        return {"claim": self.claim, "target": self.target, "measured": self.measured, "met": self.met,
                "note": self.note}  # fmt: skip


@dataclass
class Plot:
    """A line plot: one series per name over shared x values (None where not measured); optional
    `errors` give each series' (low, high) per point. transformers' series are drawn dashed."""

    name: str
    title: str
    xlabel: str
    ylabel: str
    x: list[float]
    series: dict[str, list[float | None]]
    errors: dict[str, list[tuple[float, float] | None]] = field(default_factory=dict)
    logx: bool = False
    logy: bool = False
    #: Draw grouped bars, one group per x value labelled by `x_labels`, instead of lines.
    x_labels: list[str] | None = None


@dataclass
class Section:
    """What one scenario hands back."""

    name: str
    title: str
    setup: str = ""
    tables: list[Table] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    targets: list[Target] = field(default_factory=list)
    figures: dict[str, Any] = field(default_factory=dict)
    plots: list[Plot] = field(default_factory=list)

    def markdown(self) -> str:
        parts = [f"## {self.title}"]
        if self.setup:
            parts.append(self.setup)
        parts += [table.markdown() for table in self.tables]
        parts += self.notes
        return "\n\n".join(parts) + "\n"

    def to_json(self) -> dict[str, Any]:
        return {
            "title": self.title,
            "setup": self.setup,
            "tables": [asdict(t) for t in self.tables],
            "notes": self.notes,
            "targets": [t.to_json() for t in self.targets],
            "figures": jsonable(self.figures),
        }


def section_of(
    name: str, title: str, doc: str | None, builders: Sequence[Callable[[str], tuple]], mode: str
) -> Section:
    """A scenario made of table builders, each `build(mode) -> (table, targets, figures)`, run on one
    thread without autograd; the setup text is the module docstring's second paragraph."""
    import torch

    torch.set_num_threads(1)
    section = Section(name, title, (doc or "").split("\n\n")[1])
    with torch.no_grad():
        for build in builders:
            table, targets, figures = build(mode)
            section.tables.append(table)
            section.targets += targets
            section.figures[build.__name__] = figures
    return section


def run_as_script(scenario: Callable[[str], Section], doc: str | None) -> None:
    """`python benchmarks/<scenario>.py [--quick]`: run one scenario on one thread and print it.
    The repository root goes on `sys.path` first, for scenarios that import `benchmarks.*` lazily."""
    import argparse
    import sys

    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    parser = argparse.ArgumentParser(description=(doc or "").splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    with torch.no_grad():
        section = scenario("quick" if args.quick else "full")
    print(section.markdown())
    for t in section.targets:
        print(f"- {t.claim}: {t.target}; measured {t.measured}: {'met' if t.met else 'MISSED'} {t.note}")


def targets_table(sections: Sequence[Section]) -> Table:
    table = Table(
        "What the tables must show, and whether this run shows it",
        ["scenario", "claim", "target", "measured", "met", "note"],
    )
    for section in sections:
        for t in section.targets:
            table.add(section.name, t.claim, t.target, t.measured, "yes" if t.met else "**no**", t.note)
    return table


def jsonable(value: Any) -> Any:
    """`value` with Timings expanded, dict keys as strings and non-finite floats as None."""
    if isinstance(value, Timing):
        return value.to_json()
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def write_json(path: Path, meta: dict[str, Any], sections: Sequence[Section]) -> None:
    payload = {"meta": jsonable(meta), "scenarios": {s.name: s.to_json() for s in sections}}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=1, allow_nan=False) + "\n")


def write_plots(out: Path, sections: Sequence[Section]) -> list[Path]:
    """One PNG per plot under `out`; none (and no error) when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    written = []
    for section in sections:
        for plot in section.plots:
            fig, ax = plt.subplots(figsize=(10, 4.5))
            if plot.x_labels is not None:
                _bars(ax, plot)
            for name, ys in ({} if plot.x_labels is not None else plot.series).items():
                errs = plot.errors.get(name) or [None] * len(ys)
                points = [(x, y, e) for x, y, e in zip(plot.x, ys, errs, strict=True) if y is not None]
                if not points:
                    continue
                xs, vals = [p[0] for p in points], [p[1] for p in points]
                style = {"marker": "o", "label": name, "linestyle": "--" if name.startswith("transformers") else "-"}
                if all(p[2] is not None for p in points):
                    below = [p[1] - p[2][0] for p in points]
                    above = [p[2][1] - p[1] for p in points]
                    ax.errorbar(xs, vals, yerr=[below, above], capsize=3, **style)
                else:
                    ax.plot(xs, vals, **style)
            ax.set(title=plot.title, xlabel=plot.xlabel, ylabel=plot.ylabel)
            if plot.logx:
                ax.set_xscale("log", base=2)
            if plot.logy:
                ax.set_yscale("log")
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
            fig.tight_layout()
            path = out / f"{section.name}_{plot.name}.png"
            path.parent.mkdir(parents=True, exist_ok=True)
            fig.savefig(path, dpi=110)
            plt.close(fig)
            written.append(path)
    return written


def _bars(ax: Any, plot: Plot) -> None:
    """Grouped bars: one group per x label, one bar per series (missing values left out)."""
    width = 0.8 / max(len(plot.series), 1)
    for i, (name, ys) in enumerate(plot.series.items()):
        positions = [j + (i - (len(plot.series) - 1) / 2) * width for j in range(len(ys))]
        kept = [(p, y) for p, y in zip(positions, ys, strict=True) if y is not None]
        ax.bar([p for p, _ in kept], [y for _, y in kept], width, label=name)
    labels = ["\n".join(textwrap.wrap(label, 24)) for label in plot.x_labels or []]
    ax.set_xticks(range(len(labels)), labels, fontsize=8)


def series_of(timings: Sequence[Timing | None], scale: float = 1.0) -> tuple[list[float | None], list[Any]]:
    """Plot values (medians) and error bars (first, third quartile) of a row of Timings, scaled."""
    values = [None if t is None else t.median * scale for t in timings]
    errors = [None if t is None else (t.quartiles[0] * scale, t.quartiles[1] * scale) for t in timings]
    return values, errors
