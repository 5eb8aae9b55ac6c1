"""Reference decoder-only and encoder-decoder models against their own cache-free forward.

The independent reference everywhere is one forward over the whole sequence without a cache:
incremental decoding (prefill + single tokens, uneven chunks), left-padded batches and
crop-then-redecode must reproduce it (or, for rollback, reproduce bitwise a run that never took
the undone steps).
"""

from __future__ import annotations

import pytest
import torch

from kvcache import CacheInputError, DynamicCache, SlidingWindowLayer, StaticCache
from kvcache.models import DecoderConfig, DecoderLM, EncoderDecoderConfig, EncoderDecoderLM
from kvcache.protocol import CausalLM
from kvcache.protocol import EncoderDecoderLM as EncoderDecoderProtocol

# Cached (chunked, batched) and whole forwards are not the same computation: a matmul over 3 rows
# and one over 20 rows block their sums differently, so the last bits differ and grow through the
# layers. Largest gap measured over these tests (fp32 logits of magnitude ~1-10; 1 and 2 torch
# threads; AMD EPYC x86-64): 2.4e-5 (decoder), 6.2e-5 (hybrid). The bound leaves ~5x for other
# CPUs' kernels (AVX-512, arm64 NEON) and still catches any cache mistake, which moves logits by
# O(0.1). Comparisons of the *same* computation elsewhere are `torch.equal`.
ATOL = RTOL = 3e-4
VOCAB = 40


def randomize(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Weights large enough that logits are O(1) and any cache mistake shows in them."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * (0.3 if p.dim() > 1 else 0.1))
    return model.eval()


def decoder(layer_types=("full_attention", "sliding_attention", "sliding_attention"), window=4) -> DecoderLM:
    config = DecoderConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_heads=4,
        num_kv_heads=2,
        layer_types=list(layer_types),
        sliding_window=window,
    )
    return randomize(DecoderLM(config))


