"""The reference models' attention against a naive float64 softmax with an explicit mask, for
every geometry its fast paths take (a decode step, a prefill from nothing, a block onto a cache
with grouped heads, a long sliding-window prefill) and the masked fallback (padding, ragged rows).

The fast paths compute the same softmax in other pieces (the flash kernel's blocks, two partial
softmaxes merged by their log-sum-exps), so they agree up to rounding: 2e-6 at float32 (max
measured 4e-7 at 1 and 2 threads on this machine's CPUs) and 1e-12 at float64."""

from __future__ import annotations

import pytest
import torch

from kvcache.models.attention import masked_attention


def naive(q, k, v, past, kv_offset, window, attention_mask):
    """Float64 softmax over the visible keys, one query row at a time."""
    batch, heads, length, _ = q.shape
    groups = heads // k.shape[1]
    k, v = k.double().repeat_interleave(groups, 1), v.double().repeat_interleave(groups, 1)
    out = torch.zeros(q.shape, dtype=torch.float64)
    for b in range(batch):
        start = past[b] if isinstance(past, list) else past
        for i in range(length):
            pos = start + i
            keys = [j for j in range(k.shape[2]) if kv_offset + j <= pos
                    and (window is None or pos - (kv_offset + j) < window)
                    and (attention_mask is None or attention_mask[b, kv_offset + j])]  # fmt: skip
            scores = q[b, :, i, None].double() @ k[b, :, keys].transpose(-1, -2) / q.shape[-1] ** 0.5
            out[b, :, i] = (torch.softmax(scores, -1) @ v[b, :, keys])[:, 0]
    return out


CASES = {  # (batch, heads, kv_heads, queries, past, kv_offset, keys held, window, padded)
    "decode step": (2, 4, 2, 1, 40, 0, 41, None, False),
    "decode step, window": (1, 4, 2, 1, 40, 33, 8, 8, False),
    "prefill from nothing": (2, 4, 2, 30, 0, 0, 30, None, False),
    "block onto a cache, grouped": (2, 6, 2, 24, 50, 0, 74, None, False),
    "block onto a cache, one kv head": (1, 4, 1, 9, 5, 0, 14, None, False),
    # more scores than SMALL_MASK: the block and the prefix in two pieces, merged
    "long block onto a cache, merged": (1, 4, 2, 160, 300, 0, 460, None, False),
    "block within a window": (1, 4, 2, 6, 20, 10, 16, 32, False),
    "long prefill, window": (1, 4, 2, 70, 0, 0, 70, 8, False),
    "long block onto a window": (1, 4, 2, 40, 30, 23, 47, 8, False),
    "padded": (2, 4, 2, 12, 6, 0, 18, None, True),
    "padded, window": (2, 4, 2, 12, 6, 0, 18, 5, True),
}


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 2e-6), (torch.float64, 1e-12)])
@pytest.mark.parametrize("case", list(CASES))
def test_attention_matches_a_naive_softmax(case: str, dtype: torch.dtype, tol: float) -> None:
    batch, heads, kv_heads, length, past, kv_offset, held, window, padded = CASES[case]
    g = torch.Generator().manual_seed(len(case))
    q = torch.randn(batch, heads, length, 16, generator=g, dtype=dtype)
    # keys as a cache hands them out: a view of sequence-major storage
    k = torch.randn(held, batch, kv_heads, 16, generator=g, dtype=dtype).permute(1, 2, 0, 3)
    v = torch.randn(held, batch, kv_heads, 16, generator=g, dtype=dtype).permute(1, 2, 0, 3)
    mask = None
    if padded:
        mask = torch.ones(batch, past + length, dtype=torch.long)
        mask[0, :3] = 0  # row 0 left-padded by 3
    out = masked_attention(q, k, v, past_length=past, kv_offset=kv_offset, sliding_window=window,
                           attention_mask=mask, masks={})  # fmt: skip
    expected = naive(q, k, v, past, kv_offset, window, mask)
    if padded:
        expected[0, :, : max(0, 3 - past)] = out[0, :, : max(0, 3 - past)].double()  # pad queries: any finite
    torch.testing.assert_close(out.double(), expected, rtol=tol, atol=tol)


@pytest.mark.parametrize("case, merged", [("block onto a cache, grouped", False),
                                          ("long block onto a cache, merged", True)])  # fmt: skip
def test_a_block_is_merged_from_two_pieces_only_past_small_mask(case: str, merged: bool, monkeypatch) -> None:
    """Which path a block onto a cache takes: a few scores (a verify forward) one small mask, more
    than `SMALL_MASK` the two merged pieces (no mask over all keys)."""
    import kvcache.models.attention as attention

    batch, heads, kv_heads, length, past, kv_offset, held, window, _ = CASES[case]
    assert (length * held > attention.SMALL_MASK) == merged
    calls = []
    real = attention._prefix_then_causal
    monkeypatch.setattr(attention, "_prefix_then_causal", lambda *a: calls.append(1) or real(*a))
    q = torch.randn(batch, heads, length, 16)
    k, v = torch.randn(batch, kv_heads, held, 16), torch.randn(batch, kv_heads, held, 16)
    masked_attention(q, k, v, past_length=past, kv_offset=kv_offset, sliding_window=window, attention_mask=None)
    assert bool(calls) == merged


def test_ragged_rows_see_their_own_positions() -> None:
    """Per-row past lengths (a ragged cache): each row's queries see only its own keys."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 3, 16, generator=g, dtype=torch.float64)
    k = torch.randn(2, 2, 10, 16, generator=g, dtype=torch.float64)
    v = torch.randn(2, 2, 10, 16, generator=g, dtype=torch.float64)
    past = torch.tensor([7, 4])
    out = masked_attention(q, k, v, past_length=past, kv_offset=0, sliding_window=None, attention_mask=None)
    torch.testing.assert_close(out, naive(q, k, v, [7, 4], 0, None, None), rtol=1e-12, atol=1e-12)
