"""The hybrid reference model (attention + gated linear recurrence + a parallel-hybrid layer)
against its own cache-free forward, including rollback of conv and recurrent states."""

from __future__ import annotations

import pytest
import torch

from kvcache import CacheInputError, RollbackError
from kvcache.layers.hybrid import HybridLayer
from kvcache.layers.recurrent import RecurrentLayer
from kvcache.models import HybridConfig, HybridLM
from kvcache.models.hybrid import gated_linear_recurrence
from kvcache.protocol import CausalLM

# Cached (chunked, batched) and whole forwards are not the same computation: a matmul over 3 rows
# and one over 20 rows block their sums differently, so the last bits differ and grow through the
# layers. Largest gap measured over these tests (fp32 logits of magnitude ~1-10; 1 and 2 torch
# threads; AMD EPYC x86-64): 2.4e-5 (decoder), 6.2e-5 (hybrid). The bound leaves ~5x for other
# CPUs' kernels (AVX-512, arm64 NEON) and still catches any cache mistake, which moves logits by
# O(0.1). Comparisons of the *same* computation elsewhere are `torch.equal`.
ATOL = RTOL = 3e-4
VOCAB = 40


def hybrid(seed: int = 0) -> HybridLM:
    config = HybridConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_heads=4,
        num_kv_heads=2,
        layer_types=["linear_attention", "full_attention", "hybrid", "sliding_attention"],
        sliding_window=4,
        recurrent_heads=2,
        recurrent_key_dim=8,
        recurrent_value_dim=8,
        conv_kernel_size=4,
    )
    model = HybridLM(config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # weights large enough that any cache mistake shows in the logits
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * (0.3 if p.dim() > 1 else 0.5))
    return model.eval()


