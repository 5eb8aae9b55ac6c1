"""`generate` interrupted (an exception from the model, mid-forward or between layers, or from the
streamer; deferred and immediate stop checks): the caller's cache is left committed, not recording,
and consistent, so continuing from what was streamed gives exactly the uninterrupted tokens. And
what can be checked before the prefill is: a cache that cannot roll back under defer_stop=True, an
empty cache shaped for another model."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from test_generation import MODELS, VOCAB

from kvcache import Cache, DynamicCache, DynamicLayer, GenerationError, KVCacheError, SlidingWindowLayer
from kvcache.generation import TokenCollector, generate

pytestmark = pytest.mark.usefixtures("one_thread")

NEW = 6


class Boom(Exception):
    pass


class FailingStreamer(TokenCollector):
    def __init__(self, fail_at: int, exc: type[BaseException]) -> None:
        super().__init__()
        self.fail_at, self.exc = fail_at, exc

    def put(self, token_ids: torch.Tensor) -> None:
        if len(self.steps) == self.fail_at:
            raise self.exc("streamer failed")
        super().put(token_ids)


def fail_in_layer(model: Any, layer: int, at_call: int, exc: type[BaseException]) -> None:
    """Make block `layer` of `model` raise on its `at_call`-th call: the layers before it have
    already written that forward's tokens into the cache."""
    block = model.layers[layer]
    real = block.forward
    calls = [0]

    def forward(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        if calls[0] == at_call:
            raise exc("model failed")
        return real(*args, **kwargs)

    block.forward = forward  # instance attribute: removed again below


def check_consistent(model: Any, cache: Any, prompt: torch.Tensor, streamed: list[list[int]], expected: torch.Tensor,
                     defer: bool) -> None:  # fmt: skip
    layers = [*cache.layers]
    assert not any(layer.record_past for layer in layers), "left recording"
    sequence = torch.cat([prompt, torch.tensor(streamed, dtype=torch.long).reshape(-1, 1).T], dim=1)
    assert cache.get_seq_length() < sequence.shape[1]
    rest = generate(model, sequence, cache=cache, max_new_tokens=expected.shape[1] - sequence.shape[1],
                    defer_stop=defer)  # fmt: skip
    assert torch.equal(rest.sequences, expected)


@pytest.mark.parametrize("defer", [False, True], ids=["immediate", "deferred"])
@pytest.mark.parametrize("kind", ["decoder", "hybrid"])
@pytest.mark.parametrize("where", ["model", "mid-forward", "streamer"])
@pytest.mark.parametrize("exc", [Boom, KeyboardInterrupt], ids=["error", "ctrl-c"])
def test_interrupted_generation_leaves_a_cache_that_continues_exactly(kind: str, defer: bool, where: str,
                                                                     exc: type[BaseException]) -> None:  # fmt: skip
    model = MODELS[kind]
    prompt = torch.randint(2, VOCAB, (1, 9), generator=torch.Generator().manual_seed(3))
    expected = generate(model, prompt, max_new_tokens=NEW, defer_stop=defer).sequences
    for at in range(1, NEW + 1):  # every forward call (the prefill is call 1; NEW in all) / every streamed step
        cache = model.new_cache()
        generate(model, prompt[:, :4], cache=cache, max_new_tokens=0)  # a conversation so far: 3 tokens held
        streamer = FailingStreamer(at - 1, exc) if where == "streamer" else TokenCollector()
        if where != "streamer":
            fail_in_layer(model, 0 if where == "model" else len(model.layers) - 1, at, exc)
        try:
            with pytest.raises(exc):
                generate(model, prompt, cache=cache, max_new_tokens=NEW, defer_stop=defer, streamer=streamer)
        finally:
            for block in model.layers:
                block.__dict__.pop("forward", None)
        check_consistent(model, cache, prompt, streamer.steps, expected, defer)


def test_defer_stop_true_refuses_before_any_work() -> None:
    """A cache layer that cannot undo a step even while recording: refused before the prefill."""

    class NeverCroppable(SlidingWindowLayer):
        @property
        def is_croppable(self) -> bool:
            return False

    model = MODELS["decoder"]
    cache = Cache([DynamicLayer(), NeverCroppable(4)])
    prompt = torch.randint(2, VOCAB, (1, 9), generator=torch.Generator().manual_seed(3))
    with pytest.raises(GenerationError, match="NeverCroppable"):
        generate(model, prompt, cache=cache, max_new_tokens=4, defer_stop=True)
    assert cache.get_seq_length() == 0 and not any(layer.record_past for layer in cache.layers)


@pytest.mark.parametrize(
    "make",
    [
        lambda: DynamicCache(["full_attention", "sliding_attention"], sliding_window=2),  # model's window is 4
        lambda: DynamicCache(["full_attention", "sliding_attention", "full_attention"], sliding_window=4),
        lambda: DynamicCache(["full_attention", "full_attention"]),
    ],
    ids=["other window", "extra layer", "full for sliding"],
)
def test_an_empty_cache_shaped_for_another_model_is_refused(make: Any) -> None:
    model = MODELS["decoder"]
    cache = make()
    prompt = torch.randint(2, VOCAB, (1, 9), generator=torch.Generator().manual_seed(3))
    with pytest.raises(KVCacheError):
        generate(model, prompt, cache=cache, max_new_tokens=4)
    assert cache.get_seq_length() == 0


def test_generate_continues_a_static_cache_it_returned() -> None:
    """A full-attention model's cache may hold its keys statically; generate continues it."""
    from kvcache import StaticCache

    torch.manual_seed(0)
    from kvcache.models import DecoderConfig, DecoderLM

    model = DecoderLM(DecoderConfig(vocab_size=VOCAB, layer_types=["full_attention", "full_attention"])).eval()
    prompt = torch.randint(2, VOCAB, (1, 9), generator=torch.Generator().manual_seed(3))
    whole = generate(model, prompt, max_new_tokens=10)
    first = generate(model, prompt, cache=StaticCache(64, num_layers=2), max_new_tokens=5)
    more = generate(model, first.sequences, cache=first.cache, max_new_tokens=5)
    assert torch.equal(more.sequences, whole.sequences)


class InPlaceStateModel:
    """A one-layer recurrent model that overwrites its held state in place and hands the same tensor
    back (legal, but it destroys the state before the step, so that step cannot be undone)."""

    vocab_size = VOCAB

    def new_cache(self) -> Cache:
        from kvcache import RecurrentLayer

        return Cache([RecurrentLayer()])

    def __call__(self, input_ids: torch.Tensor, *, cache: Cache, **kwargs: Any) -> torch.Tensor:
        state = cache.get_recurrent_state(0)
        step = input_ids.float().sum(dim=1, keepdim=True)
        if state is None:
            cache.update_recurrent_state(step, 0, num_tokens=input_ids.shape[1])
        else:
            state.mul_(0.5).add_(step)  # in place
            cache.update_recurrent_state(state, 0, num_tokens=input_ids.shape[1])
        held = cache.get_recurrent_state(0)
        logits = torch.arange(VOCAB, dtype=torch.float32) * held[:, :1] % 7
        return logits[:, None, :].expand(-1, input_ids.shape[1], -1)


def test_defer_stop_true_refuses_a_model_that_overwrites_states_in_place() -> None:
    """Found by the recorded probe step before the prefill, not after the whole decode has streamed."""
    model = InPlaceStateModel()
    cache, streamer = model.new_cache(), TokenCollector()
    prompt = torch.randint(2, VOCAB, (1, 5), generator=torch.Generator().manual_seed(3))
    with pytest.raises(GenerationError, match="defer_stop=True"):
        generate(model, prompt, cache=cache, max_new_tokens=6, defer_stop=True, streamer=streamer)
    assert streamer.steps == [] and cache.get_seq_length() == 0
    out = generate(model, prompt, cache=cache, max_new_tokens=6, streamer=streamer)  # the immediate check works
    assert len(streamer.steps) == 6 and out.cache.get_seq_length() == prompt.shape[1] + 5
