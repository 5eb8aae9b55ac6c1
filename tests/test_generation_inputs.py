"""`generate`'s input checks (clear errors, nothing changed), the automatic stop-check choice,
logits processing against transformers' warpers, and the text streamer."""

from __future__ import annotations

import io

import pytest
import torch

from kvcache import CacheInputError, DynamicLayer, GenerationError
from kvcache.cache import Cache
from kvcache.generation import DeferredStopCheck, Sampling, TextStreamer, TokenCollector, generate
from kvcache.generation import driver as driver_module
from kvcache.models import (
    CharTokenizer,
    DecoderConfig,
    DecoderLM,
    EncoderDecoderConfig,
    EncoderDecoderLM,
    HybridConfig,
    HybridLM,
)

VOCAB = 20


pytestmark = pytest.mark.usefixtures("one_thread")


def _decoder(**overrides) -> DecoderLM:
    torch.manual_seed(0)
    config = {"vocab_size": VOCAB, "layer_types": ["full_attention", "sliding_attention"], "sliding_window": 4}
    return DecoderLM(DecoderConfig(**{**config, **overrides})).eval()


MODEL = _decoder()
IDS = torch.randint(0, VOCAB, (2, 6), generator=torch.Generator().manual_seed(1))


def _snapshot(cache) -> list:
    return [(layer.meta_state, {k: v.clone() for k, v in layer.state.items()}) for layer in cache.layers]


def _same(a: list, b: list) -> bool:
    return len(a) == len(b) and all(
        ma == mb and sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
        for (ma, sa), (mb, sb) in zip(a, b, strict=True)
    )


@pytest.mark.parametrize(
    ("args", "kwargs", "message"),
    [
        ((torch.empty(1, 0, dtype=torch.long),), {}, "empty"),
        ((torch.empty(0, 3, dtype=torch.long),), {}, "empty"),
        ((IDS.float(),), {}, "integer token ids"),
        ((IDS[0],), {}, "2-D"),
        (([[1, 2, 3]],), {}, "torch.Tensor"),
        ((IDS + VOCAB,), {}, "outside"),
        ((IDS,), {"attention_mask": torch.ones(2, 5, dtype=torch.long)}, "shape"),
        ((IDS,), {"attention_mask": torch.full((2, 6), 2)}, "only 0"),
        ((IDS,), {"attention_mask": torch.ones(2, 6)}, "integer or bool"),
        ((IDS,), {"attention_mask": torch.tensor([[1, 1, 1, 1, 1, 0]] * 2)}, "left padding"),
        ((IDS,), {"max_new_tokens": -1}, "max_new_tokens"),
        ((IDS,), {"max_new_tokens": 2.0}, "max_new_tokens"),
        ((IDS,), {"max_new_tokens": True}, "max_new_tokens"),
        ((IDS,), {"do_sample": True, "temperature": 0.0}, "temperature"),
        ((IDS,), {"do_sample": True, "top_p": 0.0}, "top_p"),
        ((IDS,), {"top_p": 1.5}, "top_p"),
        ((IDS,), {"top_k": -1}, "top_k"),
        ((IDS,), {"min_p": 1.5}, "min_p"),
        ((IDS,), {"do_sample": True, "min_p": -0.1}, "min_p"),
        ((IDS,), {"min_p": "0.1"}, "min_p"),
        ((IDS,), {"eos_token_id": VOCAB}, "eos_token_id"),
        ((IDS,), {"eos_token_id": [1, "x"]}, "eos_token_id"),
        ((IDS,), {"generator": 3}, "generator"),
        ((IDS,), {"streamer": object()}, "streamer"),
        ((IDS,), {"defer_stop": "yes"}, "defer_stop"),
        ((IDS,), {"decoder_input_ids": IDS}, "encoder-decoder"),
    ],
)
def test_bad_input_is_a_clear_error(args, kwargs, message) -> None:
    kwargs = {"max_new_tokens": 3, **kwargs}
    with pytest.raises(GenerationError, match=message):
        generate(MODEL, *args, **kwargs)


def _prefilled(model, ids) -> Cache:
    return generate(model, ids, max_new_tokens=2).cache


