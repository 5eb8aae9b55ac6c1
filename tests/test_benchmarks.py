"""The benchmark suite runs from the repository root and writes well-formed results (no timing asserted).

One `python -m benchmarks --smoke` run (the suite's smallest sizes; `--quick` runs under
KVCACHE_SLOW=1) is shared by the checks on its stdout, JSON and plots. The shared helpers of
benchmarks/common.py are checked against plain recomputation.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCENARIOS = [
    "append", "rollback", "memory", "persistence", "generation", "first_step", "speculation", "per_call",
    "prefix_store", "batch_speculation", "startup", "serve", "quantized", "prefill", "serve_anchor", "suffix",
    "prediction",
]  # fmt: skip

sys.path.insert(0, str(ROOT))
from benchmarks.common import Section, Table, Target, Timing, jsonable, rotate, write_json  # noqa: E402


def run_suite(tmp: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": ""}  # only the working directory makes `benchmarks` importable
    return subprocess.run(
        [sys.executable, "-m", "benchmarks", *args, "--out", str(tmp)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.fixture(scope="module")
def smoke(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess[str], Path]:
    out = tmp_path_factory.mktemp("bench")
    return run_suite(out, "--smoke"), out


def check_results(stdout: str, out: Path, mode: str) -> dict:
    payload = json.loads((out / "results.json").read_text())  # strict JSON: no NaN / Infinity
    assert payload["meta"]["mode"] == mode
    assert list(payload["scenarios"]) == SCENARIOS
    assert set(payload["meta"]["wall_seconds"]) == set(SCENARIOS)
    for name, scenario in payload["scenarios"].items():
        assert scenario["title"] and scenario["tables"], name
        for table in scenario["tables"]:
            assert table["rows"], (name, table["title"])
            assert all(len(row) == len(table["columns"]) for row in table["rows"]), (name, table["title"])
            assert table["title"] in stdout  # every table was printed
        for target in scenario["targets"]:
            assert isinstance(target["met"], bool) and target["claim"] and target["measured"]
            assert target["met"] or target["note"], f"{name}: a missed target must say why: {target}"
    return payload


def timings_in(value: object) -> list[dict]:
    """Every serialized Timing inside a JSON value."""
    if isinstance(value, dict):
        if set(value) >= {"median", "min", "max", "samples"}:
            return [value]
        return [t for v in value.values() for t in timings_in(v)]
    if isinstance(value, list):
        return [t for v in value for t in timings_in(v)]
    return []


def test_smoke_run_writes_well_formed_results(smoke: tuple[subprocess.CompletedProcess[str], Path]) -> None:
    proc, out = smoke
    assert proc.returncode == 0, proc.stderr[-3000:]
    payload = check_results(proc.stdout, out, "smoke")
    for heading in ("## 1.", "## 2.", "## 3.", "## 4.", "## 5.", "## 6.", "## Targets"):
        assert heading in proc.stdout
    timings = timings_in([s["figures"] for s in payload["scenarios"].values()])
    assert len(timings) > 50
    for t in timings:
        samples = t["samples"]
        assert samples and all(s >= 0 for s in samples)
        assert t["median"] == pytest.approx(statistics.median(samples))
        assert t["min"] == min(samples) and t["max"] == max(samples)
        assert t["min"] <= t["q1"] <= t["median"] <= t["q3"] <= t["max"]


def test_smoke_run_compares_against_transformers(smoke: tuple[subprocess.CompletedProcess[str], Path]) -> None:
    pytest.importorskip("transformers")
    _, out = smoke
    scenarios = json.loads((out / "results.json").read_text())["scenarios"]
    append_rows = [row[0] for row in scenarios["append"]["tables"][0]["rows"]]
    for theirs in ("transformers DynamicLayer", "transformers LinearAttentionLayer"):
        assert theirs in append_rows
    # transformers' linear-attention layers cannot roll back: the table says so instead of a time
    rollback = {row[0]: row for row in scenarios["rollback"]["tables"][0]["rows"]}
    assert "cannot roll back" in rollback["transformers LinearAttentionLayer"]
    assert rollback["kvcache RecurrentLayer"][1] == "yes"
    # the memory bound: our sliding layer keeps exactly W - 1 + r tokens, our recurrent layer 1 + r states
    memory = scenarios["memory"]["figures"]
    for row in memory["sliding"][next(k for k in memory["sliding"] if k.startswith("kvcache"))]:
        assert row["kept"] == memory["window"] - 1 + row["recorded"]
    assert all(row["states"] == 1 + (row["recorded"] or 0) for row in memory["recurrent"])
    generation = scenarios["generation"]["figures"]
    assert generation["transformers"]["agree"] is True


def test_smoke_run_writes_png_plots(smoke: tuple[subprocess.CompletedProcess[str], Path]) -> None:
    pytest.importorskip("matplotlib")
    _, out = smoke
    plots = sorted(out.glob("*.png"))
    assert {p.name.split("_")[0] for p in plots} >= {"append", "rollback", "memory", "persistence"}
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in plots)


@pytest.mark.slow
def test_quick_run(tmp_path: Path) -> None:
    proc = run_suite(tmp_path, "--quick", "--no-plots")
    assert proc.returncode == 0, proc.stderr[-3000:]
    check_results(proc.stdout, tmp_path, "quick")


def test_only_and_script_entry_point(tmp_path: Path) -> None:
    proc = run_suite(tmp_path, "--smoke", "--only", "memory", "--no-plots")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert list(json.loads((tmp_path / "results.json").read_text())["scenarios"]) == ["memory"]
    assert not list(tmp_path.glob("*.png"))
    scripts = ("run", "batch_speculation", "per_call", "prefix_store", "stateful_speculation", "startup", "serve",
               "quantized", "serve_anchor", "suffix", "prediction")
    if os.environ.get("KVCACHE_SLOW") != "1":  # each imports torch: a few by default, every one with KVCACHE_SLOW=1
        scripts = ("run", "serve", "suffix")
    # each script imports torch (seconds): started together, waited for together
    started = {script: subprocess.Popen([sys.executable, f"benchmarks/{script}.py", "--help"], cwd=ROOT,
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
               for script in scripts}  # fmt: skip
    for script, proc in started.items():
        out, err = proc.communicate(timeout=180)
        assert proc.returncode == 0 and "--quick" in out, (script, err[-2000:])
    bad = run_suite(tmp_path, "--only", "nonsense")
    assert bad.returncode == 2 and "invalid choice" in bad.stderr


# ------------------------------------------------------------------------ shared helpers
def test_timing_summary_matches_recomputation() -> None:
    samples = [5.0, 1.0, 4.0, 2.0, 3.0, 100.0]
    t = Timing.of(samples)
    assert t.median == statistics.median(samples) == 3.5
    assert (t.low, t.high) == (1.0, 100.0)
    q1, _, q3 = statistics.quantiles(samples, n=4, method="inclusive")
    assert t.quartiles == (q1, q3)
    assert t.spread == pytest.approx((q3 - q1) / (2 * 3.5))
    assert t.scaled(2).median == 7.0
    assert Timing.of([2.0]).spread == 0.0
    with pytest.raises(ValueError):
        Timing.of([])


def test_rotate_starts_each_round_one_further() -> None:
    calls: list[str] = []
    samplers = {name: (lambda name=name: calls.append(name) or len(calls)) for name in "abc"}
    results = rotate(samplers, reps=3, warmup=1)
    assert calls == list("abc") + list("abc") + list("bca") + list("cab")
    assert results == {"a": [4, 9, 11], "b": [5, 7, 12], "c": [6, 8, 10]}


def test_table_and_json_output(tmp_path: Path) -> None:
    table = Table("t", ["name", ":value"])
    table.add("x", 1.5)
    with pytest.raises(ValueError):
        table.add("too", "many", "cells")
    assert table.markdown().splitlines()[2:] == ["| name | value |", "| --- | ---: |", "| x | 1.5 |"]
    met, missed = Target("c", "t", "m", True, "why"), Target("d", "t", "m", False, "why")
    assert (met.note, missed.note) == ("", "why")  # a miss always carries its explanation
    with pytest.raises(ValueError, match="if_missed"):
        Target("e", "t", "m", True, " ")  # written with the claim, whether or not this run misses
    section = Section("s", "S", tables=[table], targets=[met, missed])
    section.figures = {"timing": Timing.of([1.0, 2.0, 3.0]), 4: math.nan, "inf": [math.inf]}
    write_json(tmp_path / "r.json", {"mode": "smoke"}, [section])
    figures = json.loads((tmp_path / "r.json").read_text())["scenarios"]["s"]["figures"]
    assert figures == {"timing": jsonable(Timing.of([1.0, 2.0, 3.0])), "4": None, "inf": [None]}
    assert figures["timing"]["median"] == 2.0