def tokens(batch: int, length: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(1, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def run_chunks(model, ids, chunks, cache=None, **kwargs):
    cache = model.new_cache() if cache is None else cache
    outs, start = [], 0
    for n in chunks:
        outs.append(model(ids[:, start : start + n], cache=cache, **kwargs))
        start += n
    return torch.cat(outs, dim=1)


def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.allclose(a, b, atol=ATOL, rtol=RTOL)


def test_recurrence_matches_its_closed_form():
    """y_t = (prod_{r<=t} a_r) S_0^T q_t + sum_{s<=t} (prod_{s<r<=t} a_r) beta_s (q_t . k_s) v_s."""
    gen = torch.Generator().manual_seed(0)
    b, t, h, dk, dv = 2, 7, 3, 4, 5
    q, k = torch.randn(b, t, h, dk, generator=gen), torch.randn(b, t, h, dk, generator=gen)
    v, s0 = torch.randn(b, t, h, dv, generator=gen), torch.randn(b, h, dk, dv, generator=gen)
    decay, beta = torch.rand(b, t, h, generator=gen), torch.rand(b, t, h, generator=gen)
    y, states = gated_linear_recurrence(q, k, v, decay, beta, s0)
    for i in range(t):
        want = decay[:, : i + 1].prod(1)[..., None] * torch.einsum("bhk,bhkv->bhv", q[:, i], s0)
        for j in range(i + 1):
            weight = decay[:, j + 1 : i + 1].prod(1) * beta[:, j] * (q[:, i] * k[:, j]).sum(-1)
            want = want + weight[..., None] * v[:, j]
        assert torch.allclose(y[:, i], want, atol=1e-5)
    final = decay.prod(1)[..., None, None] * s0
    for j in range(t):
        weight = decay[:, j + 1 :].prod(1) * beta[:, j]
        final = final + weight[..., None, None] * torch.einsum("bhk,bhv->bhkv", k[:, j], v[:, j])
    assert torch.allclose(states[:, -1], final, atol=1e-5)


@torch.no_grad()
def test_hybrid_cache_layer_kinds():
    model = hybrid()
    assert isinstance(model, CausalLM)
    cache = model.new_cache()
    kinds = [type(layer).__name__ for layer in cache.layers]
    assert kinds == ["RecurrentLayer", "DynamicLayer", "HybridLayer", "SlidingWindowLayer"]
    model(tokens(2, 6), cache=cache)
    parallel = cache.layers[2]
    assert isinstance(parallel, HybridLayer) and isinstance(parallel.recurrent, RecurrentLayer)
    assert parallel.get_seq_length() == 6 and parallel.get_recurrent_state() is not None
    assert cache.get_recurrent_state(0).shape == (2, 2, 8, 8)
    assert cache.get_conv_state(0).shape == (2, 2 * (8 + 8 + 8), 4)


@pytest.mark.parametrize(
    "chunks", [[6] + [1] * 10, [3, 1, 5, 2, 1, 4], [1] * 16, [2, 2, 2, 10]], ids=["prefill+1", "uneven", "ones", "even"]
)
@torch.no_grad()
def test_hybrid_incremental_matches_full_forward(chunks):
    model = hybrid()
    ids = tokens(2, 16)
    assert close(run_chunks(model, ids, chunks), model(ids))


@torch.no_grad()
def test_hybrid_recurrent_state_carries_information_across_steps():
    """Guard: the recurrence must matter, else a cache that drops its state would pass."""
    model = hybrid()
    ids = tokens(1, 10)
    other = ids.clone()
    other[0, 0] = (ids[0, 0] + 1) % VOCAB
    cache_a, cache_b = model.new_cache(), model.new_cache()
    model(ids[:, :6], cache=cache_a)
    model(other[:, :6], cache=cache_b)
    for layer in (0, 2):
        assert not torch.allclose(cache_a.get_recurrent_state(layer), cache_b.get_recurrent_state(layer))


@torch.no_grad()
def test_hybrid_left_padded_batch_matches_each_row_alone():
    model = hybrid()
    rows = [tokens(1, n, seed=n)[0] for n in (9, 4, 7)]
    width = 9
    ids = torch.zeros(3, width, dtype=torch.long)
    mask = torch.zeros(3, width, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, width - len(row) :], mask[i, width - len(row) :] = row, 1
    more = tokens(3, 5, seed=9)
    cache = model.new_cache()
    logits = [model(ids, cache=cache, attention_mask=mask)]
    for t in range(5):
        mask = torch.cat([mask, torch.ones(3, 1, dtype=torch.long)], dim=1)
        logits.append(model(more[:, t : t + 1], cache=cache, attention_mask=mask))
    logits = torch.cat(logits, dim=1)
    for i, row in enumerate(rows):
        alone = model(torch.cat([row, more[i]])[None])
        assert close(logits[i, width - len(row) :], alone[0]), f"row {i}"


@torch.no_grad()
def test_hybrid_crop_then_redecode_is_bitwise_a_run_without_those_steps():
    model = hybrid()
    ids, drafts, redo = tokens(2, 7), tokens(2, 5, seed=2), tokens(2, 4, seed=3)
    cache = model.new_cache()
    model(ids, cache=cache)
    cache.activate_past_recording()
    for t in range(5):
        model(drafts[:, t : t + 1], cache=cache)
    assert cache.max_rollback == 5
    cache.crop(-3)
    got = [model(redo[:, t : t + 1], cache=cache) for t in range(4)]

    reference = model.new_cache()
    model(ids, cache=reference)
    for t in range(2):
        model(drafts[:, t : t + 1], cache=reference)
    want = [model(redo[:, t : t + 1], cache=reference) for t in range(4)]
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)


@torch.no_grad()
def test_hybrid_verified_chunk_needs_intermediate_states_to_crop_inside_it():
    model = hybrid()
    ids, drafts, redo = tokens(1, 7), tokens(1, 4, seed=2), tokens(1, 3, seed=3)
    want = model(torch.cat([ids, drafts[:, :1], redo], dim=1))[:, -3:]

    cache = model.new_cache()
    model(ids, cache=cache)
    cache.activate_past_recording()
    model(drafts, cache=cache)  # one step of 4 tokens, states only at its ends
    with pytest.raises(RollbackError):
        cache.crop(-3)
    cache.crop(-4)  # the step boundary is fine
    model(drafts[:, :1], cache=cache)
    assert close(run_chunks(model, redo, [1, 1, 1], cache=cache), want)

    model.set_return_intermediate_states(True)
    cache = model.new_cache()
    model(ids, cache=cache)
    cache.activate_past_recording()
    model(drafts, cache=cache)
    cache.crop(-3)  # inside the step: the per-token states make it exact
    assert cache.get_seq_length() == 8
    assert close(run_chunks(model, redo, [1, 1, 1], cache=cache), want)


@torch.no_grad()
def test_hybrid_bad_input_leaves_cache_unchanged():
    model = hybrid()
    cache = model.new_cache()
    model(tokens(1, 5), cache=cache)
    state = cache.get_recurrent_state(0).clone()
    with pytest.raises(CacheInputError):
        model(tokens(1, 2), cache=cache, attention_mask=torch.ones(1, 2, dtype=torch.long))
    assert torch.equal(cache.get_recurrent_state(0), state) and cache.get_seq_length() == 5


def test_hybrid_config_rejects_unknown_layer_type():
    with pytest.raises(CacheInputError):
        HybridConfig(layer_types=["full_attention", "mamba"])