def tokens(batch: int, length: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(1, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def run_chunks(model, ids: torch.Tensor, chunks: list[int], cache=None, **kwargs) -> torch.Tensor:
    cache = model.new_cache() if cache is None else cache
    outs, start = [], 0
    for n in chunks:
        outs.append(model(ids[:, start : start + n], cache=cache, **kwargs))
        start += n
    assert start == ids.shape[1]
    return torch.cat(outs, dim=1)


# ------------------------------------------------------------------------------ decoder-only
@torch.no_grad()
def test_decoder_new_cache_has_one_layer_kind_per_model_layer():
    model = decoder()
    cache = model.new_cache()
    assert isinstance(model, CausalLM)
    kinds = [type(layer).__name__ for layer in cache.layers]
    assert kinds == ["DynamicLayer", "SlidingWindowLayer", "SlidingWindowLayer"]
    assert all(layer.sliding_window == 4 for layer in cache.layers if isinstance(layer, SlidingWindowLayer))


@pytest.mark.parametrize(
    "chunks", [[6] + [1] * 14, [3, 1, 5, 2, 1, 7, 1], [1] * 20, [20]], ids=["prefill+1", "uneven", "ones", "one"]
)
@torch.no_grad()
def test_decoder_incremental_matches_full_forward(chunks):
    model = decoder()
    ids = tokens(2, 20)
    full = model(ids)
    assert torch.allclose(run_chunks(model, ids, chunks), full, atol=ATOL, rtol=RTOL)


@torch.no_grad()
def test_decoder_sliding_window_changes_logits_beyond_the_window():
    """Guard against a test model in which the window does not matter (the tests above would then
    pass with a wrong window)."""
    ids = tokens(1, 20)
    sliding = decoder()(ids)
    full = decoder(("full_attention",) * 3)(ids)
    assert torch.allclose(sliding[:, :4], full[:, :4], atol=ATOL, rtol=RTOL)
    assert not torch.allclose(sliding[:, 8:], full[:, 8:], atol=1e-3)


@torch.no_grad()
def test_decoder_static_cache_matches_full_forward():
    model = decoder(("full_attention",) * 3)
    ids = tokens(2, 12)
    got = run_chunks(model, ids, [5, 1, 3, 1, 1, 1], cache=StaticCache(max_cache_len=16, num_layers=3))
    assert torch.allclose(got, model(ids), atol=ATOL, rtol=RTOL)


def left_pad(rows: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, width - len(row) :], mask[i, width - len(row) :] = row, 1
    return ids, mask


def check_left_padded_batch(model, explicit_positions: bool) -> None:
    rows = [tokens(1, n, seed=n)[0] for n in (11, 5, 8)]
    continuation = tokens(3, 6, seed=99)
    ids, mask = left_pad(rows)
    cache = model.new_cache()
    positions = (mask.cumsum(-1) - 1).clamp(min=0) if explicit_positions else None
    logits = [model(ids, cache=cache, attention_mask=mask, position_ids=positions)]
    for t in range(continuation.shape[1]):
        mask = torch.cat([mask, torch.ones(3, 1, dtype=torch.long)], dim=1)
        positions = mask.sum(-1, keepdim=True) - 1 if explicit_positions else None
        logits.append(model(continuation[:, t : t + 1], cache=cache, attention_mask=mask, position_ids=positions))
    logits = torch.cat(logits, dim=1)
    for i, row in enumerate(rows):
        alone = model(torch.cat([row, continuation[i]])[None])
        assert torch.allclose(logits[i, ids.shape[1] - len(row) :], alone[0], atol=ATOL, rtol=RTOL), f"row {i}"


@pytest.mark.parametrize("explicit_positions", [False, True])
@torch.no_grad()
def test_decoder_left_padded_batch_matches_each_row_alone(explicit_positions):
    check_left_padded_batch(decoder(), explicit_positions)


@torch.no_grad()
def test_decoder_crop_then_redecode_is_bitwise_a_run_without_those_steps():
    model = decoder()
    ids, drafts, redo = tokens(2, 9), tokens(2, 5, seed=2), tokens(2, 4, seed=3)
    cache = model.new_cache()
    model(ids, cache=cache)
    cache.activate_past_recording()
    for t in range(5):  # 5 steps, then undo the last 3 (sliding layers must bring evicted keys back)
        model(drafts[:, t : t + 1], cache=cache)
    cache.crop(-3)
    assert cache.get_seq_length() == 11
    got = [model(redo[:, t : t + 1], cache=cache) for t in range(4)]

    reference = model.new_cache()
    model(ids, cache=reference)
    for t in range(2):
        model(drafts[:, t : t + 1], cache=reference)
    want = [model(redo[:, t : t + 1], cache=reference) for t in range(4)]
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)


@torch.no_grad()
def test_decoder_crop_of_a_verified_chunk_matches_never_taken():
    """Speculative decoding: verify 4 drafts in one forward, reject the last 3, continue."""
    model = decoder()
    ids, drafts, redo = tokens(1, 9), tokens(1, 4, seed=2), tokens(1, 3, seed=3)
    cache = model.new_cache()
    model(ids, cache=cache)
    cache.activate_past_recording()
    model(drafts, cache=cache)
    cache.crop(-3)
    got = run_chunks(model, redo, [1, 1, 1], cache=cache)
    want = model(torch.cat([ids, drafts[:, :1], redo], dim=1))[:, -3:]
    assert torch.allclose(got, want, atol=ATOL, rtol=RTOL)


@torch.no_grad()
def test_decoder_bad_inputs_raise_and_leave_the_cache_unchanged():
    model = decoder()
    cache = model.new_cache()
    model(tokens(2, 5), cache=cache)
    bad_calls = [
        dict(input_ids=tokens(2, 3).float()),
        dict(input_ids=torch.full((2, 3), VOCAB)),
        dict(input_ids=tokens(2, 3), attention_mask=torch.ones(2, 3, dtype=torch.long)),  # should be past + 3
        dict(input_ids=tokens(2, 3), position_ids=torch.zeros(2, 4, dtype=torch.long)),
        dict(input_ids=torch.zeros(2, 0, dtype=torch.long)),
        dict(input_ids=tokens(2, 3), logits_to_keep=-1),
        dict(input_ids=tokens(2, 3), logits_to_keep=True),
        dict(input_ids=tokens(2, 3), logits_to_keep=1.0),
    ]
    for call in bad_calls:
        ids = call.pop("input_ids")
        with pytest.raises(CacheInputError):
            model(ids, cache=cache, **call)
        assert cache.get_seq_length() == 5 and all(layer.get_seq_length() == 5 for layer in cache.layers)


@torch.no_grad()
@pytest.mark.parametrize("keep", [1, 3, 12])
def test_decoder_logits_to_keep_returns_the_last_positions_and_fills_the_same_cache(keep):
    """`logits_to_keep=k` runs the head on the last k positions only. The layers compute what they
    compute without it (same shapes), so the cache is the same bit for bit (a next step's logits
    are equal); the head's matmul has fewer rows, so its sums may block differently (float64
    here: equal to 1e-12)."""
    model = decoder().double()
    ids, mask = tokens(2, 12), torch.ones(2, 12, dtype=torch.long)
    mask[1, :3] = 0  # a left-padded row
    full_cache, kept_cache = model.new_cache(), model.new_cache()
    full = model(ids, cache=full_cache, attention_mask=mask)
    kept = model(ids, cache=kept_cache, attention_mask=mask, logits_to_keep=keep)
    assert kept.shape == (2, keep, VOCAB)
    assert torch.allclose(kept, full[:, -keep:], rtol=0, atol=1e-12)
    step, step_mask = tokens(2, 1, seed=5), torch.cat([mask, torch.ones(2, 1, dtype=torch.long)], dim=1)
    assert torch.equal(model(step, cache=full_cache, attention_mask=step_mask),
                       model(step, cache=kept_cache, attention_mask=step_mask))  # fmt: skip


# --------------------------------------------------------------------------- encoder-decoder
def encoder_decoder() -> EncoderDecoderLM:
    config = EncoderDecoderConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        num_heads=4,
        num_kv_heads=2,
        encoder_layers=2,
        decoder_layer_types=["full_attention", "sliding_attention"],
        sliding_window=4,
    )
    return randomize(EncoderDecoderLM(config))


