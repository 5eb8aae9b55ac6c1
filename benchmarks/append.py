"""Decode-step append cost of the attention layers versus context length (issue 2's benchmark).

Setup: batch 1, 8 kv heads, head_dim 64, fp32, 8 model layers, CPU. For each layer kind and
context length L, the layers are prefilled with L tokens; each repetition works on a fresh copy,
takes one untimed decode step, then times `steps` single-token decode steps (one `update` per
model layer each) and reports the median over repetitions of the time per token (all 8 layers).

The untimed step hides the one reallocation a growth buffer makes right after a prefill (its
storage is exactly full then); its cost is shown in its own column ("first step"), and the
"amortized" column spreads it over the L tokens until the next reallocation (capacity doubles).

Kinds: kvcache `DynamicLayer`, `SlidingWindowLayer(window)` (not recording), `StaticLayer(L + room)`
and, when transformers is installed, transformers' `DynamicLayer` (one `torch.cat` of the whole
cache per token). Prints a Markdown table and the ratios the issue asks for:
cost at 8192 / cost at 512 per kind (target <= 1.3 for ours), transformers / ours at 4096
(target >= 20).

    python benchmarks/append.py            # full run (~1-2 min)
    python benchmarks/append.py --quick    # fewer contexts and repetitions (~15 s)
"""

from __future__ import annotations

import argparse
import copy
import time
from collections.abc import Callable
from typing import Any

import torch

from kvcache import DynamicLayer, SlidingWindowLayer, StaticLayer

try:
    from .common import Timing, rotate
except ImportError:  # run as a script: python benchmarks/append.py
    from common import Timing, rotate  # type: ignore[no-redef]

BATCH, HEADS, HEAD_DIM, LAYERS = 1, 8, 64, 8
DTYPE = torch.float32


def transformers_dynamic_layer() -> Callable[[int], Any] | None:
    try:
        from transformers.cache_utils import DynamicLayer as HFDynamicLayer
    except ImportError:
        return None
    return lambda context: HFDynamicLayer()


def kinds(window: int, room: int) -> dict[str, Callable[[int], Any]]:
    """Name -> factory(context length) of one layer."""
    out: dict[str, Callable[[int], Any]] = {
        "kvcache DynamicLayer": lambda context: DynamicLayer(),
        f"kvcache SlidingWindowLayer(W={window})": lambda context: SlidingWindowLayer(window),
        "kvcache StaticLayer": lambda context: StaticLayer(context + room),
    }
    hf = transformers_dynamic_layer()
    if hf is not None:
        out["transformers DynamicLayer"] = hf
    return out


def prefilled(factory: Callable[[int], Any], context: int) -> list[Any]:
    gen = torch.Generator().manual_seed(0)
    layers = []
    for _ in range(LAYERS):
        layer = factory(context)
        k = torch.randn(BATCH, HEADS, context, HEAD_DIM, generator=gen, dtype=DTYPE)
        layer.update(k, torch.randn_like(k))
        layers.append(layer)
    return layers


def time_once(base: list[Any], tokens: list[tuple[torch.Tensor, torch.Tensor]], steps: int) -> tuple[float, float]:
    """On a fresh copy of `base`: seconds of the first decode step, and seconds per token after it."""
    layers = copy.deepcopy(base)
    t0 = time.perf_counter()
    for layer in layers:
        layer.update(*tokens[0])
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    for step in range(steps):
        k, v = tokens[step % len(tokens)]
        for layer in layers:
            layer.update(k, v)
    return first, (time.perf_counter() - t0) / steps


def measure(factory: Callable[[int], Any], contexts: list[int], steps: int, reps: int) -> dict[int, dict[str, Timing]]:
    """Per context: seconds per decode token (all layers) in steady state, the first step's cost and
    the amortized cost, one sample per repetition. Contexts are interleaved within each repetition
    (`rotate`), so a change in machine load hits all of them alike."""
    gen = torch.Generator().manual_seed(1)
    tokens = [
        (torch.randn(BATCH, HEADS, 1, HEAD_DIM, generator=gen), torch.randn(BATCH, HEADS, 1, HEAD_DIM, generator=gen))
        for _ in range(16)
    ]
    bases = {c: prefilled(factory, c) for c in contexts}
    samples = rotate({c: lambda c=c: time_once(bases[c], tokens, steps) for c in contexts}, reps)
    out = {}
    for c, pairs in samples.items():
        first, steady = [f for f, _ in pairs], [s for _, s in pairs]
        amortized = [s + max(f - s, 0.0) / c for f, s in pairs]
        out[c] = {"steady": Timing.of(steady), "first": Timing.of(first), "amortized": Timing.of(amortized)}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="contexts 512/4096/8192, fewer repetitions")
    parser.add_argument("--window", type=int, default=4096, help="sliding window (default 4096)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1: steadier timings)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    contexts = [512, 4096, 8192] if args.quick else [512, 1024, 2048, 4096, 8192]
    steps, reps = (128, 3) if args.quick else (256, 9)
    hf_steps, hf_reps = (8, 3) if args.quick else (16, 5)
    results: dict[str, dict[int, dict[str, Timing]]] = {}
    for name, factory in kinds(args.window, room=steps + 2).items():
        slow = name.startswith("transformers")
        results[name] = measure(factory, contexts, hf_steps if slow else steps, hf_reps if slow else reps)

    print(
        f"## Decode-step append cost: batch {BATCH}, {HEADS} kv heads, head_dim {HEAD_DIM}, fp32, {LAYERS} layers, "
        f"{torch.get_num_threads()} thread(s), torch {torch.__version__}\n"
    )
    print("Steady-state median time per decode token (all layers), in µs:\n")
    print("| layer | " + " | ".join(str(c) for c in contexts) + " | 8192/512 |")
    print("| --- |" + " ---: |" * (len(contexts) + 1))
    for name, row in results.items():
        ratio = row[contexts[-1]]["steady"].median / row[contexts[0]]["steady"].median
        cells = " | ".join(f"{row[c]['steady'].median * 1e6:.1f}" for c in contexts)
        print(f"| {name} | {cells} | {ratio:.2f}x |")

    print("\nFirst decode step after the prefill (includes a growth buffer's one reallocation), in µs:\n")
    print("| layer | " + " | ".join(str(c) for c in contexts) + " |")
    print("| --- |" + " ---: |" * len(contexts))
    for name, row in results.items():
        print(f"| {name} | " + " | ".join(f"{row[c]['first'].median * 1e6:.0f}" for c in contexts) + " |")

    print("\nAmortized per token (steady + first-step extra spread over the L tokens to the next regrowth), µs:\n")
    print("| layer | " + " | ".join(str(c) for c in contexts) + " | 8192/512 |")
    print("| --- |" + " ---: |" * (len(contexts) + 1))
    for name, row in results.items():
        ratio = row[contexts[-1]]["amortized"].median / row[contexts[0]]["amortized"].median
        cells = " | ".join(f"{row[c]['amortized'].median * 1e6:.1f}" for c in contexts)
        print(f"| {name} | {cells} | {ratio:.2f}x |")

    hf = results.get("transformers DynamicLayer")
    if hf is not None and 4096 in contexts:
        print("\ntransformers DynamicLayer / kvcache at context 4096 (steady state):\n")
        print("| kvcache layer | speed-up |")
        print("| --- | ---: |")
        for name, row in results.items():
            if not name.startswith("transformers"):
                print(f"| {name} | {hf[4096]['steady'].median / row[4096]['steady'].median:.1f}x |")
    elif hf is None:
        print("\n(transformers not installed: no side-by-side comparison)")


if __name__ == "__main__":
    main()
