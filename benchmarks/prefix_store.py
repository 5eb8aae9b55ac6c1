"""The prefix store: time to first token on a hit against a cold prompt, and bytes per stored prefix.

1. Time to first token (`generate(..., max_new_tokens=1)`) for prompts of 1k and 4k tokens whose
   all but the last 64 tokens are stored, on the bundled default model and on the reference hybrid
   model (recurrent, full, parallel-hybrid and sliding layers): cold (nothing stored), hit, and
   "the rest alone": the same 64 tokens fed onto a ready copy of the prefix's cache, which is what
   a hit cannot avoid. Target: hit within 1.2x of the rest alone.
2. Bytes a store holds for 16 prompts that share a 1k-token system prompt (each adds 128 tokens of
   its own), against a naive prompt cache that keeps a full cache per prompt and against the bytes
   of the distinct tokens (their keys/values in every attention layer, plus one recurrent state
   per prompt). Target: within 1.2x of that. A stricter bound is shown too: a cache's growth per
   token times the distinct tokens, plus its bounded part (windows, states) once per prompt; the
   store keeps the bounded part at every chunk boundary, so it exceeds that.

3. Per-operation cost against 100 to 100,000 entries held, for the memory, directory and Redis
   backends, and a cold prompt into a full store (`store_scale.py`, its docstring says how).

Chunks of 64 tokens, in-memory backend (1 and 2), one thread, medians of rotating rounds.

    python benchmarks/prefix_store.py [--quick]
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from kvcache.generation import generate
from kvcache.models import HybridConfig, HybridLM
from kvcache.store import PrefixStore

try:
    from .common import Section, Table, Target, Timing, rotate, run_as_script, section_of
except ImportError:  # run as a script
    from common import Section, Table, Target, Timing, rotate, run_as_script, section_of  # type: ignore[no-redef]

CHUNK = 64
REST = 64
SIZES = {"smoke": ((256,), 1, 4), "quick": ((512,), 2, 16), "full": ((1024, 4096), 5, 16)}  # (prompts, reps, shared)


def _models() -> dict[str, Any]:
    out: dict[str, Any] = {}
    try:
        from kvcache.models import load_default_model

        out["bundled default model"] = load_default_model()[0]
    except Exception:  # weights missing in a bare checkout
        pass
    torch.manual_seed(0)
    out["reference hybrid"] = HybridLM(HybridConfig(vocab_size=256)).eval()
    return out


def _vocab(model: Any) -> int:
    return int(model.vocab_size)


def ttft_table(mode: str) -> tuple[Table, list[Target], dict[str, Any]]:
    lengths, repeats, _ = SIZES[mode]
    columns = ["model", ":prompt tokens", ":cold", ":hit", ":rest alone", ":hit / rest alone", ":cold / hit"]
    table = Table("Time to first token (ms): cold, on a hit, and the un-stored rest alone", columns)
    figures: dict[str, Any] = {}
    worst = 0.0
    for name, model in _models().items():
        for length in lengths:
            gen = torch.Generator().manual_seed(length)
            ids = torch.randint(1, _vocab(model), (1, length), generator=gen)
            stored = (length - REST) // CHUNK * CHUNK
            store = PrefixStore(chunk_size=CHUNK, max_bytes=1 << 34)
            store.prefill(model, ids[0, : stored + 1].tolist())  # stores `stored` tokens
            ready = store.lookup(ids[0].tolist(), model)[1]

            def cold(m: Any = model, i: torch.Tensor = ids) -> Any:
                return generate(m, i, max_new_tokens=1)

            def hit(m: Any = model, i: torch.Tensor = ids, s: PrefixStore = store) -> Any:
                return generate(m, i, max_new_tokens=1, prefix_store=s)  # the rest is under a chunk: stores nothing

            def rest(m: Any = model, i: torch.Tensor = ids, c: Any = ready) -> Any:
                return generate(m, i, cache=c.copy(), max_new_tokens=1)

            samplers: dict[str, Callable[[], float]] = {}
            for key, fn in (("cold", cold), ("hit", hit), ("rest", rest)):
                samplers[key] = lambda fn=fn: _seconds(fn)
            t = {k: Timing.of(v) for k, v in rotate(samplers, repeats, warmup=1).items()}
            ratio = t["hit"].median / t["rest"].median
            worst = max(worst, ratio)
            figures[f"{name}|{length}"] = {k: v for k, v in t.items()}
            table.add(name, length, t["cold"].cell(1e3), t["hit"].cell(1e3), t["rest"].cell(1e3), f"{ratio:.2f}x",
                      f"{t['cold'].median / t['hit'].median:.1f}x")  # fmt: skip
    targets = [Target("prefix store: time to first token on a hit", "<= 1.2x the un-stored rest alone",
                      f"up to {worst:.2f}x", worst <= 1.2,
                      "a hit also hashes the prompt's chunks and rebuilds the cache "
                      "from them; the rest-alone run starts from a copy of a ready cache")]  # fmt: skip
    return table, targets, figures


def _seconds(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def memory_table(mode: str) -> tuple[Table, list[Target], dict[str, Any]]:
    _, _, prompts = SIZES[mode]
    system, own = (1024, 128) if mode != "smoke" else (128, 64)
    table = Table(f"Bytes for {prompts} prompts sharing a {system}-token system prompt ({own} own tokens each)",
                  ["model", ":store", ":full cache per prompt", ":distinct tokens' bytes", ":store / distinct",
                   ":store / strict bound", ":per-prompt copies / store"])  # fmt: skip
    figures: dict[str, Any] = {}
    worst = 0.0
    for name, model in _models().items():
        gen = torch.Generator().manual_seed(7)
        head = torch.randint(1, _vocab(model), (system,), generator=gen).tolist()
        store = PrefixStore(chunk_size=CHUNK, max_bytes=1 << 34)
        naive = 0
        for _ in range(prompts):
            tokens = head + torch.randint(1, _vocab(model), (own,), generator=gen).tolist()
            store.prefill(model, [*tokens, 0])  # every whole chunk of `tokens` is stored
            naive += _cache_bytes(store.lookup(tokens, model)[1])  # what a naive prompt cache keeps per prompt
        total = system + prompts * own
        kv_per_token, states = _per_token_and_states(store.lookup([*head, 0], model)[1])
        distinct = int(kv_per_token * total + prompts * states)  # every distinct token's keys/values, in every layer
        # stricter: a cache's bytes grow with its tokens by `grow` per token and hold the rest once
        one, two = (_cache_bytes(store.lookup([*head[: n * CHUNK], 0], model)[1]) for n in (1, 2))
        grow = (two - one) / CHUNK
        strict = int(grow * total + prompts * (one - grow * CHUNK))
        ratio = store.nbytes / distinct
        worst = max(worst, ratio)
        figures[name] = {"store": store.nbytes, "naive": naive, "distinct": distinct, "strict": strict}
        table.add(name, f"{store.nbytes:,}", f"{naive:,}", f"{distinct:,}", f"{ratio:.2f}x",
                  f"{store.nbytes / strict:.2f}x", f"{naive / store.nbytes:.1f}x")  # fmt: skip
    targets = [Target("prefix store: bytes for prompts sharing a system prompt",
                      "<= 1.2x the distinct tokens' bytes", f"up to {worst:.2f}x", worst <= 1.2,
                      "bounded states are kept at every chunk boundary")]  # fmt: skip
    return table, targets, figures


def _per_token_and_states(cache: Any) -> tuple[float, int]:
    """Keys/values bytes per token summed over the attention layers (sliding ones too: a token's
    keys/values cost the same there), and the bytes of the recurrent states."""
    per_token, states = 0.0, 0
    for layer in cache:
        parts = [layer.attention, layer.recurrent] if hasattr(layer, "attention") else [layer]
        for part in parts:
            held = part.state
            if part.has_attention and "keys" in held:
                per_token += (held["keys"].nbytes + held["values"].nbytes) / max(held["keys"].shape[2], 1)
            else:
                states += sum(t.nbytes for t in held.values())
    return per_token, states


def _cache_bytes(cache: Any) -> int:
    return sum(t.nbytes for layer in cache for t in layer.state.values())


def prefix_store_scenario(mode: str) -> Section:
    try:
        from .store_scale import cold_into_full_table, scale_table
    except ImportError:  # run as a script
        from store_scale import cold_into_full_table, scale_table  # type: ignore[no-redef]

    title = "9. The prefix store: time to first token on a hit, bytes per prefix, and cost at scale"
    at_scale = (scale_table, cold_into_full_table) if mode != "quick" else ()  # a full run's question
    section = section_of("prefix_store", title, __doc__, (ttft_table, memory_table, *at_scale), mode)
    return section


if __name__ == "__main__":
    run_as_script(prefix_store_scenario, __doc__)
