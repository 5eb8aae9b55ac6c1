"""Speculative decoding against plain greedy decoding, side by side in one run.

1. Tokens per second, target forwards per token and acceptance, for plain `generate` and for
   `speculative_generate` with (a) a draft that is a smaller reference model: the target's own
   first layer with its embeddings and head (self-speculative / early exit), (b) the prompt-lookup
   (n-gram) drafter on a repetitive prompt. Decoder (full + sliding layers) and hybrid recurrent
   targets; for the hybrid, rollback by intermediate states and by re-feeding.
2. Memory held by rollback bookkeeping against k: cache bytes right after a verify forward of
   k + 1 tokens while recording, minus the bytes after the same forward without recording.

Greedy, batch 1, no eos; every contender must produce the same tokens ("same" column). Figures are
medians over `--repeats` rounds; contenders run back to back in rotating order within a round.
The decoder and hybrid models are randomly initialised (no training): with tied embeddings and
small weights their greedy text mostly repeats the current token, so the early-exit draft and the
n-gram drafter are right unusually often. The "unrelated draft" rows (a draft whose guesses are
noise) show the other extreme: the price of rejection, and of re-feeding where a recurrent target
cannot hand over intermediate states. The bundled trained character model, when its weights are
present, gives realistic acceptance on text.

    python benchmarks/speculative.py [--quick] [--new-tokens N] [--repeats R]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from kvcache.generation import PromptLookupDrafter, generate, speculative_generate
from kvcache.generation.speculative_runner import ModelRunner
from kvcache.models import DecoderConfig, DecoderLM, HybridConfig, HybridLM


class Counted:
    """Forwards calls and attributes to a model, counting the calls."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.calls = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)

    def __call__(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        self.calls += 1
        return self.model(*args, **kwargs)


def first_layers(target: torch.nn.Module, num_layers: int) -> torch.nn.Module:
    """A smaller model of the same class: the target's first `num_layers` blocks, embeddings, norm
    and head (weights copied), i.e. an early-exit draft."""
    config = type(target.config)(**{**target.config.to_dict(), "layer_types": target.config.layer_types[:num_layers]})
    draft = type(target)(config)
    draft.load_state_dict(target.state_dict(), strict=False)
    return draft.eval()


def unrelated_draft(target: torch.nn.Module) -> torch.nn.Module:
    """A one-layer model of the target's class with other, larger, untied weights: its guesses are
    noise to the target, so nearly every draft token is rejected (the worst case)."""
    torch.manual_seed(123)
    config = {**target.config.to_dict(), "layer_types": target.config.layer_types[:1], "tie_word_embeddings": False}
    draft = type(target)(type(target.config)(**config))
    with torch.no_grad():
        for param in draft.parameters():
            if param.dim() > 1:
                param.mul_(8)
    return draft.eval()


def run(name: str, fn: Callable[[], Any], counted: Counted, new_tokens: int, repeats: int) -> dict[str, Any]:
    """Median seconds of `fn` over `repeats`, and the forwards/acceptance of its last run."""
    seconds = []
    out = None
    for _ in range(repeats):
        counted.calls = 0
        start = time.perf_counter()
        out = fn()
        seconds.append(time.perf_counter() - start)
    calls = counted.calls - 1  # the prefill
    stats = {"name": name, "seconds": statistics.median(seconds), "forwards": calls, "out": out}
    if hasattr(out, "accepted_per_step"):
        stats["accepted"] = sum(out.accepted_per_step) / max(len(out.accepted_per_step), 1)
        stats["rate"] = out.acceptance_rate
        stats["refeeds"] = out.target_rollback_paths["refeed"]
    return stats


def compare(title: str, target: Any, contenders: dict[str, Callable[[], Any]], new_tokens: int, repeats: int) -> None:
    counted = target
    results: dict[str, dict[str, Any]] = {}
    names = list(contenders)
    for name in names:  # warm-up
        contenders[name]()
    for round_ in range(repeats):  # rotating order, one repetition per contender per round
        for name in names[round_ % len(names) :] + names[: round_ % len(names)]:
            r = run(name, contenders[name], counted, new_tokens, 1)
            if name in results:
                results[name]["all"].append(r["seconds"])
            else:
                results[name] = {**r, "all": [r["seconds"]]}
    sequences = {n: (r["out"].sequences if hasattr(r["out"], "sequences") else r["out"]) for n, r in results.items()}
    first = sequences[names[0]]
    print(f"### {title}\n")
    print("| decoding | tok/s | speed-up | target forwards / token | accepted / step | acceptance | re-feeds | same |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
    base = new_tokens / statistics.median(results[names[0]]["all"])
    for name in names:
        r = results[name]
        rate = new_tokens / statistics.median(r["all"])
        same = "yes" if torch.equal(sequences[name], first) else "NO"
        acc = f"{r['accepted']:.2f}" if "accepted" in r else "-"
        acceptance = f"{r['rate']:.0%}" if "rate" in r else "-"
        refeeds = str(r["refeeds"]) if "refeeds" in r else "-"
        print(
            f"| {name} | {rate:.0f} | {rate / base:.2f} | {r['forwards'] / new_tokens:.2f} | {acc} | {acceptance} "
            f"| {refeeds} | {same} |"
        )
    print()


def contenders_for(
    target: Counted,
    draft: Any,
    prompt: torch.Tensor,
    ks: list[int],
    new_tokens: int,
    bad_draft: Any = None,
    draft_label: str = "draft = first layer",
) -> dict[str, Callable[[], Any]]:
    """Plain `generate`, then per k: the model draft (and its re-feed variant for a hybrid) and
    prompt lookup; with `bad_draft` (an unrelated model that is almost never right), the cost of
    rejections with and without intermediate states."""
    hybrid = isinstance(target.model, HybridLM)
    contenders: dict[str, Callable[[], Any]] = {
        "plain `generate`": lambda: generate(target, prompt, max_new_tokens=new_tokens).sequences
    }
    for k in ks:
        contenders[f"{draft_label}, k={k}"] = lambda k=k: speculative_generate(
            target, draft, prompt, num_draft_tokens=k, max_new_tokens=new_tokens
        )
        if hybrid:
            contenders[f"{draft_label}, k={k}, re-feed"] = lambda k=k: speculative_generate(
                target, draft, prompt, num_draft_tokens=k, max_new_tokens=new_tokens, intermediate_states=False
            )
        contenders[f"prompt lookup, k={k}"] = lambda k=k: speculative_generate(
            target, PromptLookupDrafter(), prompt, num_draft_tokens=k, max_new_tokens=new_tokens
        )
    if bad_draft is not None:
        k = ks[len(ks) // 2]
        contenders[f"unrelated draft, k={k}"] = lambda: speculative_generate(
            target, bad_draft, prompt, num_draft_tokens=k, max_new_tokens=new_tokens
        )
        if hybrid:
            contenders[f"unrelated draft, k={k}, re-feed"] = lambda: speculative_generate(
                target, bad_draft, prompt, num_draft_tokens=k, max_new_tokens=new_tokens, intermediate_states=False
            )
    return contenders


def speed(new_tokens: int, repeats: int, ks: list[int]) -> None:
    torch.manual_seed(0)
    decoder_config = DecoderConfig(
        vocab_size=256, hidden_size=256, intermediate_size=512, num_heads=8, num_kv_heads=2,
        layer_types=["full_attention", "sliding_attention"] * 4, sliding_window=32,
    )  # fmt: skip
    hybrid_config = HybridConfig(
        vocab_size=256, hidden_size=128, intermediate_size=256,
        layer_types=["linear_attention", "full_attention", "hybrid", "sliding_attention"] * 2,
    )  # fmt: skip
    random_prompt = torch.randint(0, 256, (1, 32), generator=torch.Generator().manual_seed(1))
    repetitive_prompt = torch.arange(16).repeat(1, 4)  # "0 1 ... 15" four times
    targets = {
        "decoder, 8 layers (full + sliding)": DecoderLM(decoder_config).eval(),
        "hybrid, 8 layers": HybridLM(hybrid_config).eval(),
    }
    for label, model in targets.items():
        target, draft = Counted(model), first_layers(model, 1)
        unrelated = unrelated_draft(model)
        for prompt_name, prompt in (("random prompt", random_prompt), ("repetitive prompt", repetitive_prompt)):
            bad = unrelated if prompt is random_prompt else None
            contenders = contenders_for(target, draft, prompt, ks, new_tokens, bad)
            compare(f"{label}, {prompt_name}, {new_tokens} new tokens", target, contenders, new_tokens, repeats)


def default_model_speed(new_tokens: int, repeats: int, ks: list[int]) -> None:
    """The bundled trained character model (4 layers), when its weights are there, drafted by its
    own first 2 layers and by prompt lookup, on help text and on a repetitive code prompt."""
    try:
        from pydoc_data.topics import topics

        from kvcache.models import load_default_model

        model, tokenizer = load_default_model()
    except Exception as err:  # weights missing in a bare checkout: say so, measure the rest
        print(f"(bundled default model skipped: {err})\n")
        return
    corpus = "\n".join(topics[key] for key in sorted(topics))  # the training text
    prompts = {"help text": corpus[1000:1300], "repetitive code": "for i in range(10):\n    print(i)\n" * 4}
    target, draft = Counted(model), first_layers(model, 2)
    for name, text in prompts.items():
        prompt = torch.tensor([tokenizer.encode(text)])
        contenders = contenders_for(target, draft, prompt, ks, new_tokens, draft_label="draft = first 2 layers")
        title = f"bundled default model (trained, 4 layers), {name} prompt, {new_tokens} new tokens"
        compare(title, target, contenders, new_tokens, repeats)


def cache_bytes(cache: Any) -> int:
    """Bytes of the tensors a cache holds for its content and rollback history (live views)."""
    return sum(t.nbytes for layer in cache for t in layer.state.values())


def bookkeeping(ks: list[int]) -> None:
    torch.manual_seed(0)
    models = {
        "full attention": DecoderLM(DecoderConfig(vocab_size=256, layer_types=["full_attention"])),
        "sliding window 8": DecoderLM(
            DecoderConfig(vocab_size=256, layer_types=["sliding_attention"], sliding_window=8)
        ),
        "recurrent (intermediate states)": HybridLM(HybridConfig(vocab_size=256, layer_types=["linear_attention"])),
        "recurrent (no intermediate states)": HybridLM(HybridConfig(vocab_size=256, layer_types=["linear_attention"])),
    }
    models["recurrent (intermediate states)"].set_return_intermediate_states(True)
    print("### Rollback bookkeeping: extra cache bytes right after verifying k + 1 tokens (one layer)\n")
    print("| layer kind | committed bytes | " + " | ".join(f"k={k}" for k in ks) + " | extra per verified token |")
    print("| --- | ---: | " + " | ".join("---:" for _ in ks) + " | ---: |")
    prompt = list(range(1, 65))
    for label, model in models.items():
        extras = []
        committed = 0
        for k in ks:
            sizes = []
            for recording in (True, False):
                runner = ModelRunner(model.eval(), device=torch.device("cpu"))
                runner.feed(prompt)
                if recording:
                    runner.start_recording()
                committed = cache_bytes(runner.cache)
                runner.feed(list(range(100, 101 + k)))
                sizes.append(cache_bytes(runner.cache))
            extras.append(sizes[0] - sizes[1])
        slope = (extras[-1] - extras[0]) / (ks[-1] - ks[0]) if len(ks) > 1 else float("nan")
        print(f"| {label} | {committed} | " + " | ".join(str(e) for e in extras) + f" | {slope:.0f} |")
    print(
        "\nFull attention keeps every token anyway (no extra); a sliding window keeps the k + 1 verified "
        "tokens beyond its window (W - 1 + r); a recurrent layer keeps the state before the step, plus "
        "k intermediate states when the model hands them over (1 + r states), plus its conv inputs. "
        "All of it is released by the commit after each step.\n"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer tokens and repeats (a smoke run)")
    parser.add_argument("--new-tokens", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=None)
    args = parser.parse_args()
    new_tokens = args.new_tokens or (24 if args.quick else 96)
    repeats = args.repeats or (1 if args.quick else 5)
    ks = [2, 4] if args.quick else [2, 4, 8]
    torch.set_num_threads(1)  # tiny models: threads only add synchronisation
    print(f"## Speculative decoding (greedy, batch 1, CPU, torch {torch.__version__}, 1 thread)\n")
    with torch.no_grad():
        speed(new_tokens, repeats, ks)
        default_model_speed(new_tokens, repeats, ks)
        bookkeeping([1, 2, 4, 8])


if __name__ == "__main__":
    main()
