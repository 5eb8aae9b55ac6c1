"""Scenarios 1-3: decode-step append cost, rollback cost, and memory held while recording.

Each compares every kvcache layer kind with transformers' layer for the same job (`kinds.py`),
measured side by side in the same run. Scenario 1 times with `append.measure`; scenario 3's
recurrent rows come from `recurrent_rollback.memory_rows`, its crop-inside-a-step figures from
`recurrent_rollback.crop_timings`.
"""

from __future__ import annotations

import copy
import math
from typing import Any

import torch

from . import append, recurrent_rollback
from .common import Plot, Section, Table, Target, Timing, ratio, rotate_timings, seconds, series_of
from .kinds import Kind, StateStep, all_kinds, kvcache_kinds, transformers_kinds

#: Sliding window of the sliding layers in all three scenarios.
WINDOW = 1024
#: Flat / context-independent means: the cost at the largest context within this factor of the smallest.
FLAT = 1.3
CONTEXT_FREE = 1.5

_KV = (append.BATCH, append.HEADS, append.HEAD_DIM)
_BYTES_PER_TOKEN = 2 * append.BATCH * append.HEADS * append.HEAD_DIM * 4  # keys + values, fp32, one layer


def _kv(tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    batch, heads, dim = _KV
    keys = torch.randn(batch, heads, tokens, dim, generator=gen)
    return keys, torch.randn(keys.shape, generator=gen)


# ------------------------------------------------------------------------- 1. append cost
APPEND_SIZES = {
    "smoke": {"contexts": [64, 256], "steps": 8, "reps": 2, "slow_steps": 2, "slow_reps": 2},
    "quick": {"contexts": [512, 4096], "steps": 32, "reps": 3, "slow_steps": 4, "slow_reps": 2},
    "full": {
        "contexts": [512, 1024, 2048, 4096, 8192, 16384],
        "steps": 256,
        "reps": 9,
        "slow_steps": 8,
        "slow_reps": 5,
    },
}


def _copies_whole_cache(kind: Kind) -> bool:
    """transformers' dynamic layers `torch.cat` the whole cache per token: fewer steps keep them affordable."""
    return kind.library == "transformers" and kind.family in ("full", "hybrid")


def append_scenario(mode: str) -> Section:
    size = APPEND_SIZES[mode]
    contexts = size["contexts"]
    first, last = contexts[0], contexts[-1]
    kinds = all_kinds(WINDOW, room=size["steps"] + 2)
    results: dict[str, dict[int, dict[str, Timing]]] = {}
    for kind in kinds:
        slow = _copies_whole_cache(kind)
        steps, reps = (size["slow_steps"], size["slow_reps"]) if slow else (size["steps"], size["reps"])
        results[kind.name] = append.measure(kind.make, contexts, steps, reps)
    theirs = {kind.family: results[kind.name] for kind in kinds if kind.library == "transformers"}

    section = Section(
        "append",
        "1. Decode-step append cost versus context length",
        f"One decode token through {append.LAYERS} layers (batch {append.BATCH}, {append.HEADS} kv heads, head_dim "
        f"{append.HEAD_DIM}, fp32; recurrent state {recurrent_rollback.STATE_SHAPE}, conv "
        f"{recurrent_rollback.CONV_CHANNELS}x{recurrent_rollback.KERNEL}), after a prefill of the context length. "
        "Median ±spread over repetitions, in µs per token; steady state after one untimed step "
        "(`append.measure`). Amortized adds the first step's regrowth spread over the tokens to the next one.",
    )
    table = Table(
        "µs per decode token, all layers",
        [
            "layer",
            *[f":{c}" for c in contexts],
            f":{last}/{first}",
            f":amortized {last}/{first}",
            ":kvcache speed-up over transformers",
        ],
    )
    for kind in kinds:
        row = results[kind.name]
        speedup = "-"
        if kind.library == "kvcache" and kind.family in theirs:
            speedup = f"{ratio(theirs[kind.family][last]['steady'], row[last]['steady']):.1f}x at {last}"
        table.add(
            kind.name,
            *[row[c]["steady"].cell() for c in contexts],
            f"{ratio(row[last]['steady'], row[first]['steady']):.2f}x",
            f"{ratio(row[last]['amortized'], row[first]['amortized']):.2f}x",
            speedup,
        )
        if kind.library == "kvcache":
            steady = ratio(row[last]["steady"], row[first]["steady"])
            section.targets.append(
                Target(
                    f"flat append: {kind.label}",
                    f"cost at {last} <= {FLAT}x cost at {first}",
                    f"{steady:.2f}x",
                    steady <= FLAT,
                    f"misses by {steady / FLAT:.2f}x; see benchmarks/README.md",
                )
            )
    section.tables.append(table)
    first_step = Table(
        "First decode step after the prefill, µs (includes a growth buffer's one regrowth)",
        ["layer", *[f":{c}" for c in contexts]],
    )
    for name, row in results.items():
        first_step.add(name, *[row[c]["first"].cell(digits=0) for c in contexts])
    section.tables.append(first_step)
    series, errors = {}, {}
    for name, row in results.items():
        series[name], errors[name] = series_of([row[c]["steady"] for c in contexts], 1e6)
    section.plots.append(
        Plot(
            "steady",
            "Decode-step append cost",
            "context length",
            "µs per token (all layers)",
            contexts,
            series,
            errors,
            logx=True,
            logy=True,
        )
    )
    section.figures = {"contexts": contexts, "window": WINDOW, "seconds_per_token": results}
    return section


# ---------------------------------------------------------------------- 2. rollback cost
ROLLBACK_SIZES = {
    "smoke": {"contexts": (256, 1024), "reps": 3, "inner": 2, "recurrent_reps": 2},
    "quick": {"contexts": (1024, 8192), "reps": 5, "inner": 4, "recurrent_reps": 3},
    "full": {"contexts": (1024, 16384), "reps": 11, "inner": 4, "recurrent_reps": 15},
}
CROP_KS = (1, 4, 16)


def _recorded(kind: Kind, context: int, steps: int) -> Any:
    """One layer of `kind`: a prefill of `context` tokens, then `steps` recorded decode steps."""
    layer = kind.make(context)
    layer.update(*_kv(context, seed=0))
    if hasattr(layer, "activate_past_recording"):
        layer.activate_past_recording()
    _decode(layer, steps)
    return layer


_STEP_KV = _kv(1, seed=1)


def _decode(layer: Any, steps: int) -> None:
    for _ in range(steps):
        layer.update(*_STEP_KV)


def _crop_sampler(layer: Any, k: int, inner: int):
    """Seconds per `crop(-k)`, timing `inner` of them in a row, then decoding the `inner * k` tokens
    again (untimed): the layer is back to the same length and recording depth, without a copy."""

    def crops() -> None:
        for _ in range(inner):
            layer.crop(-k)

    def sample() -> float:
        elapsed = seconds(crops)
        _decode(layer, inner * k)
        return elapsed / inner

    return sample


def _why_not_croppable(layer: Any, inner: int) -> str | None:
    """Why `layer` cannot take the crops a sample makes (`inner` crops of every k in a row, on a copy),
    None when it can."""
    if not bool(getattr(layer, "is_croppable", True)):
        return "cannot roll back: the recurrent state is not restored (is_croppable is False)"
    trial = copy.deepcopy(layer)
    try:
        for k in CROP_KS:
            for _ in range(inner):
                trial.crop(-k)
            _decode(trial, inner * k)
    except (RuntimeError, IndexError, ValueError) as err:
        return f"cannot roll back {inner} crops in a row: {type(err).__name__} ({err})"[:160]
    return None


def rollback_scenario(mode: str) -> Section:
    size = ROLLBACK_SIZES[mode]
    contexts = size["contexts"]
    recorded = size["inner"] * max(CROP_KS)  # enough recorded steps for `inner` crops in a row
    section = Section(
        "rollback",
        "2. Rollback: cost of crop(-k) per layer kind",
        f"One layer (batch {append.BATCH}, {append.HEADS} kv heads, head_dim {append.HEAD_DIM}, fp32; recurrent "
        f"state {recurrent_rollback.STATE_SHAPE}), prefilled with the context, then {recorded} decode steps "
        "recorded (`activate_past_recording()` where the layer has it). A sample times "
        f"{size['inner']} `crop(-k)` calls in a row (garbage collector paused), then decodes the removed tokens "
        "again, untimed, so every sample starts from the same state. Median ±spread in µs per crop.",
    )
    columns = ["layer", "exact rollback", *[f":k={k} @ {c}" for c in contexts for k in CROP_KS]]
    table = Table("µs per crop(-k), one layer", [*columns, f":{contexts[1]} / {contexts[0]} (worst k)"])
    figures: dict[str, Any] = {}
    for kind in all_kinds(WINDOW, room=recorded + 2):
        layers = {c: _recorded(kind, c, recorded) for c in contexts}
        reason = next(filter(None, (_why_not_croppable(layer, size["inner"]) for layer in layers.values())), None)
        if reason is not None:
            table.add(kind.name, "**no**", *["cannot roll back"] * (len(CROP_KS) * len(contexts)), "-")
            figures[kind.name] = reason
            continue
        samplers = {(c, k): _crop_sampler(layers[c], k, size["inner"]) for c in contexts for k in CROP_KS}
        timings = rotate_timings(samplers, size["reps"], warmup=1)
        ratios = [ratio(timings[(contexts[1], k)], timings[(contexts[0], k)]) for k in CROP_KS]
        worst = max(ratios, key=lambda r: abs(math.log(r)))  # farthest from 1 either way
        table.add(
            kind.name, "yes", *[timings[(c, k)].cell(digits=1) for c in contexts for k in CROP_KS], f"{worst:.2f}x"
        )
        figures[kind.name] = {f"{c}": {f"{k}": timings[(c, k)] for k in CROP_KS} for c in contexts}
        if kind.library == "kvcache":
            low, high = 1 / CONTEXT_FREE, CONTEXT_FREE
            met = all(low <= r <= high for r in ratios)
            k_worst = CROP_KS[ratios.index(worst)]
            spreads = max(timings[(c, k_worst)].spread for c in contexts)
            section.targets.append(
                Target(
                    f"crop cost independent of context: {kind.label}",
                    f"crop at {contexts[1]} within {low:.2f}x-{high}x of crop at {contexts[0]}",
                    f"worst k: {worst:.2f}x",
                    met,
                    f"k={k_worst}: {worst:.2f}x between contexts, with a spread of up to ±{spreads:.0%} on "
                    f"timings of {timings[(contexts[0], k_worst)].median * 1e6:.1f} µs",
                )
            )
    section.tables.append(table)
    section.tables.append(_recurrent_crop_table(size["recurrent_reps"]))
    section.notes.append(
        "transformers' dynamic, sliding and static layers crop by slicing or moving a counter, like ours. Its "
        "linear-attention layers (and the hybrids built on them) keep the latest recurrent state only before "
        "5.25 (`is_croppable = False`); from 5.25 they keep the states of the forwards since the last crop and "
        "drop them at each crop, so they undo part of the last forwards once, not a crop after a crop."
    )
    section.figures = {"contexts": list(contexts), "k": list(CROP_KS), "seconds_per_crop": figures}
    k = CROP_KS[1]
    series, errors = {}, {}
    for name, per_context in figures.items():
        if isinstance(per_context, dict):  # not the layers that cannot roll back
            series[name], errors[name] = series_of([per_context[f"{c}"][f"{k}"] for c in contexts], 1e6)
    title = f"crop(-{k}) cost against context length (flat: independent of the context)"
    section.plots.append(
        Plot("crop", title, "context length", "µs", list(contexts), series, errors, logx=True, logy=True)
    )
    return section


def _recurrent_crop_table(reps: int) -> Table:
    """`recurrent_rollback.crop_timings`: crops of a realistic recurrent layer next to one recorded step."""
    step, crops = recurrent_rollback.crop_timings(reps)
    table = Table(
        f"kvcache RecurrentLayer crops against one recorded decode step ({step.cell(digits=0)} µs), "
        "`recurrent_rollback.crop_timings`",
        ["crop", "from", ":µs", ":x one recorded step"],
    )
    for what, where, t in crops:
        table.add(what, where, t.cell(digits=0), f"{ratio(t, step):.2f}")
    return table


# --------------------------------------------------------------- 3. memory while recording
MEMORY_STEPS = {"smoke": (0, 1, 4), "quick": (0, 1, 4, 16, 64), "full": (0, 1, 4, 16, 64, 256)}


def storage_bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind `tensors` (what is really held, spare capacity included)."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def _sliding_rows(kind: Kind, steps: tuple[int, ...]) -> list[dict[str, int]]:
    """A sliding layer prefilled with 2W tokens, then recording: kept tokens and bytes held at each r,
    and the bytes held just before recording started."""

    def kept_and_held() -> tuple[int, int]:
        if kind.library == "kvcache":
            return layer.state["keys"].shape[2], layer.nbytes()
        return layer.keys.shape[2], storage_bytes([layer.keys, layer.values])

    layer = kind.make(2 * WINDOW)
    layer.update(*_kv(2 * WINDOW, seed=0))
    before = kept_and_held()[1]
    layer.activate_past_recording()
    rows, done = [], 0
    for r in steps:
        _decode(layer, r - done)
        done = r
        kept, held = kept_and_held()
        rows.append({"recorded": r, "kept": kept, "bound": WINDOW - 1 + r, "held": held, "before": before})
    return rows


def _transformers_recurrent_rows(steps: tuple[int, ...]) -> list[dict[str, int]] | None:
    """transformers' LinearAttentionLayer recording r steps: its conv inputs, and one state (before 5.25) or
    the states since the last crop."""
    theirs = next((k for k in transformers_kinds(WINDOW, 0) if k.family == "recurrent"), None)
    if theirs is None:
        return None
    wrapper: StateStep = theirs.make(0)
    token = torch.zeros(1, 1, 1, 1)
    wrapper.update(token.expand(1, 1, 16, 1), token)  # the prefill recurrent_rollback.recorded_layer makes
    wrapper.activate_past_recording()
    rows, done = [], 0
    for r in steps:
        for _ in range(r - done):
            wrapper.update(token, token)
        done = r
        layer = wrapper.layer
        history = list(getattr(layer, "recurrent_states_history", {}).get(0, []))  # transformers >= 5.25
        held = storage_bytes([layer.conv_states[0], layer.recurrent_states[0], *history])
        rows.append({"recorded": r, "held": held, "states": 1 + len(history),
                     "conv_columns": layer.conv_states[0].shape[-1]})  # fmt: skip
    return rows


def _window_widths_table(steps: tuple[int, ...], section: Section) -> Table:
    """Bytes a recording `SlidingWindowLayer` holds against `W - 1 + r` for windows of 64, 128, 1024
    (real models use 128 to 4096): the headroom is proportional to the window."""
    from kvcache import SlidingWindowLayer

    table = Table("Sliding windows of several widths: bytes held while recording, against W - 1 + r",
                  ["W", ":r", ":bytes held", ":bound bytes", ":held / bound"])  # fmt: skip
    worst = 0.0
    for window in (64, 128, 1024):
        layer = SlidingWindowLayer(window)
        layer.update(*_kv(2 * window, seed=0))
        layer.activate_past_recording()
        done = 0
        for r in steps:
            _decode(layer, r - done)
            done = r
            bound = (window - 1 + r) * _BYTES_PER_TOKEN
            worst = max(worst, layer.nbytes() / bound)
            table.add(window, r, f"{layer.nbytes():,}", f"{bound:,}", f"{layer.nbytes() / bound:.2f}x")
    section.targets.append(Target(
        "sliding: bytes held while recording, windows of 64 to 1024", "<= 1.25x W - 1 + r", f"up to {worst:.2f}x",
        worst <= 1.25, "the headroom is 1.125x plus a block of an eighth of the window; more means a regression",
    ))  # fmt: skip
    return table


def memory_scenario(mode: str) -> Section:
    steps = MEMORY_STEPS[mode]
    section = Section(
        "memory",
        "3. Memory held while recording r steps, against what rollback needs",
        "The contract (docs/contract.md) bounds memory while recording by what rollback needs: a sliding "
        "window keeps `W - 1 + r` tokens, a recurrent layer `1 + r` states, for r recorded steps. "
        f"One layer; sliding W = {WINDOW} "
        f"({_BYTES_PER_TOKEN:,} B per token for keys + values) prefilled with 2W tokens; recurrent state "
        f"{recurrent_rollback.STATE_SHAPE} fp32 ({recurrent_rollback.STATE_BYTES:,} B) with conv "
        f"{recurrent_rollback.CONV_CHANNELS}x{recurrent_rollback.KERNEL}. Bytes held count the storage behind the "
        "layer's tensors, spare capacity of growth buffers included.",
    )
    sliding = [k for k in all_kinds(WINDOW, 0) if k.family == "sliding"]
    sliding_rows = {kind.name: _sliding_rows(kind, steps) for kind in sliding}
    table = Table(
        "Sliding window: tokens kept and bytes held while recording",
        [
            "layer",
            ":r",
            ":tokens kept",
            ":bound W - 1 + r",
            ":bytes held",
            ":bound bytes",
            ":held / bound",
            ":added by recording",
            ":r tokens' bytes",
        ],
    )
    for name, rows in sliding_rows.items():
        for row in rows:
            bound_bytes = row["bound"] * _BYTES_PER_TOKEN
            table.add(
                name,
                row["recorded"],
                row["kept"],
                row["bound"],
                f"{row['held']:,}",
                f"{bound_bytes:,}",
                f"{row['held'] / bound_bytes:.2f}x",
                f"{row['held'] - row['before']:,}",
                f"{row['recorded'] * _BYTES_PER_TOKEN:,}",
            )
    section.tables.append(table)

    ours = sliding_rows[kvcache_kinds(WINDOW, 0)[1].name]
    at_bound = all(row["kept"] == row["bound"] for row in ours)
    worst = max(row["held"] / (row["bound"] * _BYTES_PER_TOKEN) for row in ours)
    section.targets.append(
        Target(
            "sliding: tokens kept while recording",
            "= W - 1 + r",
            "equal for every r" if at_bound else "differs",
            at_bound,
            "a bug: the window must keep exactly what rollback of r tokens needs",
        )
    )
    added_ok = all(row["held"] - row["before"] <= row["recorded"] * _BYTES_PER_TOKEN for row in ours)
    section.targets.append(
        Target(
            "sliding: bytes recording adds",
            "<= r tokens' bytes",
            f"at most {max(row['held'] - row['before'] for row in ours):,} B",
            added_ok,
            "recording allocated beyond the window buffer's headroom",
        )
    )
    capacity = max(row["held"] for row in ours) // _BYTES_PER_TOKEN
    section.targets.append(
        Target(
            "sliding: bytes held incl. spare capacity",
            "<= 1.25x the bound",
            f"up to {worst:.2f}x the bound",
            worst <= 1.25,
            f"storage for {capacity} tokens: the window buffer's headroom (1.125x the kept tokens, in blocks of "
            "an eighth of the window), there before recording starts; recording fills it without allocating",
        )
    )

    section.tables.append(_window_widths_table(steps, section))

    recurrent = recurrent_rollback.memory_rows(steps)
    theirs = _transformers_recurrent_rows(steps)
    table = Table(
        "Recurrent layer: states and bytes held while recording (`recurrent_rollback.memory_rows`)",
        [
            "layer",
            ":r",
            ":states held",
            ":bound 1 + r",
            ":conv columns",
            ":bytes held",
            ":bytes needed",
            ":held / needed",
        ],
    )
    for row in recurrent:
        r = row["recorded"]
        table.add(
            "kvcache RecurrentLayer",
            "not recording" if r is None else r,
            row["states"],
            1 + (r or 0),
            row["conv_columns"],
            f"{row['held']:,}",
            f"{row['needed']:,}",
            f"{row['held'] / row['needed']:.2f}x",
        )
    for row in theirs or []:
        table.add(
            "transformers LinearAttentionLayer",
            row["recorded"],
            row["states"] if row["states"] > 1 else "1 (cannot roll back)",
            1 + row["recorded"],
            row["conv_columns"],
            f"{row['held']:,}",
            "-",
            "-",
        )
    section.tables.append(table)
    recorded = [row for row in recurrent if row["recorded"] is not None]
    states_ok = all(row["states"] == 1 + row["recorded"] for row in recorded)
    worst_row = max(recorded, key=lambda row: row["held"] / row["needed"])
    worst_rec = worst_row["held"] / worst_row["needed"]
    spare_columns = (worst_row["held"] - worst_row["needed"]) // (recurrent_rollback.CONV_CHANNELS * 4)
    section.targets.append(
        Target(
            "recurrent: states held while recording",
            "= 1 + r",
            "equal for every r" if states_ok else "differs",
            states_ok,
            "a bug: recording r tokens must keep the live state and one snapshot per token",
        )
    )
    section.targets.append(
        Target(
            "recurrent: bytes held incl. conv spare capacity",
            "<= needed",
            f"up to {worst_rec:.3f}x what rollback needs",
            worst_rec <= 1.0 + 1e-9,
            f"misses by {worst_rec:.3f}x at r = {worst_row['recorded']}: {spare_columns} spare conv columns "
            "(the conv history grows in blocks of 16 columns, doubling); the states are exactly 1 + r",
        )
    )
    section.figures = {
        "window": WINDOW,
        "bytes_per_token": _BYTES_PER_TOKEN,
        "sliding": sliding_rows,
        "recurrent": recurrent,
        "transformers_recurrent": theirs,
    }
    x = list(steps)
    series: dict[str, list[float | None]] = {
        f"{name} held / bound": [row["held"] / (row["bound"] * _BYTES_PER_TOKEN) for row in rows]
        for name, rows in sliding_rows.items()
    }
    series["kvcache RecurrentLayer held / needed"] = [row["held"] / row["needed"] for row in recorded]
    section.plots.append(
        Plot("ratio", "Bytes held while recording / contract bound", "recorded steps r", "held / bound", x, series)
    )
    return section
