"""kvcache caches inside unmodified transformers models: same logits, same generations.

Tiny randomly initialised models built from configs (no downloads), fp32 on CPU, one per layer
kind: Llama (full attention), Gemma3 (sliding layer first, then full), Qwen3-Next (gated delta net
plus attention), Mamba2 (recurrent only), Falcon-H1 (parallel hybrid: attention and Mamba2 in one
layer), LFM2 (short conv plus attention), Bart and T5 (encoder-decoder). The reference is always
transformers' own cache in the same model. The builders here are shared with
test_transformers_rollback.py.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers", minversion="5.24")

from kvcache import Cache, CacheInputError, DynamicLayer, KVCacheError, SlidingWindowLayer  # noqa: E402
from kvcache.encoder_decoder import EncoderDecoderCache  # noqa: E402
from kvcache.generation import generate  # noqa: E402
from kvcache.integrations.transformers import (  # noqa: E402
    TransformersCache,
    TransformersEncoderDecoderCache,
    as_transformers_cache,
    cache_from_config,
    layer_for,
    unwrap_cache,
    wrap_model,
)
from kvcache.layers.hybrid import HybridLayer  # noqa: E402
from kvcache.layers.recurrent import RecurrentLayer  # noqa: E402

T = transformers
VOCAB = 128
PROMPT = 12  # longer than Gemma3's window of 8, and not a multiple of Mamba2's chunk of 16
DECODE_STEPS = 20
ATOL = 1e-5  # measured difference on CPU: 0 (every comparison below is bitwise equal in practice)


pytestmark = pytest.mark.usefixtures("one_thread")


def _config(kind: str) -> Any:
    if kind == "llama":
        return T.LlamaConfig(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2,
        )  # fmt: skip
    if kind == "mistral":  # no layer_types: every layer slides (the cache and the masks infer it)
        return T.MistralConfig(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, sliding_window=8,
        )  # fmt: skip
    if kind == "gemma3":  # layer 0 sliding: the full-attention mask must not be sized from it
        return T.Gemma3TextConfig(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=8,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        )  # fmt: skip
    if kind == "qwen3_next":
        return T.Qwen3NextConfig(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_value_heads=4,
            linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16, num_experts=4,
            num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
            layer_types=["linear_attention", "full_attention", "linear_attention"],
        )  # fmt: skip
    if kind == "mamba2":
        return T.Mamba2Config(
            vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_heads=8, head_dim=16,
            state_size=16, n_groups=1, expand=2, chunk_size=16,
        )  # fmt: skip
    if kind == "mamba":  # Mamba1: its mixer scans a multi-token forward from zero unless asked for every state
        return T.MambaConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, state_size=16, expand=2,
                             initializer_range=0.5)  # at the default 0.1 its greedy output is one token forever
    if kind == "jamba":  # Mamba1 mixers and attention
        return T.JambaConfig(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, num_experts=2,
            mamba_d_state=16, mamba_expand=2, initializer_range=0.2,  # default: the state hardly moves a greedy choice
        )  # fmt: skip
    if kind == "falcon_h1":  # parallel hybrid: attention and Mamba2 mixer in every layer
        return T.FalconH1Config(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, mamba_d_ssm=64, mamba_n_heads=4, mamba_d_head=16,
            mamba_d_state=16, mamba_n_groups=1, mamba_chunk_size=16,
        )  # fmt: skip
    if kind == "lfm2":  # short-conv layers (conv state, no recurrent state) and attention
        return T.Lfm2Config(
            vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, layer_types=["conv", "full_attention", "conv"],
        )  # fmt: skip
    if kind == "bart":
        return T.BartConfig(
            vocab_size=VOCAB, d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
            decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, max_position_embeddings=128,
            init_std=0.5,  # at the default 0.02 a random Bart emits one token forever, whatever the input
        )  # fmt: skip
    if kind == "t5":  # decoder deeper than the encoder: the cache must follow num_decoder_layers
        return T.T5Config(
            vocab_size=VOCAB, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_decoder_layers=3, num_heads=4,
            decoder_start_token_id=0, initializer_factor=5.0,  # default init: a constant greedy output
        )  # fmt: skip
    raise ValueError(kind)


_CLASSES = {
    "llama": "LlamaForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen3_next": "Qwen3NextForCausalLM",
    "mamba2": "Mamba2ForCausalLM",
    "mamba": "MambaForCausalLM",
    "jamba": "JambaForCausalLM",
    "falcon_h1": "FalconH1ForCausalLM",
    "lfm2": "Lfm2ForCausalLM",
    "bart": "BartForConditionalGeneration",
    "t5": "T5ForConditionalGeneration",
}
KINDS = list(_CLASSES)
STATEFUL = ["gemma3", "qwen3_next", "mamba2", "mamba", "jamba", "falcon_h1"]  # layers that drop or overwrite their past
_MODELS: dict[str, Any] = {}


def tiny_model(kind: str) -> Any:
    """The tiny model of `kind` (built once per session, seeded), eval mode, no EOS in generation."""
    if kind not in _MODELS:
        torch.manual_seed(0)
        model = getattr(T, _CLASSES[kind])(_config(kind)).eval()
        model.generation_config.eos_token_id = None
        model.generation_config.forced_eos_token_id = None  # Bart's: a logits processor our driver does not have
        model.generation_config.pad_token_id = 0
        _MODELS[kind] = model
    return _MODELS[kind]


def zamba2_model() -> Any:
    """A tiny Zamba2 (Mamba2 layers, and a shared attention block in a hybrid layer): its mixer
    scans an empty chunk when asked for every token's state, so kvcache takes no per-token states
    from it (`hf_recurrence.ASKED_MIXER_CLASSES`)."""
    torch.manual_seed(0)
    config = T.Zamba2Config(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2,
                            layers_block_type=["mamba", "hybrid"], num_attention_heads=4, mamba_d_state=16,
                            mamba_headdim=16, n_mamba_heads=8, hybrid_layer_ids=[1], use_mem_rope=True)  # fmt: skip
    model = T.Zamba2ForCausalLM(config).eval()
    model.generation_config.eos_token_id, model.generation_config.pad_token_id = None, 0
    return model


def prompt(batch: int = 2, length: int = PROMPT, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def hf_cache(model: Any) -> Any:
    """transformers' own cache for `model`, as its generate() builds it; for encoder-decoders lazily grown
    layers (transformers 5.24 sizes a config-built cache by the encoder's depth, which breaks T5 with
    `num_decoder_layers > num_layers`, even in its own generate())."""
    if model.config.is_encoder_decoder:
        return T.EncoderDecoderCache(T.DynamicCache(), T.DynamicCache())
    return T.DynamicCache(config=model.config)


class Stepper:
    """Runs one model step by step with one cache (kvcache's, through the adapter, or transformers')."""

    def __init__(self, model: Any, cache: Any, source: torch.Tensor) -> None:
        self.model, self.cache = model, cache
        self.encoded = None
        if model.config.is_encoder_decoder:
            with torch.no_grad():
                self.encoded = model.get_encoder()(input_ids=source).last_hidden_state

    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:
        cache = self.cache if isinstance(self.cache, T.Cache) else as_transformers_cache(self.cache)
        with torch.no_grad():
            if self.encoded is not None:
                return self.model(encoder_outputs=(self.encoded,), decoder_input_ids=tokens, cache=cache).logits
            return self.model(tokens, cache=cache).logits


def first_tokens(model: Any, source: torch.Tensor) -> torch.Tensor:
    """What the prefill feeds: the prompt, or for an encoder-decoder a 4-token decoder prefix."""
    if not model.config.is_encoder_decoder:
        return source
    start = wrap_model(model).decoder_start_token_id
    return torch.cat([torch.full((source.shape[0], 1), start), source[:, :3]], dim=1)


_GENERATED: dict[str, Any] = {}


def hf_generate(kind: str) -> torch.Tensor:
    """transformers' greedy generate with its own cache on `prompt()`: 20 new tokens (computed once per kind)."""
    return hf_generate_with_scores(kind)[0]


