"""Overhead of `kvcache.generation.generate`, measured side by side in one run.

1. Tokens per second of `generate` (immediate and deferred stop check) against a bare loop that
   calls the model with the cache and takes the argmax, on the reference models (and the bundled
   default model when its weights are there). Target: within 10% on the smallest model.
2. When transformers is installed: `generate` on a tiny randomly initialised LlamaForCausalLM
   (through `kvcache.integrations.transformers.wrap_model`) against transformers' own `generate`,
   greedy, checking that both produce identical tokens.

Greedy decoding, batch 1, no eos (every run makes exactly `--new-tokens` tokens). Figures are
medians over `--repeats` rounds; within a round the contenders run back to back, in rotating order.

    python benchmarks/generation.py [--quick] [--new-tokens N] [--repeats R]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import torch

from kvcache.generation import generate
from kvcache.models import (
    DecoderConfig,
    DecoderLM,
    EncoderDecoderConfig,
    EncoderDecoderLM,
    HybridConfig,
    HybridLM,
)

try:
    from .common import Timing, rotate_timings
except ImportError:  # run as a script: python benchmarks/generation.py
    from common import Timing, rotate_timings  # type: ignore[no-redef]


def bare_loop(model, ids: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """The least a decoder-only greedy loop can do: prefill, then model + argmax per token."""
    cache = model.new_cache()
    with torch.no_grad():
        logits = model(ids, cache=cache)[:, -1]
        out = []
        for step in range(new_tokens):
            token = logits.argmax(-1)
            out.append(token)
            if step < new_tokens - 1:
                logits = model(token[:, None], cache=cache)[:, -1]
    return torch.cat([ids, torch.stack(out, 1)], 1)


def bare_loop_encoder_decoder(model, ids: torch.Tensor, new_tokens: int) -> torch.Tensor:
    cache = model.new_cache()
    with torch.no_grad():
        encoded = model.encode(ids)
        token = torch.full((ids.shape[0],), model.decoder_start_token_id, dtype=torch.long)
        out = [token]
        for _ in range(new_tokens):
            token = model(token[:, None], cache=cache, encoder_hidden_states=encoded)[:, -1].argmax(-1)
            out.append(token)
    return torch.stack(out, 1)


def compare(contenders: dict[str, Callable[[], torch.Tensor]], repeats: int) -> tuple[dict[str, Timing], bool]:
    """Seconds per contender (one warm-up round, then rotating order each round) and whether all
    outputs agree."""
    outputs: dict[str, torch.Tensor] = {}

    def sampler(name: str) -> Callable[[], float]:
        def sample() -> float:
            start = time.perf_counter()
            outputs[name] = contenders[name]()
            return time.perf_counter() - start

        return sample

    times = rotate_timings({name: sampler(name) for name in contenders}, repeats, warmup=1)
    first = next(iter(outputs.values()))
    return times, all(torch.equal(first, out) for out in outputs.values())


def reference_models(quick: bool) -> dict[str, object]:
    torch.manual_seed(0)
    models: dict[str, object] = {
        "decoder (2 layers, full + sliding)": DecoderLM(DecoderConfig(vocab_size=256)).eval(),
        "hybrid (recurrent, full, hybrid, sliding)": HybridLM(HybridConfig(vocab_size=256)).eval(),
        "encoder-decoder (2 + 2 layers)": EncoderDecoderLM(EncoderDecoderConfig(vocab_size=256)).eval(),
    }
    if not quick:
        try:
            from kvcache.models import load_default_model

            models["bundled default model"] = load_default_model()[0]
        except Exception as err:  # weights missing in a bare checkout: say so, measure the rest
            print(f"(default model skipped: {err})")
    return models


def contenders(model, ids: torch.Tensor, new_tokens: int) -> dict[str, Callable[[], torch.Tensor]]:
    """The bare loop and `generate` with each stop check, on the same model and prompt."""
    loop = bare_loop_encoder_decoder if getattr(model, "is_encoder_decoder", False) else bare_loop
    return {
        "bare": lambda: loop(model, ids, new_tokens),
        "immediate": lambda: generate(model, ids, max_new_tokens=new_tokens, defer_stop=False).sequences,
        "deferred": lambda: generate(model, ids, max_new_tokens=new_tokens, defer_stop=True).sequences,
    }


class NullModel:
    """A model that costs nothing: fixed logits, no cache writes. Timing `generate` with it
    isolates the driver's own per-token cost."""

    vocab_size = 256

    def __init__(self) -> None:
        self.logits = torch.randn(1, 1, self.vocab_size, generator=torch.Generator().manual_seed(0))

    def new_cache(self):
        from kvcache import DynamicCache

        return DynamicCache()

    def __call__(self, input_ids: torch.Tensor, **kwargs) -> torch.Tensor:
        return self.logits.expand(input_ids.shape[0], input_ids.shape[1], -1)


