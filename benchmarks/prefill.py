"""Prefill: what feeding a prompt costs against the one whole-prompt forward it cannot avoid.

The bundled model (2 full and 2 sliding-window layers, window 32) with a fresh cache: one forward
over the whole prompt; `generate(max_new_tokens=0)` (which prefills all but the last token in one
forward); and the CLI's path, `prefill_blocks` in position-aligned blocks of `PREFILL_BLOCK` tokens
then the rest through `generate` (the blocks are what makes a resumed run exact). Prompts of 1k,
4k and 16k tokens (quick: 1k and 4k), medians of rotated rounds on one thread. Targets: both paths
within 1.3x of one forward at every length, one forward at 4,096 tokens <= 7x the one at 1,024.
Then `kvcache generate` itself, in a subprocess at its default thread count, on a prompt of
100,000 characters (quick: 20,000): tokens per second of its prefill (target >= 1,000 on the
2-core machine) and whether progress lines reached stderr.

    python benchmarks/prefill.py [--quick]
"""

from __future__ import annotations

import os
import random
import re
import subprocess
import sys
from typing import Any

import torch

from kvcache.cli.generate import PREFILL_BLOCK
from kvcache.generation import generate
from kvcache.generation.blocks import prefill_blocks, whole_blocks
from kvcache.models import load_default_model

try:
    from .common import Section, Table, Target, ratio, rotate_timings, run_as_script, seconds, section_of
except ImportError:  # run as a script
    from common import Section, Table, Target, ratio, rotate_timings, run_as_script, seconds, section_of  # type: ignore[no-redef]

#: (prompt lengths, rounds, characters of the CLI's prompt) per mode
SIZES = {"smoke": ((512, 1024), 1, 3_000), "quick": ((1024,), 3, 10_000),
         "full": ((1024, 4096, 16384), 3, 100_000)}  # fmt: skip


def _paths(model: Any, ids: torch.Tensor) -> dict[str, Any]:
    whole = whole_blocks(ids.shape[1], PREFILL_BLOCK)

    def blocks() -> Any:
        cache = prefill_blocks(model, ids, model.new_cache(), block=PREFILL_BLOCK, end=whole)
        return generate(model, ids, cache=cache, max_new_tokens=0)

    return {
        "one forward": lambda: model(ids[:, :-1], cache=model.new_cache()),
        "generate": lambda: generate(model, ids, max_new_tokens=0),
        f"CLI: blocks of {PREFILL_BLOCK}": blocks,
    }


def forward_table(mode: str) -> tuple[Table, list[Target], dict[str, Any]]:
    lengths, rounds, _ = SIZES[mode]
    model, _ = load_default_model()
    table = Table("Bundled model: prefilling a prompt into a fresh cache (ms), against one whole-prompt forward",
                  ["prompt tokens", "path", ":ms", ":/ one forward", ":tokens/s"])  # fmt: skip
    targets: list[Target] = []
    figures: dict[str, Any] = {}
    forward: dict[int, float] = {}
    for tokens in lengths:
        ids = torch.randint(1, model.vocab_size, (1, tokens))
        paths = _paths(model, ids)
        timings = rotate_timings({name: (lambda f=f: seconds(f)) for name, f in paths.items()}, rounds, warmup=1)
        base = timings["one forward"]
        forward[tokens] = base.median
        for name, t in timings.items():
            vs = ratio(t, base)
            table.add(f"{tokens:,}", name, t.cell(1e3, 1), f"{vs:.2f}x", f"{(tokens - 1) / t.median:,.0f}")
            figures[f"{tokens}|{name}"] = t
            if name != "one forward":
                targets.append(Target(f"prefill: {name} at {tokens:,} tokens", "<= 1.3x one forward", f"{vs:.2f}x",
                                      vs <= 1.3, "the blocks' attention reads the cache once per block; a miss at "
                                      "small prompts on a smoke run's single round is noise"))  # fmt: skip
    if 1024 in forward and 4096 in forward:
        growth = forward[4096] / forward[1024]
        targets.append(Target("prefill: one forward at 4,096 tokens against 1,024", "<= 7x", f"{growth:.2f}x",
                              growth <= 7, "attention's quadratic part grew beyond the scores themselves (a "
                              "materialized mask, a copy of the keys per query block)"))  # fmt: skip
    return table, targets, figures


def _prompt(chars: int) -> str:
    words = ("the", "cache", "holds", "every", "token", "but", "last", "one", "so", "a", "later", "call", "feeds",
             "only", "what", "is", "new")  # fmt: skip
    rng = random.Random(0)
    text = ""
    while len(text) < chars:
        text += rng.choice(words) + " "
    return text[:chars]


def cli_table(mode: str) -> tuple[Table, list[Target], dict[str, Any]]:
    chars = SIZES[mode][2]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("OMP_NUM_THREADS", None)
    result = subprocess.run([sys.executable, "-m", "kvcache", "generate", "-", "--max-new-tokens", "4"],
                            input=_prompt(chars), capture_output=True, text=True, timeout=900, env=env)  # fmt: skip
    found = re.search(r"prompt: (\d+) tokens, 0 reused from the cache, (\d+) prefilled in ([\d.]+) ms", result.stderr)
    table = Table("`kvcache generate` on a long prompt (its default threads; stderr not a terminal)",
                  ["prompt characters", ":tokens prefilled", ":seconds", ":tokens/s", "progress lines"])  # fmt: skip
    if result.returncode != 0 or found is None:
        raise RuntimeError(f"kvcache generate failed: {result.stderr[-2000:]}")
    prefilled, ms = int(found.group(2)), float(found.group(3))
    rate = prefilled / (ms / 1e3)
    progress = sum(line.startswith("prefill:") for line in result.stderr.splitlines())
    table.add(f"{chars:,}", f"{prefilled:,}", f"{ms / 1e3:.1f}", f"{rate:,.0f}", str(progress))
    targets = []
    if mode == "full":
        targets.append(Target("prefill: the CLI on a 100,000-character prompt", ">= 1,000 tokens/s, progress shown",
                              f"{rate:,.0f} tokens/s, {progress} progress line(s)", rate >= 1000 and progress > 0,
                              "a slower machine, or fewer cores than the 2 this was set for"))  # fmt: skip
    return table, targets, {"tokens": prefilled, "seconds": ms / 1e3, "progress_lines": progress}


def prefill_scenario(mode: str) -> Section:
    title = "13. Prefill: blocks, generate and the CLI against one whole-prompt forward"
    return section_of("prefill", title, __doc__, (forward_table, cli_table), mode)


if __name__ == "__main__":
    run_as_script(prefill_scenario, __doc__)