def hf_generate_with_scores(kind: str) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """`hf_generate` and the logits of every step."""
    if kind not in _GENERATED:
        model = tiny_model(kind)
        cache = hf_cache(model) if model.config.is_encoder_decoder else None
        out = model.generate(
            prompt(), max_new_tokens=DECODE_STEPS, do_sample=False, cache=cache,
            output_scores=True, return_dict_in_generate=True,
        )  # fmt: skip
        _GENERATED[kind] = (out.sequences, out.scores)
    return _GENERATED[kind]


def our_generate(model: Any, source: torch.Tensor, **kwargs: Any) -> Any:
    return generate(wrap_model(model), source, **kwargs)


# ------------------------------------------------------------------------- cache structure
def _kinds_of(cache: Cache) -> list[tuple[str, Any]]:
    out = []
    for layer in cache.layers:
        if isinstance(layer, SlidingWindowLayer):
            out.append(("sliding", layer.sliding_window))
        elif isinstance(layer, DynamicLayer):
            out.append(("full", None))
        elif isinstance(layer, HybridLayer):
            out.append(("hybrid", type(layer.attention).__name__))
        elif isinstance(layer, RecurrentLayer):
            out.append(("recurrent", layer.num_states))
        else:
            out.append((type(layer).__name__, None))
    return out