@torch.no_grad()
def test_encoder_decoder_incremental_matches_full_forward_and_projects_cross_kv_once():
    model = encoder_decoder()
    assert isinstance(model, EncoderDecoderProtocol)
    src, tgt = tokens(2, 7), tokens(2, 12, seed=5)
    enc = model.encode(src)
    full = model(tgt, encoder_hidden_states=enc)

    calls = []
    hooks = [b.cross_attn.k_proj.register_forward_hook(lambda *a: calls.append(1)) for b in model.decoder_layers]
    cache = model.new_cache()
    got = run_chunks(model, tgt, [3, 1, 1, 4, 1, 2], cache=cache, encoder_hidden_states=enc)
    for hook in hooks:
        hook.remove()
    assert torch.allclose(got, full, atol=ATOL, rtol=RTOL)
    assert len(calls) == 2  # once per decoder layer, on the first call only
    assert cache.is_updated == {0: True, 1: True}
    assert cache.cross_attention_cache.get_seq_length() == 7 and cache.get_seq_length() == 12


@torch.no_grad()
def test_encoder_decoder_padded_sources_match_each_row_alone():
    model = encoder_decoder()
    sources = [tokens(1, n, seed=n)[0] for n in (7, 3)]
    src = torch.zeros(2, 7, dtype=torch.long)
    src_mask = torch.zeros(2, 7, dtype=torch.long)
    for i, s in enumerate(sources):  # right padding, as T5/BART tokenizers do
        src[i, : len(s)], src_mask[i, : len(s)] = s, 1
    tgt = tokens(2, 6, seed=8)
    enc = model.encode(src, attention_mask=src_mask)
    got = run_chunks(model, tgt, [2, 1, 3], encoder_hidden_states=enc, encoder_attention_mask=src_mask)
    for i, s in enumerate(sources):
        alone = model(tgt[i : i + 1], encoder_hidden_states=model.encode(s[None]))
        assert torch.allclose(got[i], alone[0], atol=ATOL, rtol=RTOL), f"row {i}"


@torch.no_grad()
def test_encoder_decoder_crop_then_redecode_is_bitwise_and_keeps_cross_part():
    model = encoder_decoder()
    enc = model.encode(tokens(1, 6))
    start, drafts, redo = tokens(1, 3), tokens(1, 5, seed=2), tokens(1, 3, seed=3)
    cache = model.new_cache()
    model(start, cache=cache, encoder_hidden_states=enc)
    cross_keys = cache.cross_attention_cache.layers[0].keys.clone()
    cache.activate_past_recording()
    for t in range(5):
        model(drafts[:, t : t + 1], cache=cache, encoder_hidden_states=enc)
    cache.crop(-4)
    got = [model(redo[:, t : t + 1], cache=cache, encoder_hidden_states=enc) for t in range(3)]
    assert torch.equal(cache.cross_attention_cache.layers[0].keys, cross_keys)

    reference = model.new_cache()
    model(start, cache=reference, encoder_hidden_states=enc)
    model(drafts[:, :1], cache=reference, encoder_hidden_states=enc)
    want = [model(redo[:, t : t + 1], cache=reference, encoder_hidden_states=enc) for t in range(3)]
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)


@torch.no_grad()
def test_encoder_decoder_rejects_mismatched_encoder_states():
    model = encoder_decoder()
    enc = model.encode(tokens(2, 5))
    with pytest.raises(CacheInputError):
        model(tokens(3, 2), encoder_hidden_states=enc)
    with pytest.raises(CacheInputError):
        model(tokens(2, 2), encoder_hidden_states=enc, encoder_attention_mask=torch.ones(2, 4))


def test_configs_reject_unknown_layer_types():
    with pytest.raises(CacheInputError):
        DecoderConfig(layer_types=["full_attention", "mamba"])
    with pytest.raises(CacheInputError):
        DecoderConfig(layer_types=["sliding_attention"], sliding_window=None)
    with pytest.raises(CacheInputError):
        EncoderDecoderConfig(decoder_layer_types=["linear_attention"])


def test_dynamic_cache_without_layer_types_also_works():
    """A lazily built `DynamicCache()` suits an all-full-attention model too."""
    model = decoder(("full_attention",) * 3)
    ids = tokens(1, 8)
    with torch.no_grad():
        got = run_chunks(model, ids, [4, 4], cache=DynamicCache())
        assert torch.allclose(got, model(ids), atol=ATOL, rtol=RTOL)


@torch.no_grad()
def test_a_lazy_static_cache_answers_mask_sizes_as_the_layer_it_will_build():
    """Before its layers exist, a lazy StaticCache sizes masks as a StaticLayer (max_cache_len), so
    the first forward attends over what the layer then returns."""
    cache = StaticCache(64)
    assert cache.get_mask_sizes(17, 0) == (64, 0) and cache.get_max_length(0) == 64
    model = decoder(("full_attention", "full_attention"))
    ids = tokens(2, 17)
    got = model(ids, cache=cache)
    assert torch.allclose(got, model(ids), atol=ATOL, rtol=RTOL)
    assert len(cache.layers) == 2 and cache.get_seq_length() == 17
