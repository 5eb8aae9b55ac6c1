"""Quantized KV layers: what they cost in quality, what they save in memory, what a decode step
costs, against the full-precision cache (and transformers' `QuantizedCache`, quanto backend, where
optimum-quanto is installed).

1. Quality: the model reads a text teacher-forced in chunks of 64 tokens through a full-precision
   cache and through a quantized one (int8, int4; groups of 32, 64, 128 along head_dim, capped at
   the head size); the mean KL divergence of the next-token distributions, how often their argmax
   agrees, and the change in
   cross-entropy (nats per character for the bundled model, on its held-out text: the last 5% of
   its training corpus). Models: the bundled default model (head_dim 32), a tiny random Llama
   (head_dim 128) and a random sliding-window decoder (head_dim 64). Targets (bundled model):
   int8 KL <= 1e-4 and next-token argmax agreement >= 99.8%, int4 KL <= 4e-3 and agreement >=
   98.5%, and greedy output identical to full precision at int8 for 200 tokens. The random
   models' figures are shown as measured (their distributions are flat).
2. Memory: bytes per token and layer held, from the tensors' storage, after 4k and 16k tokens of
   [1, 8 heads, T, head_dim] keys/values, against a float16 cache. Targets (head_dim >= 64, groups
   of 64): <= 0.56x at int8, <= 0.31x at int4, scales, zero points and the residual included.
3. Speed: one decode step of the bundled model with 4k and 16k tokens of context, quantized
   against full precision (target within 1.5x), and `crop(-8)` at both lengths (flat).

    python benchmarks/quantized.py [--quick]
"""

from __future__ import annotations

import math
from typing import Any

import torch

from kvcache.generation import generate
from kvcache.layers import DynamicLayer, QuantizedLayer
from kvcache.models import DecoderConfig, DecoderLM, load_default_model

try:
    from .common import Section, Table, Target, ratio, rotate_timings, run_as_script, seconds, section_of
except ImportError:  # run as a script
    from common import Section, Table, Target, ratio, rotate_timings, run_as_script, seconds, section_of  # type: ignore[no-redef]

#: (text tokens, greedy prompts, contexts, timing rounds) per mode
SIZES = {"smoke": (256, 1, (1024,), 3), "quick": (512, 1, (2048,), 3), "full": (2048, 5, (4096, 16384), 9)}
CHUNK = 64


def held_out_text(tokenizer: Any, length: int) -> torch.Tensor:
    from pydoc_data.topics import topics

    text = "\n".join(topics[key] for key in sorted(topics))
    held = text[int(len(text) * 0.95) :]
    return torch.tensor([tokenizer.encode(held[:length])])


def _logits(model: Any, ids: torch.Tensor, cache: Any) -> torch.Tensor:
    out = []
    for start in range(0, ids.shape[1], CHUNK):
        piece = ids[:, start : start + CHUNK]
        out.append(model(piece, cache=cache, position_ids=torch.arange(start, start + piece.shape[1])[None]))
    return torch.cat(out, dim=1)[0].double()


def _models(mode: str) -> dict[str, tuple[Any, torch.Tensor, bool]]:
    length = SIZES[mode][0]
    bundled, tokenizer = load_default_model()
    torch.manual_seed(0)
    models: dict[str, tuple[Any, torch.Tensor, bool]] = {
        "bundled default model (head_dim 32)": (bundled, held_out_text(tokenizer, length), True)}
    sliding = DecoderLM(DecoderConfig(vocab_size=256, hidden_size=256, intermediate_size=512, num_heads=4,
                                      num_kv_heads=2, layer_types=["sliding_attention", "full_attention"] * 2,
                                      sliding_window=512)).eval()  # fmt: skip
    models["random sliding decoder (head_dim 64)"] = (sliding, torch.randint(0, 256, (1, length)), False)
    try:
        import transformers

        from kvcache.integrations.transformers import wrap_model

        config = transformers.LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                          num_attention_heads=2, num_key_value_heads=2, head_dim=128)  # fmt: skip
        llama = wrap_model(transformers.LlamaForCausalLM(config).eval())
        models["random tiny Llama (head_dim 128)"] = (llama, torch.randint(0, 256, (1, length)), False)
    except ImportError:
        pass
    return models


def _cache(model: Any, bits: int | None, group: int) -> Any:
    if hasattr(model, "kv_bits") and isinstance(model, DecoderLM):
        return model.new_cache(kv_bits=bits, group_size=group)
    from kvcache.integrations.transformers import cache_from_config

    return cache_from_config(model.config, kv_bits=bits, group_size=group)