@pytest.mark.parametrize(
    ("kind", "expected"),
    [
        ("llama", [("full", None)] * 2),
        ("gemma3", [("sliding", 8), ("full", None), ("sliding", 8)]),
        ("mistral", [("sliding", 8)] * 2),
        ("qwen3_next", [("recurrent", 1), ("full", None), ("recurrent", 1)]),
        ("mamba2", [("recurrent", 1)] * 2),
        ("mamba", [("recurrent", 1)] * 2),
        ("jamba", [("recurrent", 1), ("full", None)]),
        ("falcon_h1", [("hybrid", "DynamicLayer")] * 2),
        ("lfm2", [("recurrent", 1), ("full", None), ("recurrent", 1)]),
    ],
)
def test_cache_from_config_builds_one_layer_per_model_layer(kind: str, expected: list[Any]) -> None:
    cache = cache_from_config(_config(kind))
    assert type(cache) is Cache
    assert _kinds_of(cache) == expected


@pytest.mark.parametrize(("kind", "depth"), [("bart", 2), ("t5", 3)])
def test_cache_from_config_encoder_decoder(kind: str, depth: int) -> None:
    cache = cache_from_config(_config(kind))
    assert isinstance(cache, EncoderDecoderCache)
    assert _kinds_of(cache.self_attention_cache) == [("full", None)] * depth
    assert _kinds_of(cache.cross_attention_cache) == [("full", None)] * depth
    assert cache.is_updated == dict.fromkeys(range(depth), False)


def test_layer_for_parallel_hybrids_and_unknown_types() -> None:
    hybrid = layer_for("hybrid", {"number_of_states": 2})
    assert isinstance(hybrid, HybridLayer) and type(hybrid.attention) is DynamicLayer
    assert hybrid.recurrent.num_states == 2
    sliding_hybrid = layer_for("hybrid_sliding", {"sliding_window": 5, "number_of_states": 1})
    assert isinstance(sliding_hybrid.attention, SlidingWindowLayer) and sliding_hybrid.attention.sliding_window == 5
    chunked = layer_for("chunked_attention", {"sliding_window": 4})
    assert isinstance(chunked, SlidingWindowLayer) and chunked.sliding_window == 4
    from kvcache import EmptyLayer

    assert isinstance(layer_for("dummy", {}), EmptyLayer)
    with pytest.raises(CacheInputError, match="'indexed_attention'"):
        layer_for("indexed_attention", {})
    with pytest.raises(CacheInputError, match="sliding_window"):
        layer_for("sliding_attention", {})


