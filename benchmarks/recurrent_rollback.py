"""Recurrent-layer rollback: memory held while recording r steps, and what a crop costs.

A layer with a realistic state: a 32 heads x 64 x 128 fp32 recurrent state (1 MiB per batch row, as
in a Mamba2 / gated-delta-net layer) and a conv state of 4352 channels x kernel 4. Prints Markdown
tables: bytes held against the contract's bound (conv inputs since the commit point + `1 + r` states;
"bytes held" includes the conv history's spare capacity, allocated geometrically in blocks of 16 columns),
and the median time of `crop(-k)` next to the time of one recorded decode step, measured in the
same run. Run: `python benchmarks/recurrent_rollback.py [--reps N]`.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

import torch

from kvcache import RecurrentLayer

try:
    from .common import Timing, timed_after
except ImportError:  # run as a script: python benchmarks/recurrent_rollback.py
    from common import Timing, timed_after  # type: ignore[no-redef]

STATE_SHAPE = (1, 32, 64, 128)
CONV_CHANNELS, KERNEL = 4352, 4
STATE_BYTES = torch.Size(STATE_SHAPE).numel() * 4


def recorded_layer(steps: int, verify_tokens: int = 0) -> RecurrentLayer:
    """A prefilled layer that then records `steps` single-token steps (and one verify step)."""
    gen = torch.Generator().manual_seed(0)
    layer = RecurrentLayer()
    layer.update_conv_state(torch.randn(1, CONV_CHANNELS, 16, generator=gen), conv_kernel_size=KERNEL)
    layer.update_recurrent_state(torch.randn(STATE_SHAPE, generator=gen))
    layer.activate_past_recording()
    x, state = torch.randn(1, CONV_CHANNELS, 1, generator=gen), torch.randn(STATE_SHAPE, generator=gen)
    for _ in range(steps):
        layer.update_conv_state(x)
        layer.update_recurrent_state(state)
    if verify_tokens:
        layer.update_conv_state(torch.randn(1, CONV_CHANNELS, verify_tokens, generator=gen))
        inter = torch.randn(1, verify_tokens, *STATE_SHAPE[1:], generator=gen)
        layer.update_recurrent_state(inter[:, -1], intermediate_states=inter)
    return layer


def needed(r: int) -> int:
    """Bytes rollback of r steps needs: 1 + r states and the kernel window plus r conv inputs."""
    return (1 + r) * STATE_BYTES + (KERNEL + r) * CONV_CHANNELS * 4


def memory_rows(rs: Sequence[int]) -> list[dict[str, int | None]]:
    """Per recorded step count r (first None: not recording): bytes held (spare capacity included),
    bytes rollback needs, recurrent states held and conv columns in use."""
    rows = []
    for r in (None, *rs):
        layer = recorded_layer(r or 0)
        if r is None:
            layer.record_past = False
        rows.append(
            {
                "recorded": r,
                "held": layer.nbytes(),
                "needed": needed(r or 0),
                "states": sum(1 for name in layer.state if name.startswith("recurrent")),
                "conv_columns": layer.state["conv.0"].shape[-1],
            }
        )
    return rows


def memory_table() -> list[str]:
    rows = [
        "| recorded steps r | bytes held | bytes needed | recurrent states held | bound 1 + r | conv columns |",
        "| ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for row in memory_rows((0, 1, 2, 4, 8, 16, 32, 64)):
        r = row["recorded"]
        columns = f"{row['conv_columns']}" + ("" if r is None else f" = {KERNEL} + {r}")
        label, bound = ("not recording", 1) if r is None else (str(r), 1 + r)
        rows.append(f"| {label} | {row['held']:,} | {row['needed']:,} | {row['states']} | {bound} | {columns} |")
    return rows


def timed(setup, action, reps: int) -> Timing:
    """Seconds of `action(obj)` over `reps` fresh `setup()` objects."""
    sample = timed_after(setup, action)
    return Timing.of([sample() for _ in range(reps)])


def crop_timings(reps: int) -> tuple[Timing, list[tuple[str, str, Timing]]]:
    """One recorded decode step, and per crop (what, from where) its time, all on fresh layers."""
    gen = torch.Generator().manual_seed(1)
    x, state = torch.randn(1, CONV_CHANNELS, 1, generator=gen), torch.randn(STATE_SHAPE, generator=gen)

    def one_step(layer: RecurrentLayer) -> None:
        layer.update_conv_state(x)
        layer.update_recurrent_state(state)

    step = timed(lambda: recorded_layer(32), one_step, reps)
    crops = []
    for k in (1, 4, 16, 32):
        t = timed(lambda: recorded_layer(32), lambda layer, k=k: layer.crop(-k), reps)
        crops.append((f"crop(-{k})", "32 recorded steps", t))
    commit = timed(lambda: recorded_layer(32), lambda layer: layer.crop(0), reps)
    crops.append(("crop(0) commit", "32 recorded steps", commit))
    for j in (1, 4):
        t = timed(lambda: recorded_layer(0, verify_tokens=8), lambda layer, j=j: layer.crop(-j), reps)
        crops.append((f"crop(-{j}) inside", "one 8-token verify step", t))
    return step, crops


def crop_table(reps: int) -> list[str]:
    step, crops = crop_timings(reps)
    rows = [
        f"Recorded decode step (conv update + snapshot + state copy): {step.median * 1e6:.0f} us (median of {reps})",
        "",
        "| crop | from | median time (us) | x one recorded step |",
        "| --- | --- | ---: | ---: |",
    ]
    for what, where, t in crops:
        rows.append(f"| {what} | {where} | {t.median * 1e6:.0f} | {t.median / step.median:.2f} |")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=15)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"## RecurrentLayer rollback: state {STATE_SHAPE} fp32 ({STATE_BYTES:,} B), conv {CONV_CHANNELS}x{KERNEL}\n")
    print("\n".join(memory_table()))
    print()
    print("\n".join(crop_table(args.reps)))


if __name__ == "__main__":
    main()
