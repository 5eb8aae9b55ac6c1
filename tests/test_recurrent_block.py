"""End to end: a small real recurrent block (causal depthwise conv feeding a gated linear recurrence)
decoded with the cache, rolled back, and decoded again, bitwise against runs that never took the
undone steps and against a cache-free forward over the whole sequence.

The block computes token by token on contiguous per-token tensors, so a token gives the same bits
whichever way it is fed (in a chunk, alone, in place or not) and every comparison here is bitwise.
"""

from __future__ import annotations

import pytest
import torch

from kvcache import DynamicCache, RollbackError

HEADS, DK, DV, KERNEL = 2, 3, 4, 4
CHANNELS = HEADS * (2 * DK + DV + 1)


class GatedConvRecurrence:
    """x [batch, T, CHANNELS] -> y [batch, T, HEADS, DV], through the cache's conv/recurrent states."""

    def __init__(self, seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.weight = torch.randn(CHANNELS, KERNEL, generator=gen) * 0.5

    def conv(self, window: torch.Tensor, t: int) -> torch.Tensor:
        """Outputs [B, C, t] for the last `t` columns of `window` [B, C, >= t]; zero left context beyond it."""
        padded = torch.nn.functional.pad(window, (KERNEL - 1, 0))[..., -(t + KERNEL - 1) :]
        outs = []
        for i in range(t):  # per token and contiguous: the same bits whatever the chunk length
            acc = torch.zeros(window.shape[0], CHANNELS)
            for j in range(KERNEL):
                acc = acc + self.weight[:, j] * padded[..., i + j].contiguous()
            outs.append(torch.nn.functional.silu(acc))
        return torch.stack(outs, -1)

    def recur(self, feats: torch.Tensor, h: torch.Tensor | None) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """feats [B, C, T] -> outputs [B, T, H, DV] and the state after each token."""
        b, _, t = feats.shape
        h = torch.zeros(b, HEADS, DK, DV) if h is None else h.clone()
        ys, states = [], []
        for i in range(t):
            q, k, v, g = feats[..., i].contiguous().reshape(b, HEADS, -1).split([DK, DK, DV, 1], dim=-1)
            h = torch.sigmoid(g.contiguous())[..., None] * h + k[..., :, None] * v[..., None, :]
            ys.append((q[..., :, None] * h).sum(-2))
            states.append(h)
        return torch.stack(ys, 1), states

    def forward(self, x: torch.Tensor, cache=None, layer_idx: int = 0, intermediates: bool = False) -> torch.Tensor:
        u = x.transpose(1, 2)
        t = u.shape[-1]
        if cache is None:
            return self.recur(self.conv(u, t), None)[0]
        conv_state = cache.get_conv_state(layer_idx)
        h = cache.get_recurrent_state(layer_idx)
        if conv_state is not None and h is not None and t == 1 and not cache.is_recording_past(layer_idx):
            # transformers' fast path: update both held states in place, tell the cache nothing
            conv_state.copy_(torch.cat([conv_state[..., 1:], u], -1))
            y, states = self.recur(self.conv(conv_state, 1), h)
            h.copy_(states[-1])
            return y
        window = cache.update_conv_state(u, layer_idx, conv_kernel_size=KERNEL)
        y, states = self.recur(self.conv(window, t), h)
        inter = torch.stack(states, 1) if intermediates else None
        cache.update_recurrent_state(states[-1], layer_idx, intermediate_states=inter)
        return y


def tokens(n: int, seed: int, batch: int = 2) -> torch.Tensor:
    return torch.randn(batch, n, CHANNELS, generator=torch.Generator().manual_seed(seed))


def decode(block: GatedConvRecurrence, cache: DynamicCache, xs: torch.Tensor) -> torch.Tensor:
    ys = [block.forward(xs[:, i : i + 1], cache) for i in range(xs.shape[1])]
    return torch.cat(ys, 1) if ys else torch.zeros(xs.shape[0], 0, HEADS, DV)


def assert_states_equal(a: DynamicCache, b: DynamicCache) -> None:
    assert torch.equal(a.get_conv_state(0), b.get_conv_state(0))
    assert torch.equal(a.get_recurrent_state(0), b.get_recurrent_state(0))


@pytest.mark.parametrize("prompt_len", [2, 7])
def test_rollback_then_decode_matches_run_without_the_undone_steps(prompt_len: int) -> None:
    block = GatedConvRecurrence()
    prompt, kept, undone, after = tokens(prompt_len, 1), tokens(3, 2), tokens(4, 3), tokens(5, 4)
    full = block.forward(torch.cat([prompt, kept, after], 1))  # no cache at all

    cache = DynamicCache(["linear_attention"])
    cache.activate_past_recording()
    y_prompt = block.forward(prompt, cache)
    y_kept = decode(block, cache, kept)
    decode(block, cache, undone)
    assert cache.max_rollback == prompt_len + 7 and cache.is_croppable
    cache.crop(-1)
    cache.crop(-3)
    y_after = decode(block, cache, after)

    ref = DynamicCache(["linear_attention"])
    ref.activate_past_recording()
    ref_ys = [block.forward(prompt, ref), decode(block, ref, kept), decode(block, ref, after)]
    assert torch.equal(torch.cat([y_prompt, y_kept, y_after], 1), torch.cat(ref_ys, 1))
    assert torch.equal(torch.cat(ref_ys, 1), full)
    assert_states_equal(cache, ref)
    assert cache.get_seq_length(0) == ref.get_seq_length(0) == prompt_len + 8


def test_rollback_to_before_the_prompt_empties_the_layer() -> None:
    block = GatedConvRecurrence()
    cache = DynamicCache(["linear_attention"])
    cache.activate_past_recording()
    block.forward(tokens(5, 1), cache)
    decode(block, cache, tokens(2, 2))
    cache.crop(-7)
    assert cache.get_conv_state(0) is None and cache.get_recurrent_state(0) is None
    assert not cache.has_previous_state(0)
    xs = tokens(6, 3)
    fresh = DynamicCache(["linear_attention"])
    assert torch.equal(block.forward(xs, cache), block.forward(xs, fresh))
    assert_states_equal(cache, fresh)


def test_speculative_verify_rolls_back_inside_the_chunk() -> None:
    """k draft tokens verified in one forward with intermediate states; accept j, undo the rest."""
    block = GatedConvRecurrence()
    prompt, draft, after = tokens(6, 1), tokens(5, 2), tokens(3, 3)
    cache = DynamicCache(["linear_attention"])
    block.forward(prompt, cache)  # prefill before recording: no history kept
    cache.activate_past_recording()
    for accepted in (4, 2, 0):
        trial = cache.copy()
        y_draft = block.forward(draft, trial, intermediates=True)
        trial.crop(-(5 - accepted))
        y_after = decode(block, trial, after)
        trial.crop(0)

        ref = DynamicCache(["linear_attention"])
        block.forward(prompt, ref)
        ref_ys = [decode(block, ref, draft[:, :accepted]), decode(block, ref, after)]
        assert torch.equal(torch.cat([y_draft[:, :accepted], y_after], 1), torch.cat(ref_ys, 1))
        assert_states_equal(trial, ref)
    # without intermediate states the same crop is refused and changes nothing
    block.forward(draft, cache)
    before = (cache.get_conv_state(0).clone(), cache.get_recurrent_state(0).clone())
    with pytest.raises(RollbackError, match="step boundary"):
        cache.crop(-2)
    assert torch.equal(cache.get_conv_state(0), before[0])
    assert torch.equal(cache.get_recurrent_state(0), before[1])
    cache.crop(-5)  # the whole step is a boundary


def test_in_place_fast_path_without_recording_matches_full_forward() -> None:
    block = GatedConvRecurrence()
    prompt, rest = tokens(3, 1), tokens(6, 2)
    cache = DynamicCache(["linear_attention"])
    ys = torch.cat([block.forward(prompt, cache), decode(block, cache, rest)], 1)
    recording = DynamicCache(["linear_attention"])  # same tokens through update_conv_state each step
    recording.activate_past_recording()
    ref = torch.cat([block.forward(prompt, recording), decode(block, recording, rest)], 1)
    assert torch.equal(ys, ref)
    assert_states_equal(cache, recording)
    assert torch.equal(ys, block.forward(torch.cat([prompt, rest], 1)))
    assert not cache.is_croppable and cache.max_rollback == 0
    with pytest.raises(RollbackError):
        cache.crop(-1)


def test_mamba2_style_in_place_recurrent_update_while_recording_rolls_back() -> None:
    """Recording: the conv goes through the cache, the recurrent state is updated in place (Mamba2)."""
    block = GatedConvRecurrence()
    prompt, undone, after = tokens(4, 1), tokens(3, 2), tokens(2, 3)

    def step_in_place(cache: DynamicCache, x: torch.Tensor) -> torch.Tensor:
        h = cache.get_recurrent_state(0)
        window = cache.update_conv_state(x.transpose(1, 2), 0, conv_kernel_size=KERNEL)
        y, states = block.recur(block.conv(window, 1), h)
        h.copy_(states[-1])  # no update_recurrent_state call
        return y

    cache = DynamicCache(["linear_attention"])
    block.forward(prompt, cache)
    cache.activate_past_recording()
    for i in range(3):
        step_in_place(cache, undone[:, i : i + 1])
    cache.crop(-3)
    ys = torch.cat([step_in_place(cache, after[:, i : i + 1]) for i in range(2)], 1)
    ref = DynamicCache(["linear_attention"])
    block.forward(prompt, ref)
    ref.activate_past_recording()
    assert torch.equal(ys, torch.cat([step_in_place(ref, after[:, i : i + 1]) for i in range(2)], 1))
    assert_states_equal(cache, ref)


def test_beam_reorder_then_rollback_follows_the_rows() -> None:
    block = GatedConvRecurrence()
    cache = DynamicCache(["linear_attention"])
    cache.activate_past_recording()
    xs = tokens(4, 1, batch=3)
    block.forward(xs, cache)
    decode(block, cache, tokens(2, 2, batch=3))
    cache.reorder_cache(torch.tensor([2, 0, 1]))
    cache.crop(-2)
    ref = DynamicCache(["linear_attention"])
    block.forward(xs[[2, 0, 1]], ref)
    assert_states_equal(cache, ref)
