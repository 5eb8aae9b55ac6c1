"""`RecurrentLayer` unit tests: transformers parity, several state indices, lost snapshots, persistence
validation, the composite cache's forwarders and layer types."""

from __future__ import annotations

import json

import pytest
import torch

from kvcache import (
    CacheInputError,
    DynamicCache,
    DynamicLayer,
    HybridLayer,
    RecurrentLayer,
    RollbackError,
    SlidingWindowLayer,
)

transformers_cache = pytest.importorskip("transformers.cache_utils")

K = 4


def rand(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


# ------------------------------------------------------------------------- transformers parity
@pytest.mark.parametrize("chunks", [[2, 1, 1, 3, 1], [6, 1, 2], [4, 1], [1, 1, 1, 1, 1, 1]])
@pytest.mark.parametrize("kernel", [None, K])
def test_matches_transformers_linear_attention_layer(chunks: list[int], kernel: int | None) -> None:
    """Identical call sequences: same returned conv inputs, same held conv window and recurrent state."""
    theirs = transformers_cache.LinearAttentionLayer()
    ours, ours_recording = RecurrentLayer(), RecurrentLayer()
    ours_recording.activate_past_recording()
    for i, n in enumerate(chunks):
        x, state = rand(2, 3, n, seed=i), rand(2, 4, 5, seed=100 + i)
        expected = theirs.update_conv_state(x, conv_kernel_size=kernel)
        assert torch.equal(ours.update_conv_state(x, conv_kernel_size=kernel), expected)
        # the return value does not depend on recording
        assert torch.equal(ours_recording.update_conv_state(x, conv_kernel_size=kernel), expected)
        assert torch.equal(ours.get_conv_state(), theirs.conv_states[0])
        assert torch.equal(ours_recording.get_conv_state(), theirs.conv_states[0])
        held = ours.update_recurrent_state(state)
        ours_recording.update_recurrent_state(state)
        assert torch.equal(held, theirs.update_recurrent_state(state))
        assert torch.equal(ours_recording.get_recurrent_state(), theirs.recurrent_states[0])
    assert ours.get_seq_length() == ours_recording.get_seq_length() == sum(chunks)


def test_recording_return_is_the_tail_of_what_transformers_returns() -> None:
    """transformers hands back the whole recorded history while recording; the conv reads its tail."""
    theirs, ours = transformers_cache.LinearAttentionLayer(), RecurrentLayer()
    theirs.activate_past_recording()
    ours.activate_past_recording()
    for i, n in enumerate([5, 1, 2, 1]):
        x = rand(1, 3, n, seed=i)
        full = theirs.update_conv_state(x, conv_kernel_size=K)
        got = ours.update_conv_state(x, conv_kernel_size=K)
        assert torch.equal(got, full[..., -got.shape[-1] :])
    theirs.crop(-3)
    ours.crop(-3)
    assert torch.equal(ours.get_conv_state(), theirs.conv_states[0])


def test_in_place_update_of_get_conv_state_sticks_while_not_recording() -> None:
    layer = RecurrentLayer()
    assert layer.get_conv_state() is None and layer.get_recurrent_state() is None
    layer.update_conv_state(rand(1, 2, 3, seed=0), conv_kernel_size=K)
    window = layer.get_conv_state()
    window.mul_(2.0)  # the model's in-place single-token update
    doubled = window.clone()
    x = rand(1, 2, 1, seed=1)
    returned = layer.update_conv_state(x)
    assert torch.equal(returned, torch.cat([doubled, x], -1))
    assert layer.get_conv_state() is window  # still the held tensor, now the last K inputs
    assert torch.equal(window, returned[..., -K:])


# ---------------------------------------------------------------------------- state indices
def test_several_state_indices_are_independent_and_rolled_back_together() -> None:
    layer = RecurrentLayer(num_states=2)
    layer.activate_past_recording()
    for step, n in enumerate([3, 1, 2]):
        for s in range(2):
            layer.update_conv_state(rand(1, 2 + s, n, seed=10 * step + s), state_idx=s, conv_kernel_size=K)
            layer.update_recurrent_state(rand(1, 3 + s, seed=10 * step + s + 5), state_idx=s)
        if step == 0:
            saved = [(layer.get_conv_state(s).clone(), layer.get_recurrent_state(s).clone()) for s in range(2)]
    assert layer.has_previous_state() and layer.has_previous_state(1)
    assert layer.max_rollback == 6
    with pytest.raises(RollbackError):
        layer.crop(-1)  # inside the last step (2 tokens, no intermediate states)
    layer.crop(-3)
    for s in range(2):
        assert torch.equal(layer.get_conv_state(s), saved[s][0])
        assert torch.equal(layer.get_recurrent_state(s), saved[s][1])
    with pytest.raises(CacheInputError, match="state_idx"):
        layer.get_conv_state(2)


def test_has_previous_state_requires_every_index_by_default() -> None:
    layer = RecurrentLayer(num_states=2)
    layer.update_conv_state(rand(1, 2, 1, seed=0), state_idx=0)
    assert layer.has_previous_state(0) and not layer.has_previous_state(1) and not layer.has_previous_state()


# ----------------------------------------------------------------------- lost snapshots
def test_state_mutated_in_place_then_handed_back_makes_that_boundary_unrestorable() -> None:
    layer = RecurrentLayer()
    layer.update_recurrent_state(rand(1, 3, seed=0))
    layer.activate_past_recording()
    assert layer.is_croppable
    held = layer.get_recurrent_state()
    held.add_(1.0)  # the model overwrote the state before the step, then passes that same tensor
    layer.update_recurrent_state(held)
    after_first = held.clone()
    layer.update_recurrent_state(rand(1, 3, seed=1))
    assert not layer.is_croppable and layer.max_rollback == 2
    meta = json.dumps(layer.meta_state)
    with pytest.raises(RollbackError, match="step boundary"):
        layer.crop(-2)
    assert json.dumps(layer.meta_state) == meta
    layer.crop(-1)  # the boundary after the lost one is still known
    assert torch.equal(layer.get_recurrent_state(), after_first)
    layer.crop(0)
    assert layer.is_croppable


def test_recurrent_only_token_counts() -> None:
    layer = RecurrentLayer()
    layer.activate_past_recording()
    layer.update_recurrent_state(rand(1, 3, seed=0))  # one token by default
    layer.update_recurrent_state(rand(1, 3, seed=1), num_tokens=4)
    layer.update_recurrent_state(rand(1, 3, seed=2), intermediate_states=rand(1, 3, 3, seed=3))
    assert layer.get_seq_length() == 8 and layer.max_rollback == 8
    with pytest.raises(CacheInputError, match="num_tokens"):
        layer.update_recurrent_state(rand(1, 3, seed=4), intermediate_states=rand(1, 2, 3, seed=5), num_tokens=3)
    with pytest.raises(RollbackError):
        layer.crop(-5)
    layer.crop(-2)  # inside the intermediate-states step
    assert layer.get_seq_length() == 6


def test_states_after_the_last_tokens_of_a_step_let_crops_land_there_only() -> None:
    """A 6-token conv step handed the states after its last 3 tokens (transformers >= 5.25 computes
    only those): crops of 1 and 2 tokens land on the given states, a crop of 6 on the state before
    the step; 3, 4 and 5 land where no state is known and are refused with nothing changed."""
    for crop in range(7):
        layer = RecurrentLayer()
        layer.update_conv_state(rand(1, 2, 5, seed=0), conv_kernel_size=K)
        layer.update_recurrent_state(rand(1, 3, seed=1))
        before = layer.get_recurrent_state().clone()
        layer.activate_past_recording()
        layer.update_conv_state(rand(1, 2, 6, seed=2))
        states = rand(1, 3, 3, seed=3)  # after tokens 4, 5, 6
        layer.update_recurrent_state(states[:, -1].clone(), intermediate_states=states)
        expected = {0: states[:, 2], 1: states[:, 1], 2: states[:, 0], 6: before}
        if crop in expected:
            layer.crop(-crop)
            assert torch.equal(layer.get_recurrent_state(), expected[crop]), crop
            assert layer.get_seq_length() == 11 - crop
        else:
            with pytest.raises(RollbackError):
                layer.crop(-crop)
            assert torch.equal(layer.get_recurrent_state(), states[:, 2]) and layer.get_seq_length() == 11


def test_in_place_conv_tokens_are_counted_and_refused_while_recording() -> None:
    """transformers >= 5.25 reports a conv window it updated in place (`increase_count`): the layer
    counts the token, and the recurrent update that follows belongs to that token's step."""
    layer = RecurrentLayer()
    layer.update_conv_state(rand(1, 2, 5, seed=0), conv_kernel_size=K)
    layer.update_recurrent_state(rand(1, 3, seed=1))
    layer.increase_count()
    layer.update_recurrent_state(rand(1, 3, seed=2))
    assert layer.get_seq_length() == 6
    layer.activate_past_recording()
    with pytest.raises(RollbackError, match="in place"):
        layer.increase_count()
    assert layer.get_seq_length() == 6


def test_conv_step_and_recurrent_token_counts_must_agree() -> None:
    layer = RecurrentLayer()
    layer.update_conv_state(rand(1, 2, 3, seed=0), conv_kernel_size=K)
    with pytest.raises(CacheInputError, match="conv update"):  # more states than the step's tokens
        layer.update_recurrent_state(rand(1, 3, seed=1), intermediate_states=rand(1, 4, 3, seed=2))
    assert layer.get_recurrent_state() is None


# ---------------------------------------------------------------------------- attention calls
def test_attention_calls_are_refused() -> None:
    layer = RecurrentLayer()
    with pytest.raises(CacheInputError):
        layer.update(torch.zeros(1, 1, 1, 2), torch.zeros(1, 1, 1, 2))
    with pytest.raises(CacheInputError):
        layer.get_mask_sizes(1)
    with pytest.raises(CacheInputError):
        RecurrentLayer(num_states=0)


# ------------------------------------------------------------------------------- persistence
def recorded_layer() -> RecurrentLayer:
    layer = RecurrentLayer()
    layer.update_conv_state(rand(2, 3, 5, seed=0), conv_kernel_size=K)
    layer.update_recurrent_state(rand(2, 4, seed=1))
    layer.activate_past_recording()
    layer.update_conv_state(rand(2, 3, 2, seed=2))
    layer.update_recurrent_state(rand(2, 4, seed=3), intermediate_states=rand(2, 2, 4, seed=4))
    return layer


def test_round_trip_then_rollback_is_exact() -> None:
    layer = recorded_layer()
    rebuilt = RecurrentLayer.from_state(json.loads(json.dumps(layer.meta_state)), layer.copy().state)
    for one in (layer, rebuilt):
        one.crop(-1)
    assert torch.equal(layer.get_conv_state(), rebuilt.get_conv_state())
    assert torch.equal(layer.get_recurrent_state(), rebuilt.get_recurrent_state())


@pytest.mark.parametrize(
    "tamper",
    [
        lambda m, s: s.pop("recurrent_history.0.0"),
        lambda m, s: s.update(extra=torch.zeros(1)),
        lambda m, s: s.update({"conv.0": s["conv.0"][..., 1:]}),
        lambda m, s: s.update({"intermediate.0.0": s["intermediate.0.0"][..., :2]}),
        lambda m, s: s.update({"recurrent.0": s["recurrent.0"][:1]}),
        lambda m, s: m.update(record_past=False),
        lambda m, s: m.update(num_states=2),
        lambda m, s: m["slots"][0].update(seen=1),
        lambda m, s: m["slots"][0]["steps"][0].update(tokens=3),
        lambda m, s: m["slots"][0]["steps"][0].update(before="bogus"),
        lambda m, s: m["slots"][0].pop("kernel"),
        lambda m, s: m["slots"][0].update(kernel="4"),
    ],
)
def test_from_state_rejects_inconsistent_input(tamper) -> None:
    layer = recorded_layer()
    meta, state = json.loads(json.dumps(layer.meta_state)), dict(layer.state)
    tamper(meta, state)
    with pytest.raises(CacheInputError):
        RecurrentLayer.from_state(meta, state)


def test_copy_shares_nothing() -> None:
    layer = recorded_layer()
    clone = layer.copy()
    for t in layer.state.values():
        t.zero_()
    assert all(v.abs().sum() > 0 for k, v in clone.state.items() if k != "conv.0")


# --------------------------------------------------------------------------------- composite
def test_dynamic_cache_layer_types_and_forwarders() -> None:
    cache = DynamicCache(
        ["full_attention", "linear_attention", "mamba", "conv", "hybrid", "hybrid_sliding"], sliding_window=3
    )
    kinds = [type(layer) for layer in cache.layers]
    assert kinds == [DynamicLayer, RecurrentLayer, RecurrentLayer, RecurrentLayer, HybridLayer, HybridLayer]
    assert isinstance(cache.layers[5].attention, SlidingWindowLayer) and cache.is_sliding[5]
    assert cache.is_linear == [False, True, True, True, False, False]
    assert cache.get_conv_state(1) is None and not cache.has_previous_state()
    x = rand(1, 3, 2, seed=0)
    out = cache.update_conv_state(x, 4, conv_kernel_size=K)
    assert torch.equal(out, torch.nn.functional.pad(x, (2, 0)))
    cache.update_recurrent_state(rand(1, 2, seed=1), layer_idx=4)
    # default: the last recurrent layer (5), as in transformers
    assert cache.has_previous_state(4) and not cache.has_previous_state(1) and not cache.has_previous_state()
    with pytest.raises(CacheInputError, match="holds no conv"):
        cache.get_conv_state(0)
    with pytest.raises(CacheInputError, match="holds no keys"):
        cache.update(torch.zeros(1, 1, 1, 2), torch.zeros(1, 1, 1, 2), 1)
    cache.activate_past_recording()
    assert all(cache.is_recording_past(i) for i in range(6))
    with pytest.raises(CacheInputError, match="sliding_window"):
        DynamicCache(["hybrid_sliding"])