def test_bad_inputs_raise_the_package_errors() -> None:
    with pytest.raises(CacheInputError, match="transformers config"):
        cache_from_config({"num_hidden_layers": 2})
    with pytest.raises(CacheInputError, match="PreTrainedModel"):
        wrap_model(torch.nn.Linear(2, 2))
    with pytest.raises(CacheInputError, match="kvcache cache"):
        as_transformers_cache(object())
    with pytest.raises(CacheInputError, match="kvcache Cache"):
        TransformersCache(T.DynamicCache())  # type: ignore[arg-type]
    config = _config("llama")
    config.layer_types = ["full_attention", "mlp"]  # transformers caches nothing for "mlp" layers
    assert [type(layer).__name__ for layer in cache_from_config(config).layers] == ["DynamicLayer", "EmptyLayer"]
    config.layer_types = ["full_attention", "indexed_attention"]
    with pytest.raises(CacheInputError, match="indexed_attention"):
        cache_from_config(config)


def test_adapter_is_a_transformers_cache_and_answers_for_the_kvcache_cache() -> None:
    """What transformers' mask code reads: isinstance, layer kinds, and the first full layer's sizes."""
    from transformers.masking_utils import find_first_full_attention_index

    cache = cache_from_config(_config("gemma3"))
    adapter = as_transformers_cache(cache)
    assert isinstance(adapter, T.Cache) and adapter.cache is cache and unwrap_cache(adapter) is cache
    assert as_transformers_cache(adapter) is adapter
    assert adapter.is_sliding == [True, False, True] and adapter.is_linear == [False] * 3
    assert find_first_full_attention_index(adapter) == 1  # a duck-typed cache would get 0 (a sliding layer)
    k = torch.randn(1, 2, 10, 16)
    for i in range(3):
        adapter.update(k, k, i, kwargs={"unused": 1})  # transformers' call form
    assert adapter.get_seq_length() == 10 and cache.get_seq_length() == 10
    assert adapter.get_mask_sizes(1, 0) == (8, 3) and adapter.get_mask_sizes(1, 1) == (11, 0)
    assert adapter.batch_size == 1 and adapter.is_initialized and not adapter.is_compileable

    encdec = as_transformers_cache(cache_from_config(_config("bart")))
    assert isinstance(encdec, TransformersEncoderDecoderCache) and isinstance(encdec, T.EncoderDecoderCache)
    encdec.is_updated[0] = True  # what Bart's attention does after writing cross keys/values
    assert encdec.cache.is_updated[0] is True


def test_stateful_layers_ask_for_every_conv_input() -> None:
    """`is_recording_past` is True on recurrent layers, so transformers never bypasses the cache there."""
    adapter = as_transformers_cache(cache_from_config(_config("qwen3_next")))
    assert [adapter.is_recording_past(i) for i in range(3)] == [True, False, True]
    adapter.activate_past_recording()
    assert [adapter.is_recording_past(i) for i in range(3)] == [True, True, True]


# ---------------------------------------------------------------------- logits parity
@pytest.mark.parametrize("kind", KINDS)
def test_prefill_and_decode_logits_match_transformers_cache(kind: str) -> None:
    """A prefill and 20 greedy decode steps: kvcache's cache and transformers' give the same logits."""
    model = tiny_model(kind)
    source = prompt()
    ours, theirs = Stepper(model, cache_from_config(model.config), source), Stepper(model, hf_cache(model), source)
    tokens = first_tokens(model, source)
    for step in range(1 + DECODE_STEPS):
        expected = theirs(tokens)
        got = ours(tokens)
        torch.testing.assert_close(got, expected, atol=ATOL, rtol=0, msg=lambda m, s=step: f"step {s}: {m}")
        tokens = expected[:, -1:].argmax(-1)
    kv = ours.cache.self_attention_cache if model.config.is_encoder_decoder else ours.cache
    expected_length = first_tokens(model, source).shape[1] + DECODE_STEPS
    assert kv.get_seq_length() == expected_length  # recurrent-only models count their tokens too