def quality_table(mode: str) -> tuple[Table, list[Target], dict[str, Any]]:
    _, prompts, _, _ = SIZES[mode]
    columns = ["model", "bits", ":group", ":mean KL (nats)", ":max KL", ":argmax agreement",
               ":cross-entropy change (nats/token)"]
    table = Table("Quality against the full-precision cache (teacher-forced, chunks of 64 tokens)", columns)
    figures: dict[str, Any] = {}
    targets: list[Target] = []
    for name, (model, ids, trained) in _models(mode).items():
        reference = _logits(model, ids, _cache(model, None, 64))
        p = reference.log_softmax(-1)
        ce = -p[:-1].gather(1, ids[0, 1:, None]).mean().item()
        for bits in (8, 4):
            for group in (32, 64, 128):
                q = _logits(model, ids, _cache(model, bits, group)).log_softmax(-1)
                kl = (p.exp() * (p - q)).sum(-1)
                agree = (p.argmax(-1) == q.argmax(-1)).double().mean().item()  # next-token argmax, every position
                change = -q[:-1].gather(1, ids[0, 1:, None]).mean().item() - ce
                figures[f"{name}|{bits}|{group}"] = {"mean_kl": kl.mean().item(), "max_kl": kl.max().item(),
                                                      "agreement": agree, "ce_change": change}  # fmt: skip
                table.add(name, f"int{bits}", group, f"{kl.mean().item():.2e}", f"{kl.max().item():.2e}",
                          f"{agree:.2%}", f"{change:+.2e}")  # fmt: skip
                if trained and group == 64:
                    bound, agree_bound = (1e-4, 0.998) if bits == 8 else (4e-3, 0.985)
                    why = ("keys and values are both quantized per token along head_dim; keys' outlier channels "
                           "need per-channel scales (KIVI), not built yet")
                    targets.append(Target(f"quantized: int{bits} KL on the bundled model's held-out text",
                                          f"<= {bound:g}", f"{kl.mean().item():.2e}", kl.mean().item() <= bound, why))
                    targets.append(Target(f"quantized: int{bits} argmax agreement on the bundled model's held-out text",
                                          f">= {agree_bound:.1%}", f"{agree:.2%}", agree >= agree_bound, why))
    bundled, tokenizer = load_default_model()
    same = 0
    for i in range(prompts):
        ids = torch.tensor([tokenizer.encode(["The value of the ", "A list is ", "When the module ", "If the key ",
                                              "Every object "][i])])  # fmt: skip
        plain = generate(bundled, ids, max_new_tokens=200).sequences
        same += torch.equal(plain, generate(bundled, ids, max_new_tokens=200, cache=bundled.new_cache(kv_bits=8))
                            .sequences)  # fmt: skip
    table.add("bundled default model, greedy 200 tokens", "int8", 64, f"{same} of {prompts} prompts identical", "", "",
              "")
    targets.append(Target("quantized: int8 greedy output on the bundled model", "identical for 200 tokens",
                          f"{same}/{prompts}", same == prompts,
                          "a near tie between two tokens flips under a 1e-3 perturbation of the logits"))  # fmt: skip
    return table, targets, figures


def _storage_bytes(obj: Any, seen: set[int] | None = None) -> int:
    """Bytes of every distinct tensor storage reachable from `obj`'s attributes (quanto's layers)."""
    seen = set() if seen is None else seen
    if isinstance(obj, torch.Tensor):
        inner = [getattr(obj, n) for n in ("_data", "_scale", "_shift") if isinstance(getattr(obj, n, None),
                                                                                    torch.Tensor)]  # fmt: skip
        if inner:
            return sum(_storage_bytes(t, seen) for t in inner)
        ptr = obj.untyped_storage().data_ptr()
        if ptr in seen:
            return 0
        seen.add(ptr)
        return obj.untyped_storage().nbytes()
    if isinstance(obj, (list, tuple)):
        return sum(_storage_bytes(o, seen) for o in obj)
    if hasattr(obj, "__dict__"):
        return sum(_storage_bytes(v, seen) for k, v in vars(obj).items() if not k.startswith("__"))
    return 0


def memory_table(mode: str) -> tuple[Table, list[Target], dict[str, Any]]:
    _, _, contexts, _ = SIZES[mode]
    table = Table("Bytes per token and layer held (keys and values, 8 heads)",
                  ["cache", ":head_dim", ":tokens", ":bytes/token", ":/ float16"])  # fmt: skip
    figures: dict[str, Any] = {}
    targets: list[Target] = []
    for head_dim in (64, 128):
        for tokens in contexts:
            kv = torch.randn(1, 8, tokens, head_dim, dtype=torch.float16)
            fp16 = 2 * 8 * head_dim * 2
            rows = {}
            for bits in (8, 4):
                layer = QuantizedLayer(bits=bits, group_size=64)
                layer.update(kv, kv)
                rows[f"kvcache int{bits}, groups of 64"] = sum(t.nbytes for t in layer.state.values()) / tokens
            full = DynamicLayer()
            full.update(kv, kv)
            rows["kvcache DynamicLayer (float16)"] = sum(t.nbytes for t in full.state.values()) / tokens
            rows.update(_quanto_rows(kv, head_dim))
            for name, per_token in rows.items():
                table.add(name, head_dim, f"{tokens:,}", f"{per_token:,.0f}", f"{per_token / fp16:.3f}x")
                figures[f"{name}|{head_dim}|{tokens}"] = per_token
            for bits, bound in ((8, 0.56), (4, 0.31)):
                got = rows[f"kvcache int{bits}, groups of 64"] / fp16
                targets.append(Target(f"quantized: int{bits} bytes per token, head_dim {head_dim}, {tokens} tokens",
                                      f"<= {bound}x float16", f"{got:.3f}x", got <= bound,
                                      "scales and zero points cost 4 bytes per group, the residual 32-63 "
                                      "full-precision tokens"))  # fmt: skip
    return table, targets, figures