@pytest.mark.parametrize(
    ("other", "ids", "message"),
    [
        (MODEL, IDS[:1], "batch of 2"),  # another batch size
        (_decoder(num_kv_heads=4), IDS, "does not fit"),  # other heads
        (_decoder(hidden_size=32), IDS, "does not fit"),  # other head size
        (_decoder(sliding_window=6), IDS, "sliding_window"),
        (_decoder(layer_types=["full_attention"]), IDS, "layer"),
    ],
)
def test_a_cache_from_another_batch_or_model_is_refused_unchanged(other, ids, message) -> None:
    cache = _prefilled(MODEL, IDS)
    before = _snapshot(cache)
    sequence = torch.cat([ids, ids], dim=1)
    with pytest.raises(CacheInputError, match=message):
        generate(other, sequence, cache=cache, max_new_tokens=3)
    assert _same(before, _snapshot(cache))


def test_a_cache_holding_the_whole_input_is_refused() -> None:
    cache = _prefilled(MODEL, IDS)  # holds IDS + 1 generated token
    with pytest.raises(GenerationError, match="already holds 7"):
        generate(MODEL, IDS, cache=cache, max_new_tokens=3)


def test_an_encoder_decoder_model_needs_its_own_cache_kind() -> None:
    torch.manual_seed(0)
    model = EncoderDecoderLM(EncoderDecoderConfig(vocab_size=VOCAB)).eval()
    with pytest.raises(GenerationError, match="EncoderDecoderCache"):
        generate(model, IDS, cache=MODEL.new_cache(), max_new_tokens=2)
    with pytest.raises(GenerationError, match="not an EncoderDecoderCache"):
        generate(MODEL, IDS, cache=model.new_cache(), max_new_tokens=2)
    out = generate(model, IDS, max_new_tokens=2)
    with pytest.raises(CacheInputError, match="source"):  # continuing with another source
        generate(model, IDS[:, :4], decoder_input_ids=out.sequences, cache=out.cache, max_new_tokens=2)


class FrozenLayer(DynamicLayer):
    """A full-attention layer that claims it cannot undo steps (stands for any such layer kind)."""

    @property
    def is_croppable(self) -> bool:
        return False


class FrozenDecoder(DecoderLM):
    def new_cache(self) -> Cache:
        return Cache([FrozenLayer() for _ in self.config.layer_types])


def test_forced_deferral_on_a_cache_that_cannot_roll_back_is_refused_before_work() -> None:
    torch.manual_seed(0)
    model = FrozenDecoder(DecoderConfig(vocab_size=VOCAB, layer_types=["full_attention"])).eval()
    cache = model.new_cache()
    with pytest.raises(GenerationError, match="FrozenLayer"):
        generate(model, IDS, cache=cache, max_new_tokens=3, defer_stop=True)
    assert cache.get_seq_length() == 0 and not cache.layers[0].record_past


@pytest.fixture
def async_device(monkeypatch):
    """Pretend the CPU runs asynchronously and count the deferred stop checks made."""
    made = []

    class Counting(DeferredStopCheck):
        def __init__(self, *args, **kwargs):
            made.append(self)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(driver_module, "is_async_device", lambda device: True)
    monkeypatch.setattr(driver_module, "DeferredStopCheck", Counting)
    return made


def test_auto_defers_on_asynchronous_devices_when_rollback_is_exact(async_device) -> None:
    torch.manual_seed(3)
    model = HybridLM(HybridConfig(vocab_size=VOCAB, sliding_window=4)).eval()
    eos = int(generate(model, IDS, max_new_tokens=4).sequences[0, -1])
    async_device.clear()
    auto = generate(model, IDS, max_new_tokens=9, eos_token_id=eos, defer_stop=None, output_scores=True)
    assert len(async_device) == 1
    never = generate(model, IDS, max_new_tokens=9, eos_token_id=eos, defer_stop=False, output_scores=True)
    assert len(async_device) == 1
    assert torch.equal(auto.sequences, never.sequences)
    assert all(torch.equal(a, b) for a, b in zip(auto.scores, never.scores, strict=True))


def test_auto_does_not_defer_where_rollback_is_not_exact(async_device) -> None:
    torch.manual_seed(0)
    model = FrozenDecoder(DecoderConfig(vocab_size=VOCAB, layer_types=["full_attention"])).eval()
    out = generate(model, IDS, max_new_tokens=5, defer_stop=None)
    assert async_device == []
    assert not out.cache.layers[0].record_past
    assert torch.equal(out.sequences, generate(MODEL_FROZEN_REFERENCE(model), IDS, max_new_tokens=5).sequences)