def pure_overhead_timings(new_tokens: int, repeats: int) -> dict[str, Timing]:
    """Seconds of each loop with the zero-cost model: the driver's own cost."""
    model = NullModel()
    ids = torch.zeros(1, 16, dtype=torch.long)
    return compare(contenders(model, ids, new_tokens), repeats)[0]


def pure_overhead(new_tokens: int, repeats: int) -> None:
    medians = pure_overhead_timings(new_tokens, repeats)
    print(f"## Driver cost per token with a zero-cost model ({new_tokens} new tokens)\n")
    print("| loop | microseconds per token |")
    print("| --- | ---: |")
    labels = {"bare": "bare loop", "immediate": "generate, StopCheck", "deferred": "generate, DeferredStopCheck (CPU)"}
    for name, label in labels.items():
        print(f"| {label} | {medians[name].median / new_tokens * 1e6:.1f} |")
    print()


def driver_timings(new_tokens: int, repeats: int, quick: bool) -> dict[str, tuple[dict[str, Timing], bool]]:
    """Per reference model: seconds of the bare loop and of `generate`, and whether they agree."""
    out = {}
    for name, model in reference_models(quick).items():
        ids = torch.randint(0, model.vocab_size, (1, 16), generator=torch.Generator().manual_seed(1))
        out[name] = compare(contenders(model, ids, new_tokens), repeats)
    return out


def driver_overhead(new_tokens: int, repeats: int, quick: bool) -> None:
    print(f"## `generate` against a bare loop (greedy, batch 1, {new_tokens} new tokens, prompt 16)\n")
    print("| model | bare loop tok/s | generate tok/s (immediate) | ratio | generate tok/s (deferred) | ratio "
          "| same tokens |")  # fmt: skip
    print("| --- | ---: | ---: | ---: | ---: | ---: | --- |")
    for name, (timings, agree) in driver_timings(new_tokens, repeats, quick).items():
        rate = {k: new_tokens / v.median for k, v in timings.items()}
        print(
            f"| {name} | {rate['bare']:.0f} | {rate['immediate']:.0f} | {rate['immediate'] / rate['bare']:.2f} "
            f"| {rate['deferred']:.0f} | {rate['deferred'] / rate['bare']:.2f} | {'yes' if agree else 'NO'} |"
        )
    print()


def transformers_timings(new_tokens: int, repeats: int) -> dict[str, Any] | str:
    """On a tiny random LlamaForCausalLM: seconds of transformers' `generate`, of ours (through
    `wrap_model`) and of a bare loop, and whether all three agree; or why it was skipped."""
    try:
        import transformers
        from transformers import LlamaConfig, LlamaForCausalLM

        from kvcache.integrations.transformers import wrap_model
    except ImportError as err:
        return f"transformers comparison skipped: {err}"
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=1024, eos_token_id=None, pad_token_id=0,
    )  # fmt: skip
    hf_model = LlamaForCausalLM(config).eval()
    hf_model.generation_config.eos_token_id = None
    hf_model.generation_config.pad_token_id = 0
    wrapped = wrap_model(hf_model)
    ids = torch.randint(1, config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(1))

    def theirs() -> torch.Tensor:
        return hf_model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)

    def ours() -> torch.Tensor:
        return generate(wrapped, ids, max_new_tokens=new_tokens).sequences

    timings, agree = compare(
        {"transformers": theirs, "kvcache": ours, "bare": lambda: bare_loop(wrapped, ids, new_tokens)}, repeats
    )
    return {"version": transformers.__version__, "timings": timings, "agree": agree}


def against_transformers(new_tokens: int, repeats: int) -> None:
    result = transformers_timings(new_tokens, repeats)
    if isinstance(result, str):
        print(f"({result})\n")
        return
    timings = result["timings"]
    print(f"## kvcache `generate` against transformers {result['version']} `generate`")
    print(f"(tiny random LlamaForCausalLM, 2 layers, greedy, batch 1, {new_tokens} new tokens)\n")
    print("| driver | tok/s | relative | identical tokens |")
    print("| --- | ---: | ---: | --- |")
    base = new_tokens / timings["transformers"].median
    labels = {"transformers": "transformers `generate`", "kvcache": "kvcache `generate`", "bare": "bare loop"}
    for name, label in labels.items():
        rate = new_tokens / timings[name].median
        print(f"| {label} | {rate:.0f} | {rate / base:.2f} | {'yes' if result['agree'] else 'NO'} |")
    print()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer tokens and repeats (a smoke run)")
    parser.add_argument("--new-tokens", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=None)
    args = parser.parse_args()
    new_tokens = args.new_tokens or (32 if args.quick else 200)
    repeats = args.repeats or (3 if args.quick else 7)
    torch.set_num_threads(1)  # a shared machine: single-threaded figures are the stable ones
    pure_overhead(new_tokens, repeats)
    driver_overhead(new_tokens, repeats, args.quick)
    against_transformers(new_tokens, repeats)


if __name__ == "__main__":
    main()
