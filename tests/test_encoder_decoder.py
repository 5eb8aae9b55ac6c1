"""`EncoderDecoderCache`: the decoder's self-attention part grows, records and is cropped; the encoder's
cross-attention part is written once per layer and never cropped; batch operations act on both."""

from __future__ import annotations

import pytest
import torch

from kvcache import CacheInputError, DynamicCache, EncoderDecoderCache, RollbackError

LAYERS, HEADS, DIM = 2, 2, 4


def kv(batch: int, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(batch, HEADS, n, DIM, generator=gen), torch.randn(batch, HEADS, n, DIM, generator=gen)


def decoder_step(cache: EncoderDecoderCache, n: int, seed: int, encoder: tuple[torch.Tensor, torch.Tensor]) -> None:
    """What a transformers decoder layer does per forward (models/bart: self attn, then cross attn)."""
    for layer_idx in range(LAYERS):
        k, v = kv(encoder[0].shape[0], n, seed * 10 + layer_idx)
        cache.self_attention_cache.update(k, v, layer_idx, kwargs={})
        if cache.is_updated.get(layer_idx):
            keys = cache.cross_attention_cache.layers[layer_idx].keys
            assert torch.equal(keys, encoder[0])
        else:
            cache.cross_attention_cache.update(*encoder, layer_idx)
            cache.is_updated[layer_idx] = True


def fresh(batch: int = 3) -> tuple[EncoderDecoderCache, tuple[torch.Tensor, torch.Tensor]]:
    cache = EncoderDecoderCache(DynamicCache(), DynamicCache())
    assert cache.is_updated == {}
    return cache, kv(batch, 5, 99)


def test_self_part_grows_and_crops_cross_part_is_written_once() -> None:
    cache, encoder = fresh()
    decoder_step(cache, 4, 0, encoder)
    cache.activate_past_recording()
    for i in range(3):
        decoder_step(cache, 1, i + 1, encoder)
    assert cache.is_updated == {0: True, 1: True}
    assert cache.get_seq_length() == 7 and cache.max_rollback == 7
    assert cache.get_mask_sizes(1, 0) == (8, 0)
    cross_before = [layer.keys.clone() for layer in cache.cross_attention_cache.layers]
    cache.crop(-2)
    assert cache.get_seq_length() == 5
    assert [layer.keys.shape[2] for layer in cache.cross_attention_cache.layers] == [5, 5]
    assert all(torch.equal(a, b.keys) for a, b in zip(cross_before, cache.cross_attention_cache.layers, strict=True))
    expected_self = torch.cat([kv(3, 4, 0)[0], kv(3, 1, 10)[0]], 2)
    assert torch.equal(cache.self_attention_cache.layers[0].keys, expected_self)
    cache.crop(0)
    assert cache.get_seq_length() == 5 and cache.cross_attention_cache.get_seq_length() == 5


def test_failing_crop_changes_nothing() -> None:
    cache, encoder = fresh()
    decoder_step(cache, 2, 0, encoder)
    with pytest.raises(RollbackError):
        cache.crop(-3)
    with pytest.raises(RollbackError):
        cache.crop(1)
    assert cache.get_seq_length() == 2 and cache.cross_attention_cache.get_seq_length() == 5


def test_batch_ops_act_on_both_parts() -> None:
    cache, encoder = fresh()
    decoder_step(cache, 2, 0, encoder)
    self_keys = cache.self_attention_cache.layers[1].keys.clone()
    cache.reorder_cache(torch.tensor([2, 0, 1]))
    assert torch.equal(cache.self_attention_cache.layers[1].keys, self_keys[[2, 0, 1]])
    assert torch.equal(cache.cross_attention_cache.layers[1].keys, encoder[0][[2, 0, 1]])
    cache.batch_select_indices(torch.tensor([1, 2]))
    assert cache.batch_size == 2
    assert torch.equal(cache.cross_attention_cache.layers[0].values, encoder[1][[0, 1]])
    cache.batch_repeat_interleave(2)
    assert cache.self_attention_cache.batch_size == cache.cross_attention_cache.batch_size == 4
    with pytest.raises(CacheInputError):
        cache.reorder_cache(torch.tensor([0, 4]))  # checked on both parts before either changes
    assert cache.batch_size == 4
    with pytest.raises(CacheInputError):
        cache.batch_repeat_interleave(0)


def test_out_of_range_index_checked_on_cross_part_first_leaves_self_part_unchanged() -> None:
    cache = EncoderDecoderCache(DynamicCache(), DynamicCache())
    cache.cross_attention_cache.update(*kv(2, 3, 0), 0)  # encoder written, decoder not started
    with pytest.raises(CacheInputError):
        cache.batch_select_indices(torch.tensor([2]))
    assert cache.cross_attention_cache.batch_size == 2


def test_reset_and_copy() -> None:
    cache, encoder = fresh()
    decoder_step(cache, 2, 0, encoder)
    clone = cache.copy()
    cache.self_attention_cache.layers[0].keys.zero_()
    cache.cross_attention_cache.layers[0].keys.zero_()
    cache.is_updated[0] = False
    assert clone.is_updated == {0: True, 1: True}
    assert torch.equal(clone.cross_attention_cache.layers[0].keys, encoder[0])
    assert torch.equal(clone.self_attention_cache.layers[0].keys, kv(3, 2, 0)[0])
    cache.reset()
    assert cache.is_updated == {0: False, 1: False}
    assert cache.get_seq_length() == 0 and cache.cross_attention_cache.get_seq_length() == 0
    assert clone.get_seq_length() == 2


def test_is_updated_reflects_a_prefilled_cross_part_and_bad_arguments() -> None:
    cross = DynamicCache()
    cross.update(*kv(1, 3, 0), 0)
    cross.update(*kv(1, 3, 1), 1)
    assert EncoderDecoderCache(DynamicCache(), cross).is_updated == {0: True, 1: True}
    with pytest.raises(CacheInputError):
        EncoderDecoderCache(DynamicCache(), "cross")  # type: ignore[arg-type]
    same = DynamicCache()
    with pytest.raises(CacheInputError):
        EncoderDecoderCache(same, same)


def test_update_forwards_to_the_self_attention_part() -> None:
    cache, _ = fresh()
    k, v = kv(3, 2, 0)
    keys, _ = cache.update(k, v, 0)
    assert torch.equal(keys, k) and cache.get_seq_length(0) == 2
    assert len(cache.cross_attention_cache) == 0
    assert not cache.is_recording_past(0)
    cache.activate_past_recording()
    assert cache.is_recording_past(0) and cache.is_croppable