def _quanto_rows(kv: torch.Tensor, head_dim: int) -> dict[str, float]:
    """transformers' QuantizedCache (quanto) bytes per token, where optimum-quanto is installed."""
    try:
        import optimum.quanto  # noqa: F401
        from transformers import LlamaConfig, QuantizedCache
    except ImportError:
        return {}
    config = LlamaConfig(hidden_size=8 * head_dim, num_attention_heads=8, num_key_value_heads=8, head_dim=head_dim,
                         num_hidden_layers=1)  # fmt: skip
    out = {}
    for bits in (4, 2):
        cache = QuantizedCache(backend="quanto", config=config, nbits=bits, q_group_size=64, residual_length=128)
        cache.update(kv, kv, 0)
        cache.update(kv[:, :, :1], kv[:, :, :1], 0)  # the first update keeps everything; the next quantizes
        out[f"transformers QuantizedCache quanto int{bits}"] = _storage_bytes(cache.layers[0]) / (kv.shape[2] + 1)
    return out


def speed_table(mode: str) -> tuple[Table, list[Target], dict[str, Any]]:
    _, _, contexts, rounds = SIZES[mode]
    model, _ = load_default_model()
    table = Table("Bundled model: one decode step and crop(-8), by context length (ms)",
                  ["context", "cache", ":decode step", ":/ full precision", ":crop(-8)"])  # fmt: skip
    figures: dict[str, Any] = {}
    targets: list[Target] = []
    crops: dict[str, list[float]] = {}
    for tokens in contexts:
        ids = torch.randint(1, model.vocab_size, (1, tokens))
        caches = {}
        for name, bits in (("full precision", None), ("int8", 8), ("int4", 4)):
            cache = model.new_cache(kv_bits=bits)
            _logits(model, ids, cache)
            caches[name] = cache
        step = torch.randint(1, model.vocab_size, (1, 1))
        position = torch.tensor([[tokens]])

        def decode(cache: Any, step: torch.Tensor = step, position: torch.Tensor = position) -> float:
            cache.activate_past_recording()
            elapsed = seconds(lambda: model(step, cache=cache, position_ids=position))
            cache.crop(-1)
            return elapsed

        def crop(cache: Any, step: torch.Tensor = step, position: torch.Tensor = position) -> float:
            cache.activate_past_recording()
            for _ in range(8):
                model(step, cache=cache, position_ids=position)
            return seconds(lambda: cache.crop(-8))

        t = rotate_timings({name: (lambda c=c: decode(c)) for name, c in caches.items()}, rounds, warmup=1)
        c = rotate_timings({name: (lambda c=c: crop(c)) for name, c in caches.items()}, rounds, warmup=1)
        for name in caches:
            vs = ratio(t[name], t["full precision"])
            table.add(f"{tokens:,}", name, t[name].cell(1e3, 2), f"{vs:.2f}x", c[name].cell(1e3, 3))
            figures[f"{tokens}|{name}"] = {"decode": t[name], "crop": c[name]}
            crops.setdefault(name, []).append(c[name].median)
            if name != "full precision":
                targets.append(Target(f"quantized: {name} decode step at {tokens} tokens", "<= 1.5x full precision",
                                      f"{vs:.2f}x", vs <= 1.5,
                                      "every step dequantizes the quantized keys/values it attends to; the bundled "
                                      "model is small, so that is a large share of its step"))  # fmt: skip
    if len(contexts) > 1:
        for name, values in crops.items():
            growth = values[-1] / values[0]
            targets.append(Target(f"quantized: crop(-8) flat in context ({name})", "<= 1.5x from the shortest",
                                  f"{growth:.2f}x", growth <= 1.5 or not math.isfinite(growth),
                                  "a crop moves indexes and cuts the quantized part by whole blocks"))  # fmt: skip
    return table, targets, figures


def quantized_scenario(mode: str) -> Section:
    title = "12. Quantized KV layers: quality, memory, speed"
    return section_of("quantized", title, __doc__, (quality_table, memory_table, speed_table), mode)


if __name__ == "__main__":
    run_as_script(quantized_scenario, __doc__)