#: A static cache's attention reads fixed-shape keys (unwritten slots masked), transformers' dynamic
#: cache exactly the tokens: different reductions. The difference scales with the logits (T5's reach
#: 81 here), so the bound is relative to the largest logit: measured at 1 and 2 threads, at most
#: 2.8e-6 of it (T5; decoder-only families 2.4e-7 to 4.8e-7, Mamba2 0).
STATIC_RTOL_OF_MAX = 2e-5


@pytest.mark.parametrize("kind", KINDS)
def test_static_cache_from_config_gives_transformers_logits(kind: str) -> None:
    """`cache_from_config(static=True)`: fixed-shape layers of the right kind for every family, and
    the logits of transformers' own cache within a stated tolerance."""
    model = tiny_model(kind)
    source = prompt()
    cache = cache_from_config(model.config, static=True, max_cache_len=64)
    kv = cache.self_attention_cache if model.config.is_encoder_decoder else cache
    assert kv.is_compileable, [type(layer).__name__ for layer in kv]
    ours, theirs = Stepper(model, cache, source), Stepper(model, hf_cache(model), source)
    tokens = first_tokens(model, source)
    for step in range(1 + DECODE_STEPS):
        expected = theirs(tokens)
        got = ours(tokens)
        atol = STATIC_RTOL_OF_MAX * expected.abs().max().item()
        torch.testing.assert_close(got, expected, atol=atol, rtol=0, msg=lambda m, s=step: f"step {s}: {m}")
        tokens = expected[:, -1:].argmax(-1)
    assert kv.get_seq_length() == first_tokens(model, source).shape[1] + DECODE_STEPS


def test_static_cache_from_config_arguments() -> None:
    config = tiny_model("gemma3").config
    kinds = [type(layer).__name__ for layer in cache_from_config(config, static=True, max_cache_len=32)]
    assert kinds == ["StaticSlidingWindowLayer", "StaticLayer", "StaticSlidingWindowLayer"]
    for bad in ({"static": True}, {"static": True, "max_cache_len": 0}, {"max_cache_len": 32}, {"static": 1},
                {"static": True, "max_cache_len": 32, "rollback_tokens": 0}):  # fmt: skip
        with pytest.raises(CacheInputError):
            cache_from_config(config, **bad)


def test_past_key_values_keyword_still_works() -> None:
    """transformers 5.24 renamed `past_key_values` to `cache` (deprecated until 5.40): both take ours."""
    model, source = tiny_model("llama"), prompt()
    kv = cache_from_config(model.config)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = model(source, past_key_values=as_transformers_cache(kv)).logits
        expected = model(source).logits
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=0)
    assert kv.get_seq_length() == PROMPT


# ------------------------------------------------------------------------- generation
@pytest.mark.parametrize("kind", KINDS)
def test_driver_greedy_equals_transformers_generate(kind: str) -> None:
    """Greedy generation through our driver equals transformers' generate: tokens and every step's logits."""
    model, source = tiny_model(kind), prompt()
    expected, expected_scores = hf_generate_with_scores(kind)
    for defer in (False, True):
        out = our_generate(model, source, max_new_tokens=DECODE_STEPS, defer_stop=defer, output_scores=True)
        assert torch.equal(out.sequences, expected), f"defer_stop={defer}"  # decoder tokens for Bart/T5
        torch.testing.assert_close(torch.stack(out.scores), torch.stack(expected_scores), atol=ATOL, rtol=0)


