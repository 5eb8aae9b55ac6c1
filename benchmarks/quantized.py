"""Quantized KV layers: what they cost in quality, what they save in memory and in the prefix
store, what a decode step costs, against the full-precision cache (and transformers'
`QuantizedCache`, quanto backend, where optimum-quanto is installed).

1. Quality: the model reads a text teacher-forced in chunks of 64 tokens through a full-precision
   cache and through quantized ones (int8, int4, int2; keys and values per channel in blocks of
   16 tokens, the default; keys per channel and values per token in groups of 64 along head_dim,
   as KIVI groups them; both per token),
   capped at the head size); the mean KL divergence of the next-token distributions, how often
   their argmax agrees, and the change in cross-entropy (nats per token), on the bundled model's
   held-out text (the last 5% of its training corpus). Models: the bundled default model
   (head_dim 32), a tiny random Llama (head_dim 128) and a random sliding-window decoder
   (head_dim 64). Targets (bundled model, default keys): int8 KL <= 1e-4 and next-token argmax
   agreement >= 99.8%, int4 KL <= 4e-3 and agreement >= 98.5%, and greedy output identical to full
   precision at int8 for 200 tokens; int2 as measured. The random models' figures are shown as
   measured (their distributions are flat, and their keys have no outlier channels).
2. Memory: bytes per token and layer held, from the tensors' storage, after 4k and 16k tokens of
   [1, 8 heads, T, head_dim] keys/values, against a float16 cache. Target (head_dim >= 64, groups
   of 64): <= 0.30x at int4, scales, zero points and the residual included.
3. Prefix store: the bytes of an entry (one 16-token chunk, every layer) of the bundled model's
   quantized caches against the full-precision one (float32, the model's, and float16). Target:
   int4 <= 0.35x of full precision.
4. Speed: one decode step of the bundled model with 4k and 16k (and 64k: not with --quick) tokens
   of context, quantized against full precision (target at 16k: within 1.2x), and `crop(-8)` at
   each length (flat).

    python benchmarks/quantized.py [--quick]
"""

from __future__ import annotations

import math
from typing import Any

import torch

from kvcache.generation import generate
from kvcache.layers import DynamicLayer, QuantizedLayer, QuantizedSlidingWindowLayer
from kvcache.models import DecoderConfig, DecoderLM, load_default_model

try:
    from .common import Section, Table, Target, ratio, rotate_timings, run_as_script, seconds, section_of
except ImportError:  # run as a script
    from common import Section, Table, Target, ratio, rotate_timings, run_as_script, seconds, section_of  # type: ignore[no-redef]

#: (text tokens, greedy prompts, contexts, timing rounds) per mode
SIZES = {"smoke": (256, 1, (1024,), 3), "quick": (512, 1, (2048,), 3), "full": (2048, 5, (4096, 16384, 65536), 9)}
#: (label, key_groups, value_groups): the default first
GROUPS = (("keys, values per channel", "channel", "channel"),
          ("keys per channel, values per token", "channel", "token"),
          ("keys, values per token", "token", "token"))
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


def _cache(model: Any, bits: int | None, group: int, key_groups: str = "channel", value_groups: str = "channel") -> Any:
    if hasattr(model, "kv_bits") and isinstance(model, DecoderLM):
        cache = model.new_cache(kv_bits=bits, group_size=group)
    else:
        from kvcache.integrations.transformers import cache_from_config

        cache = cache_from_config(model.config, kv_bits=bits, group_size=group)
    if (key_groups, value_groups) != ("channel", "channel"):  # the same layers, grouped otherwise
        for i, layer in enumerate(cache.layers):
            if isinstance(layer, QuantizedSlidingWindowLayer):
                cache.layers[i] = QuantizedSlidingWindowLayer(layer.sliding_window, layer.bits, layer.group_size,
                                                              key_groups=key_groups,
                                                              value_groups=value_groups)  # fmt: skip
            elif isinstance(layer, QuantizedLayer):
                cache.layers[i] = QuantizedLayer(layer.bits, layer.group_size, key_groups=key_groups,
                                                 value_groups=value_groups)  # fmt: skip
    return cache


