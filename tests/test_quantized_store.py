"""What the prefix store keeps of quantized layers (`store.quant_payloads`), against the layer
itself: a layer fed chunk by chunk is captured at every boundary, and the first m captured chunks
rebuild exactly the layer as it was at boundary m (quantized data, scales, full-precision part,
lengths), for per-channel and per-token keys, full attention and sliding windows, chunks smaller
than, equal to and larger than a key block; each capture passes the store's shape check against
the model's reference and survives the store's encoding."""

from __future__ import annotations

import pytest
import torch

from kvcache.layers.dynamic import DynamicLayer
from kvcache.layers.quantized import QuantizedLayer
from kvcache.layers.quantized_sliding import QuantizedSlidingWindowLayer
from kvcache.store.backends import Entry
from kvcache.store.codec import decode, encode
from kvcache.store.payloads import capture, check_payload, rebuild

RESIDUAL = 8


def make(window: int | None, groups: str, bits: int) -> QuantizedLayer:
    """A layer whose keys and values are grouped as `groups` says ("keys/values"; one word: both)."""
    keys, _, values = groups.partition("/")
    kw = {"bits": bits, "group_size": 32, "residual": RESIDUAL, "key_groups": keys, "value_groups": values or keys}
    return QuantizedSlidingWindowLayer(window, **kw) if window else QuantizedLayer(**kw)


def same_layer(a: QuantizedLayer, b: QuantizedLayer) -> bool:
    sa, sb = a.state, b.state
    meta_a = {k: v for k, v in a.meta_state.items() if k != "seq_length_at_commit"}
    meta_b = {k: v for k, v in b.meta_state.items() if k != "seq_length_at_commit"}
    return meta_a == meta_b and sorted(sa) == sorted(sb) and all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.mark.parametrize("bits", [4, 2])
@pytest.mark.parametrize("groups", ["channel", "channel/token", "token"])
@pytest.mark.parametrize("window", [None, 29, 6], ids=["full", "sliding", "narrow"])
@pytest.mark.parametrize("chunk", [5, 8, 12])
def test_chunks_rebuild_the_layer_at_every_boundary(bits: int, groups: str, window: int | None, chunk: int) -> None:
    gen = torch.Generator().manual_seed(chunk)
    keys = torch.randn(1, 2, 10 * chunk, 32, generator=gen)
    keys[..., 5] *= 12  # an outlier channel, as trained models' keys have
    layer, payloads, at = make(window, groups, bits), [], []
    for start in range(0, keys.shape[2], chunk):
        piece = keys[:, :, start : start + chunk]
        layer.update(piece, -piece)
        payloads.append(capture(layer, start, start + chunk))
        at.append(layer.copy())
    for m in range(1, len(payloads) + 1):
        assert check_payload(payloads[m - 1], payloads[0], m) is None
        assert same_layer(rebuild(payloads[:m]), at[m - 1]), m
        restored = decode(b"k", encode(b"k", Entry(None, [payloads[m - 1]], 0), None), None).payloads[0]
        assert all(torch.equal(t, payloads[m - 1].tensors[n]) for n, t in restored.tensors.items())
        assert (restored.tokens, restored.key_groups, restored.value_groups) == (chunk, layer.key_groups,
                                                                                 layer.value_groups)  # fmt: skip


def test_an_entry_of_other_key_groups_is_refused() -> None:
    keys = torch.randn(1, 2, 16, 32)
    refs = {}
    for groups in ("channel", "channel/token", "token"):
        layer = make(None, groups, 4)
        layer.update(keys, keys)
        refs[groups] = capture(layer, 0, 16)
    assert "quantization" in check_payload(refs["token"], refs["channel"], 1)
    assert "quantization" in check_payload(refs["channel/token"], refs["channel"], 1)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("value_groups", ["channel", "token"])
def test_entries_at_whole_blocks_hold_quantized_data_alone(bits: int, value_groups: str) -> None:
    """With the default block (16 tokens, the store's default chunk), a boundary holds no
    full-precision token: an entry holds `bits / 8` bytes per value plus float16 scales and zero
    points (per channel: 4 bytes per 16 tokens; per token: 4 per 64 values). At int4 against the
    float16 entry: 0.375x with values per channel (the default), 0.344x per token."""
    keys = torch.randn(1, 4, 64, 64, dtype=torch.float16)
    layer, full = QuantizedLayer(bits=bits, value_groups=value_groups), DynamicLayer()
    per_value = bits / 8 + (4 / 16 + (4 / 16 if value_groups == "channel" else 4 / 64)) / 2
    for start in range(0, 64, 16):
        piece = keys[:, :, start : start + 16]
        layer.update(piece, piece)
        full.update(piece, piece)
        quantized, plain = capture(layer, start, start + 16), capture(full, start, start + 16)
        assert quantized.residual_k.shape[2] == 0 and quantized.data_k.shape[2] == 16
        assert quantized.nbytes == per_value / 2 * (plain.keys.nbytes + plain.values.nbytes)
