"""What one cache call costs next to the copy it has to make, and what growth buffers hold.

1. Per call, one decode step of one layer ([1, 8, 1, 64] fp32 keys and values, 512 tokens held):
   `DynamicLayer.update` and `SlidingWindowLayer.update` against the bare copy of the new token
   into preallocated storage (two `narrow(...).copy_()`), `StaticLayer.update` against
   transformers' `StaticLayer.update`, and `StaticLayer.crop(-k)` for k = 1, 4, 16. After each call
   the layer is put back at 512 tokens by moving its length (untimed apart: it is in every row).
   Contenders run in rotating order, 1000 calls per sample; medians.
2. Bytes a `DynamicLayer` holds per token it holds, after decoding one token at a time to N
   tokens (spare capacity included). The memory scenario has the sliding-window rows.

    python benchmarks/per_call.py [--quick]
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from kvcache import DynamicLayer, SlidingWindowLayer, StaticLayer

try:
    from .common import Section, Table, Target, Timing, rotate, run_as_script
except ImportError:  # run as a script
    from common import Section, Table, Target, Timing, rotate, run_as_script  # type: ignore[no-redef]

SHAPE = (1, 8, 1, 64)
HELD = 512
REPEATS = {"smoke": 3, "quick": 9, "full": 21}
CALLS = 1000
GROWN = {"smoke": (1000,), "quick": (1000, 4000), "full": (1000, 4000, 16000)}


def _held(layer: Any) -> Any:
    gen = torch.Generator().manual_seed(0)
    keys = torch.randn(1, SHAPE[1], HELD, SHAPE[3], generator=gen)
    layer.update(keys, keys.clone())
    return layer


def _per_call_samplers() -> dict[str, Callable[[], float]]:
    k, v = torch.randn(SHAPE), torch.randn(SHAPE)
    storage_k = torch.empty(4096, 1, SHAPE[1], SHAPE[3]).permute(1, 2, 0, 3)
    storage_v = torch.empty(4096, 1, SHAPE[1], SHAPE[3]).permute(1, 2, 0, 3)
    dynamic, sliding, static = _held(DynamicLayer()), _held(SlidingWindowLayer(4096)), _held(StaticLayer(4096))

    def bare() -> None:
        storage_k.narrow(2, HELD, 1).copy_(k)
        storage_v.narrow(2, HELD, 1).copy_(v)

    # Each call is followed by a rewind to HELD tokens that moves a length and nothing else (an
    # assignment for the growth buffers; one in-place op on the length tensor for both static layers).
    def dynamic_update() -> None:
        dynamic.update(k, v)
        dynamic._kv.end -= 1

    def sliding_update() -> None:
        sliding.update(k, v)
        sliding._kv.end -= 1
        sliding._seen -= 1

    def static_update() -> None:
        static.update(k, v)
        static._set_length(HELD)

    fns: dict[str, Callable[[], None]] = {
        "bare copy of the new token": bare,
        "kvcache DynamicLayer.update": dynamic_update,
        "kvcache SlidingWindowLayer.update": sliding_update,
        "kvcache StaticLayer.update": static_update,
    }
    try:
        from transformers.cache_utils import StaticLayer as HFStaticLayer

        theirs = _held(HFStaticLayer(4096))

        def their_update() -> None:
            theirs.update(k, v)
            theirs.cumulative_length.sub_(1)

        fns["transformers StaticLayer.update"] = their_update
    except ImportError:
        pass
    for steps in (1, 4, 16):
        layer = _held(StaticLayer(4096))
        # crop(-k), then the same rewind as above (the length back to HELD, one in-place op)
        fns[f"kvcache StaticLayer crop(-{steps})"] = lambda layer=layer, n=steps: (
            layer.crop(-n), layer._set_length(HELD)
        )

    def timed(fn: Callable[[], None]) -> Callable[[], float]:
        def sample() -> float:
            start = time.perf_counter()
            for _ in range(CALLS):
                fn()
            return (time.perf_counter() - start) / CALLS

        return sample

    return {name: timed(fn) for name, fn in fns.items()}


def per_call_scenario(mode: str) -> Section:
    section = Section("per_call", "8. Per-call cost and growth-buffer memory", (__doc__ or "").split("\n\n")[1])
    results = {name: Timing.of(v) for name, v in rotate(_per_call_samplers(), REPEATS[mode], warmup=1).items()}
    bare = results["bare copy of the new token"].median
    table = Table("One call (µs, median)", ["call", ":µs", ":x bare copy"])
    for name, t in results.items():
        table.add(name, f"{t.median * 1e6:.1f}", f"{t.median / bare:.2f}")
    section.tables.append(table)
    dynamic = results["kvcache DynamicLayer.update"].median
    section.targets.append(Target("per call: DynamicLayer.update", "<= 1.5x the bare copy",
                                  f"{dynamic / bare:.2f}x", dynamic / bare <= 1.5,
                                  "what remains is the two views the contract "
                                  "returns (one slice op each) and the shape check"))  # fmt: skip
    theirs = results.get("transformers StaticLayer.update")
    if theirs is not None:
        ours = results["kvcache StaticLayer.update"].median
        section.targets.append(Target("per call: StaticLayer.update vs transformers'", ">= 1.0x as fast",
                                      f"{theirs.median / ours:.2f}x", theirs.median >= ours,
                                      "both write in place (ours a narrowed copy_, theirs index_copy_); "
                                      "a gap this size is call overhead and timer noise on a short run"))  # fmt: skip
    crops = [results[f"kvcache StaticLayer crop(-{n})"].median for n in (1, 4, 16)]
    flat = crops[2] / crops[0]
    section.targets.append(Target("per call: StaticLayer crop(-k), k = 1 -> 16", "flat in k (<= 1.2x)",
                                  f"{flat:.2f}x", flat <= 1.2,
                                  "a crop moves one position counter; a gap is timer noise at a few µs"))  # fmt: skip

    table = Table("Bytes held per token held: DynamicLayer decoded one token at a time",
                  [":tokens", ":bytes held", ":bytes of the tokens", ":held / tokens"])  # fmt: skip
    worst = 0.0
    one = torch.zeros(1, 1, 1, 64)
    for n in GROWN[mode]:
        layer = DynamicLayer()
        for _ in range(n):
            layer.update(one, one)
        need = n * 2 * 64 * 4
        worst = max(worst, layer.nbytes() / need)
        table.add(n, f"{layer.nbytes():,}", f"{need:,}", f"{layer.nbytes() / need:.2f}x")
    section.tables.append(table)
    section.targets.append(Target("memory: DynamicLayer allocation", "<= 1.5x its tokens", f"up to {worst:.2f}x",
                                  worst <= 1.5,
                                  "the buffer grows geometrically; see the growth factor in KVBuffer"))  # fmt: skip
    return section


if __name__ == "__main__":
    run_as_script(per_call_scenario, __doc__)