def quality_table(mode: str) -> tuple[Table, list[Target], dict[str, Any]]:
    _, prompts, _, _ = SIZES[mode]
    columns = ["model", "bits", "keys", ":mean KL (nats)", ":max KL", ":argmax agreement",
               ":cross-entropy change (nats/token)"]
    table = Table("Quality against the full-precision cache (teacher-forced, chunks of 64 tokens)", columns)
    figures: dict[str, Any] = {}
    targets: list[Target] = []
    for name, (model, ids, trained) in _models(mode).items():
        reference = _logits(model, ids, _cache(model, None, 64))
        p = reference.log_softmax(-1)
        ce = -p[:-1].gather(1, ids[0, 1:, None]).mean().item()
        for bits in (8, 4, 2):
            for label, key_groups, value_groups in GROUPS:
                q = _logits(model, ids, _cache(model, bits, 64, key_groups, value_groups)).log_softmax(-1)
                kl = (p.exp() * (p - q)).sum(-1)
                agree = (p.argmax(-1) == q.argmax(-1)).double().mean().item()  # next-token argmax, every position
                change = -q[:-1].gather(1, ids[0, 1:, None]).mean().item() - ce
                figures[f"{name}|{bits}|{key_groups}|{value_groups}"] = {
                    "mean_kl": kl.mean().item(), "max_kl": kl.max().item(), "agreement": agree, "ce_change": change}
                table.add(name, f"int{bits}", label, f"{kl.mean().item():.2e}", f"{kl.max().item():.2e}",
                          f"{agree:.2%}", f"{change:+.2e}")  # fmt: skip
                if trained and label == GROUPS[0][0] and bits != 2:
                    bound, agree_bound = (1e-4, 0.998) if bits == 8 else (4e-3, 0.985)
                    why = ("the bundled model is tiny (head_dim 32, flat distributions: many near ties); values "
                           "the first layer's keys carry most of what is left")
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
            for bits in (8, 4, 2):
                for label, key_groups, value_groups in GROUPS:
                    if label != GROUPS[0][0] and bits != 4:
                        continue
                    layer = QuantizedLayer(bits=bits, group_size=64, key_groups=key_groups, value_groups=value_groups)
                    layer.update(kv, kv)
                    per_token = sum(t.nbytes for t in layer.state.values()) / tokens
                    rows[f"kvcache int{bits}, {label} (token groups of 64)"] = per_token
            full = DynamicLayer()
            full.update(kv, kv)
            rows["kvcache DynamicLayer (float16)"] = sum(t.nbytes for t in full.state.values()) / tokens
            rows.update(_quanto_rows(kv, head_dim))
            for name, per_token in rows.items():
                table.add(name, head_dim, f"{tokens:,}", f"{per_token:,.0f}", f"{per_token / fp16:.3f}x")
                figures[f"{name}|{head_dim}|{tokens}"] = per_token
            got = rows[f"kvcache int4, {GROUPS[0][0]} (token groups of 64)"] / fp16
            targets.append(Target(f"quantized: int4 bytes per token, head_dim {head_dim}, {tokens} tokens",
                                  "<= 0.30x float16", f"{got:.3f}x", got <= 0.30,
                                  "per-channel groups cost a float16 scale and zero point per channel and block of 16 "
                                  "tokens (0.25 bytes per value); values per token (0.328x) or blocks of 32 cost "
                                  "quality (the quality table)"))  # fmt: skip
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


def store_table(mode: str) -> tuple[Table, list[Target], dict[str, Any]]:
    """Bytes of a prefix-store entry (one chunk of 16 tokens, every layer) of the bundled model."""
    from kvcache.store.payloads import capture

    model, tokenizer = load_default_model()
    ids = held_out_text(tokenizer, 256)[:, :128]
    table = Table("Prefix store: bytes of an entry (16 tokens, every layer), bundled model",
                  ["cache", ":bytes/entry", ":/ full precision (float32)", ":/ float16"])  # fmt: skip
    figures: dict[str, Any] = {}
    sizes = {}
    for name, bits in (("full precision (float32)", None), ("int8", 8), ("int4", 4), ("int2", 2)):
        cache, total = model.new_cache(kv_bits=bits), 0
        for start in range(0, ids.shape[1], 16):
            model(ids[:, start : start + 16], cache=cache, position_ids=torch.arange(start, start + 16)[None])
            total += sum(capture(layer, start, start + 16).nbytes for layer in cache)
        sizes[name] = total / (ids.shape[1] // 16)
    full = sizes["full precision (float32)"]
    for name, size in sizes.items():
        table.add(name, f"{size:,.0f}", f"{size / full:.3f}x", f"{size / (full / 2):.3f}x")
        figures[name] = size
    got = sizes["int4"] / full
    targets = [Target("quantized: int4 prefix-store entry", "<= 0.35x full precision", f"{got:.3f}x", got <= 0.35,
                      "an entry holds the chunk's quantized tokens and their scales")]  # fmt: skip
    return table, targets, figures


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
        full = model.new_cache()
        _logits(model, ids, full)
        caches = {"full precision": full}
        for name, bits in (("int8", 8), ("int4", 4), ("int2", 2)):
            # the same context, handed to each layer at once: a layer's content is a function of its
            # tokens, and a prompt fed through the model would dequantize at every 16-token piece
            cache = model.new_cache(kv_bits=bits)
            for layer, source in zip(cache.layers, full.layers, strict=True):
                layer.update(source.state["keys"], source.state["values"])
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
            if name == "int4" and tokens == 16384:
                targets.append(Target(f"quantized: {name} decode step at {tokens} tokens", "<= 1.2x full precision",
                                      f"{vs:.2f}x", vs <= 1.2,
                                      "every step dequantizes the quantized keys/values it attends to (no fused "
                                      "kernel); the bundled model is small, so that is a large share of its step"))
    if len(contexts) > 1:
        for name, values in crops.items():
            growth = values[-1] / values[0]
            targets.append(Target(f"quantized: crop(-8) flat in context ({name})", "<= 1.5x from the shortest",
                                  f"{growth:.2f}x", growth <= 1.5 or not math.isfinite(growth),
                                  "a crop moves indexes and cuts the quantized part by whole blocks"))  # fmt: skip
    return table, targets, figures


def quantized_scenario(mode: str) -> Section:
    title = "12. Quantized KV layers: quality, memory, speed"
    return section_of("quantized", title, __doc__, (quality_table, memory_table, store_table, speed_table), mode)


if __name__ == "__main__":
    run_as_script(quantized_scenario, __doc__)