def test_driver_takes_eos_and_pad_from_the_generation_config() -> None:
    """A tiny Llama whose generation_config names an eos (and a pad) token: transformers stops each row
    there and pads after; `generate(wrap_model(model), ...)` does the same by default, and an explicit
    `eos_token_id=[]` turns stopping off."""
    torch.manual_seed(0)
    model = T.LlamaForCausalLM(_config("llama")).eval()
    source = prompt()
    free = model.generate(source, max_new_tokens=DECODE_STEPS, do_sample=False, eos_token_id=None, pad_token_id=0)
    eos = free[0, source.shape[1] + 3].item()  # row 0 emits it at step 3
    model.generation_config.eos_token_id, model.generation_config.pad_token_id = eos, 1
    expected = model.generate(source, max_new_tokens=DECODE_STEPS, do_sample=False)
    assert (expected[0, source.shape[1] + 4 :] == 1).all()  # transformers pads row 0 after its eos
    wrapped = wrap_model(model)
    assert wrapped.eos_token_id == [eos] and wrapped.pad_token_id == 1
    got = generate(wrapped, source, max_new_tokens=DECODE_STEPS)
    assert torch.equal(got.sequences, expected)
    unstopped = generate(wrapped, source, max_new_tokens=DECODE_STEPS, eos_token_id=[])
    assert torch.equal(unstopped.sequences, free)


@pytest.mark.parametrize("kind", ["llama", "gemma3", "mamba2", "qwen3_next"])
def test_driver_left_padded_batch_equals_transformers_generate(kind: str) -> None:
    model = tiny_model(kind)
    source = prompt(length=10, seed=3)
    mask = torch.ones_like(source)
    mask[1, :4] = 0  # row 1 is 4 tokens shorter, left-padded
    source = source.masked_fill(mask == 0, 0)
    expected = model.generate(source, attention_mask=mask, max_new_tokens=12, do_sample=False)
    out = our_generate(model, source, attention_mask=mask, max_new_tokens=12)
    assert torch.equal(out.sequences, expected)


@pytest.mark.parametrize("kind", [k for k in KINDS if k not in ("bart", "t5")])
def test_driver_takes_a_static_cache_of_every_layer_kind(kind: str) -> None:
    """`generate` takes the static cache of every decoder-only family (static sliding windows and
    recurrent states included), as transformers' `generate(cache_implementation="static")` does,
    and gives that run's tokens, with the stop check deferred or not."""
    model, source = tiny_model(kind), prompt()
    expected = model.generate(source, max_new_tokens=DECODE_STEPS, do_sample=False, cache_implementation="static")
    for defer in (False, True):
        cache = cache_from_config(model.config, static=True, max_cache_len=64)
        out = our_generate(model, source, cache=cache, max_new_tokens=DECODE_STEPS, defer_stop=defer)
        assert torch.equal(out.sequences, expected), f"defer_stop={defer}"
        assert out.cache is cache and cache.get_seq_length() == expected.shape[1] - 1


@pytest.mark.parametrize("kind", ["gemma3", "mamba2", "t5"])
def test_transformers_generate_runs_on_a_kvcache_cache(kind: str) -> None:
    """transformers' own generate() with a kvcache cache gives its usual output, and fills our cache."""
    model, source = tiny_model(kind), prompt()
    kv = cache_from_config(model.config)
    got = model.generate(source, max_new_tokens=DECODE_STEPS, do_sample=False, cache=as_transformers_cache(kv))
    assert torch.equal(got, hf_generate(kind))
    self_attention = kv.self_attention_cache if isinstance(kv, EncoderDecoderCache) else kv
    assert self_attention.get_seq_length() == got.shape[1] - 1  # generate never feeds its last token


