"""`prefill_blocks`: position-aligned blocks make a resumed prefill the same computation as an
uninterrupted one (bitwise), and cost-effective blocks agree with one whole-prompt forward within
float32 rounding; bad arguments change nothing."""

from __future__ import annotations

import pytest
import torch

from kvcache import load_cache, save_cache
from kvcache.errors import GenerationError
from kvcache.generation.blocks import prefill_blocks, whole_blocks
from kvcache.models import DecoderConfig, DecoderLM


def _model() -> DecoderLM:
    torch.manual_seed(0)
    config = DecoderConfig(vocab_size=50, layer_types=["full_attention", "sliding_attention"], sliding_window=24)
    return DecoderLM(config).eval()


def test_whole_blocks_leaves_the_last_token() -> None:
    assert [whole_blocks(n, 64) for n in (0, 1, 64, 65, 129, 200)] == [0, 0, 0, 64, 128, 192]


def test_a_resumed_prefill_is_bitwise_the_uninterrupted_one(tmp_path) -> None:
    model, ids = _model(), torch.randint(0, 50, (1, 400))
    whole = prefill_blocks(model, ids, model.new_cache(), block=64, end=384)
    first = prefill_blocks(model, ids, model.new_cache(), block=64, end=128)
    save_cache(first, tmp_path / "c.kvcache")
    resumed = prefill_blocks(model, ids, load_cache(tmp_path / "c.kvcache"), block=64, end=384)
    for a, b in zip(whole.layers, resumed.layers, strict=True):
        assert all(torch.equal(a.state[name], b.state[name]) for name in a.state)
    with torch.no_grad():  # one forward over the same tokens: other shapes, so rounding may differ
        one = model(ids[:, :385], cache=model.new_cache())[:, -1]
        blocked = model(ids[:, 384:385], cache=whole)[:, -1]
    torch.testing.assert_close(blocked, one, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("block, end", [(0, 64), (64, 100), (64, 448), (True, 64)])
def test_bad_arguments_are_refused_and_change_nothing(block, end) -> None:
    model, ids = _model(), torch.randint(0, 50, (1, 400))
    cache = prefill_blocks(model, ids, model.new_cache(), block=64, end=64)
    before = [t.clone() for layer in cache.layers for t in layer.state.values()]
    with pytest.raises(GenerationError, match=r"block|end"):
        prefill_blocks(model, ids, cache, block=block, end=end)
    assert cache.get_seq_length() == 64
    after = [t for layer in cache.layers for t in layer.state.values()]
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))


class Recording:
    """A protocol model that names `logits_to_keep` and records what each forward asked for."""

    def __init__(self, model: DecoderLM) -> None:
        self.model, self.vocab_size, self.asked = model, model.vocab_size, []

    def new_cache(self):
        return self.model.new_cache()

    def __call__(self, input_ids, *, logits_to_keep: int = 0, **kwargs):
        self.asked.append((input_ids.shape[1], logits_to_keep))
        return self.model(input_ids, logits_to_keep=logits_to_keep, **kwargs)


def test_prefills_compute_the_head_on_one_position() -> None:
    """`prefill_blocks` (whose logits nobody reads) and `generate`'s prompt forward ask for the last
    position's logits only; decode steps feed one token. The tokens are those of a model that
    cannot skip the head (a plain callable without the parameter: the caller slices)."""
    from kvcache.generation import generate

    model = _model().double()  # float64: the two heads' last bits cannot flip a greedy token
    ids = torch.randint(0, 50, (1, 200), generator=torch.Generator().manual_seed(4))
    recording = Recording(model)
    prefill_blocks(recording, ids, recording.new_cache(), block=64, end=192)
    assert recording.asked == [(64, 1)] * 3
    recording.asked.clear()
    out = generate(recording, ids, max_new_tokens=5).sequences
    assert recording.asked[0] == (200, 1) and {keep for n, keep in recording.asked[1:]} == {0}

    class Plain:  # the protocol without logits_to_keep
        vocab_size = model.vocab_size
        new_cache = model.new_cache

        def __call__(self, input_ids, **kwargs):
            return model(input_ids, **kwargs)

    assert torch.equal(generate(Plain(), ids, max_new_tokens=5).sequences, out)