def MODEL_FROZEN_REFERENCE(model: FrozenDecoder) -> DecoderLM:
    """The same weights with ordinary caches."""
    plain = DecoderLM(model.config).eval()
    plain.load_state_dict(model.state_dict())
    return plain


def test_auto_never_defers_on_cpu() -> None:
    cache = MODEL.new_cache()
    calls = []
    original = cache.activate_past_recording
    cache.activate_past_recording = lambda: (calls.append(1), original())[1]  # type: ignore[method-assign]
    generate(MODEL, IDS, cache=cache, max_new_tokens=4, defer_stop=None)
    assert calls == []
    for layer in cache.layers:  # the layers themselves were never set recording either
        assert not layer.record_past


def test_sampling_scores_match_transformers_warpers() -> None:
    warpers = pytest.importorskip("transformers.generation.logits_process")
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    cases = [(0.7, 5, 0.8, 0.0), (1.0, 0, 0.5, 0.0), (1.3, 10, 1.0, 0.0), (0.5, 0, 1.0, 0.0), (1.0, 0, 1.0, 0.1),
             (0.7, 20, 0.9, 0.05), (1.5, 0, 1.0, 1.0)]
    for temperature, top_k, top_p, min_p in cases:
        ours = Sampling(True, temperature, top_k, top_p, min_p).scores(logits)
        theirs = warpers.TemperatureLogitsWarper(temperature)(None, logits.clone())
        if top_k:
            theirs = warpers.TopKLogitsWarper(top_k)(None, theirs)
        if top_p < 1:
            theirs = warpers.TopPLogitsWarper(top_p)(None, theirs)
        if min_p > 0:
            theirs = warpers.MinPLogitsWarper(min_p)(None, theirs)
        assert torch.equal(ours, theirs), (temperature, top_k, top_p, min_p)
        kept = ours.isfinite().sum(-1)
        assert (kept >= 1).all() and (min_p < 1 or (kept == 1).all())  # min_p = 1: the best token alone
    greedy = Sampling().scores(logits)
    assert torch.equal(greedy, logits) and greedy.data_ptr() != logits.data_ptr()


def test_a_logit_bias_is_added_to_the_logits_before_everything_else() -> None:
    """`Sampling.logit_bias` is added to the logits (greedy scores, or before the temperature), the
    logits themselves are not changed, and malformed pairs are refused."""
    logits = torch.randn(2, 30, generator=torch.Generator().manual_seed(1))
    bias = ((3, -100.0), (7, 2.5), (0, 1))
    added = logits.clone()
    for token, value in bias:
        added[:, token] += value
    before = logits.clone()
    assert torch.equal(Sampling(logit_bias=bias).scores(logits), added)
    assert torch.equal(Sampling(True, 0.5, logit_bias=bias).scores(logits), added / 0.5)
    assert torch.equal(logits, before)
    for bad in (((1, "x"),), ((-1, 1.0),), ((1, float("nan")),), [(1, 1.0)], ((True, 1.0),), ((1,),)):
        with pytest.raises(GenerationError, match="logit_bias"):
            Sampling(logit_bias=bad)


def test_text_streamer_prints_decoded_tokens_as_they_arrive() -> None:
    tokenizer = CharTokenizer("abc .")
    out = io.StringIO()
    streamer = TextStreamer(tokenizer, file=out, skip_token_ids=[4])
    for token in tokenizer.encode("ab c"):
        streamer.put(torch.tensor([token]))
    assert out.getvalue() == "ab c"
    streamer.put(torch.tensor([4]))
    streamer.end()
    assert out.getvalue() == "ab c\n"
    with pytest.raises(ValueError, match="batch of 2"):
        streamer.put(torch.tensor([1, 2]))


def test_streamer_sees_every_kept_step_then_end() -> None:
    collector = TokenCollector()
    out = generate(MODEL, IDS, max_new_tokens=5, streamer=collector, defer_stop=True)
    assert collector.steps == out.sequences[:, IDS.shape[1] :].T.tolist() and collector.ended == 1