def test_untested_transformers_versions_are_refused_or_flagged(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib

    import transformers as live  # what the integration's `import transformers` sees now

    import kvcache.integrations.transformers as integration

    try:
        monkeypatch.setattr(live, "__version__", "5.23.0")
        with pytest.raises(ImportError, match=r"needs transformers >=5\.24,<6"):
            importlib.reload(integration)
        monkeypatch.setattr(live, "__version__", "5.31.0")
        with pytest.warns(UserWarning, match="tested with transformers 5.24"):
            importlib.reload(integration)
    finally:
        monkeypatch.undo()
        importlib.reload(integration)
    assert integration.cache_from_config is cache_from_config


def test_the_extra_asks_for_the_range_the_import_check_accepts() -> None:
    """pyproject's `transformers` extra and the import-time check state one range, so pip keeps an
    installed transformers exactly when the integration will import with it; `packaging`, which the
    integration imports, is declared too."""
    tomllib = pytest.importorskip("tomllib")
    from pathlib import Path

    from packaging.requirements import Requirement
    from packaging.version import Version

    from kvcache.integrations.transformers import SUPPORTED_TRANSFORMERS, TESTED_TRANSFORMERS

    pyproject = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    extra = {Requirement(r).name: Requirement(r) for r in pyproject["project"]["optional-dependencies"]["transformers"]}
    assert "packaging" in extra
    spec = extra["transformers"].specifier
    low, high = SUPPORTED_TRANSFORMERS
    for version in ("5.23.9", str(low), *(f"{v}.7" for v in TESTED_TRANSFORMERS), "5.31.0", "5.99", str(high), "6.1"):
        assert spec.contains(version) == (low <= Version(version) < high), version


def test_generate_given_an_unwrapped_transformers_model_says_to_wrap_it() -> None:
    from kvcache import GenerationError
    from kvcache.generation import generate

    with pytest.raises(GenerationError, match=r"wrap_model\(model\)"):
        generate(tiny_model("llama"), prompt(), max_new_tokens=2)


@pytest.mark.parametrize("kind", ["bart", "t5"])
def test_a_raw_encoder_decoder_cache_fails_at_first_use_not_silently(kind: str) -> None:
    """transformers routes cross-attention only for its own EncoderDecoderCache type, so a raw kvcache
    one would get cross keys appended to its self-attention layers (wrong logits, no error). It is
    refused at the first update, saying what to pass instead; the adapter gives transformers' logits."""
    model, source = tiny_model(kind), prompt()
    decoder = first_tokens(model, source)
    raw = cache_from_config(model.config)
    with torch.no_grad(), pytest.raises(KVCacheError, match="as_transformers_cache"):
        model(input_ids=source, decoder_input_ids=decoder, cache=raw)
    assert raw.get_seq_length() == 0
    with torch.no_grad():
        ours = model(input_ids=source, decoder_input_ids=decoder, cache=as_transformers_cache(raw)).logits
        theirs = model(input_ids=source, decoder_input_ids=decoder, cache=hf_cache(model)).logits
    assert torch.equal(ours, theirs)


@pytest.mark.parametrize("kind", ["bart", "t5", "llama", "qwen3_next"])
def test_copies_of_adapters_are_consistent_forks(kind: str) -> None:
    """copy.deepcopy of an adapter (transformers' way to reuse a prompt cache) forks the kvcache cache
    once, so both halves of an encoder-decoder adapter point into the same fork; copy.copy shares."""
    import copy

    model, source = tiny_model(kind), prompt()
    adapter = as_transformers_cache(cache_from_config(model.config))
    step = Stepper(model, adapter, source)
    step(first_tokens(model, source))
    fork = copy.deepcopy(adapter)
    assert fork.cache is not adapter.cache
    if model.config.is_encoder_decoder:
        assert fork.self_attention_cache.cache is fork.cache.self_attention_cache
        assert fork.cross_attention_cache.cache is fork.cache.cross_attention_cache
    assert copy.copy(adapter).cache is adapter.cache
    more = torch.randint(3, VOCAB, (2, 3), generator=torch.Generator().manual_seed(4))
    original_logits = Stepper(model, adapter, source)(more)
    fork_logits = Stepper(model, fork, source)(more)
    assert torch.equal(original_logits, fork_logits)
    assert fork.get_seq_length() == adapter.get_seq_length()


def test_save_cache_accepts_an_adapter(tmp_path: Any) -> None:
    from kvcache import load_cache, save_cache

    model, source = tiny_model("qwen3_next"), prompt()
    adapter = as_transformers_cache(cache_from_config(model.config))
    Stepper(model, adapter, source)(source)
    save_cache(adapter, tmp_path / "a.safetensors")
    loaded = load_cache(tmp_path / "a.safetensors")
    assert type(loaded) is type(adapter.cache) and loaded.get_seq_length() == adapter.cache.get_seq_length()


def _dummy_layer_model(kind: str) -> Any:
    """NemotronH (an MLP-only layer) and Gemma3n (KV-shared layers): transformers' "dummy" layer type."""
    torch.manual_seed(0)
    if kind == "nemotron_h":
        config = T.NemotronHConfig(
            vocab_size=VOCAB, hidden_size=64, layers_block_type=["mamba", "attention", "mlp", "mamba"],
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=128, ssm_state_size=16,
            mamba_num_heads=8, mamba_head_dim=16, n_groups=1, conv_kernel=4, expand=2, chunk_size=16,
            use_mamba_kernels=False,
        )  # fmt: skip
        return T.NemotronHForCausalLM(config).eval()
    config = T.Gemma3nTextConfig(
        vocab_size=VOCAB, vocab_size_per_layer_input=VOCAB, hidden_size=64, hidden_size_per_layer_input=8,
        intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        sliding_window=8, layer_types=["sliding_attention", "full_attention"] * 2, num_kv_shared_layers=2,
        laurel_rank=8, altup_num_inputs=2, activation_sparsity_pattern=[0.0] * 4,
    )  # fmt: skip
    return T.Gemma3nForCausalLM(config).eval()


@pytest.mark.parametrize("kind", ["nemotron_h", "gemma3n"])
def test_dummy_layer_types_get_empty_layers_and_transformers_logits(kind: str) -> None:
    from kvcache import EmptyLayer

    model, source = _dummy_layer_model(kind), prompt()
    cache = cache_from_config(model.config)
    assert any(isinstance(layer, EmptyLayer) for layer in cache.layers)
    ours, theirs = Stepper(model, cache, source), Stepper(model, hf_cache(model), source)
    assert torch.equal(ours(source), theirs(source))
    for step in torch.randint(3, VOCAB, (4, 2, 1), generator=torch.Generator().manual_seed(2)):
        assert torch.equal(ours(step), theirs(step))
    cache.activate_past_recording()  # an EmptyLayer never limits rollback
    ours(torch.tensor([[5], [6]]))
    assert cache.max_rollback >= 1 and cache.is_croppable
    cache.crop(-1)
    assert cache.get_seq_length() == source.shape[1] + 4


@pytest.mark.parametrize("kind", [*KINDS, "nemotron_h", "gemma3n"])
def test_a_raw_kvcache_cache_gives_transformers_logits_or_fails_at_first_use(kind: str) -> None:
    """Without the adapter: decoder-only families compute exactly what transformers' own cache
    computes (prefill and decode steps); encoder-decoder families refuse at the first update."""
    model = tiny_model(kind) if kind in KINDS else _dummy_layer_model(kind)
    source, raw = prompt(), cache_from_config(model.config)
    if model.config.is_encoder_decoder:
        with torch.no_grad(), pytest.raises(KVCacheError, match="as_transformers_cache"):
            model(input_ids=source, decoder_input_ids=first_tokens(model, source), cache=raw)
        return
    theirs = hf_cache(model)
    steps = [source, *torch.randint(3, VOCAB, (3, 2, 1), generator=torch.Generator().manual_seed(5))]
    with torch.no_grad():
        for step, ids in enumerate(steps):
            assert torch.equal(model(ids, cache=raw).logits, model(ids, cache=theirs).logits), f"step {step}"
