"""Quantized layers (`QuantizedLayer`, `QuantizedSlidingWindowLayer`) against a naive model that
keeps each row as a list of tokens: random runs of steps, uniform and per-row crops, commits,
copies, save/load round trips and batch selection, at int8 and int4. After every operation the
layer holds exactly what its tokens say: the first `Q(N)` tokens (N: the shortest row) as the
quantization of each token alone, the rest in full precision, the window's for a sliding layer.
So a crop is bit for bit "as if those tokens had never been added", including crops that reach
into tokens quantized while recording."""

from __future__ import annotations

import random

import pytest
import torch
from crop_kit import crop_at_random

from kvcache import CacheInputError, RollbackError
from kvcache.cache import Cache
from kvcache.layers.quant import dequantize, quantize
from kvcache.layers.quantized import QuantizedLayer
from kvcache.layers.quantized_sliding import QuantizedSlidingWindowLayer
from kvcache.persistence import load_cache, save_cache

HEADS, DIM, BATCH, RESIDUAL, WINDOW = 2, 32, 3, 4, 11


def vector(token: int) -> torch.Tensor:
    """The key of token `token` `[HEADS, DIM]` (its value is the negation)."""
    return torch.randn(HEADS, DIM, generator=torch.Generator().manual_seed(token), dtype=torch.float64)


class Naive:
    def __init__(self, window: int | None, bits: int, group: int) -> None:
        self.rows: list[list[int]] = [[] for _ in range(BATCH)]
        self.window, self.bits, self.group = window, bits, group

    def quantized(self) -> int:
        shortest = min(len(r) for r in self.rows)
        return max(0, (shortest - RESIDUAL) // RESIDUAL) * RESIDUAL

    def expected(self, b: int, p: int, sign: int = 1) -> torch.Tensor:
        x = sign * vector(self.rows[b][p])
        if p < self.quantized():
            return dequantize(*quantize(x, self.bits, self.group), self.bits, self.group, x.dtype)
        return x

    def first_visible(self) -> int:
        shortest = min(len(r) for r in self.rows)
        return max(shortest - (self.window - 1), 0) if self.window else 0


def make(window: int | None, bits: int) -> QuantizedLayer:
    if window:
        return QuantizedSlidingWindowLayer(window, bits=bits, group_size=32, residual=RESIDUAL)
    return QuantizedLayer(bits=bits, group_size=32, residual=RESIDUAL)


def feed(layer: QuantizedLayer, naive: Naive, n: int, counter: list[int]) -> None:
    new = [[counter[0] + 1000 * b + i for i in range(n)] for b in range(BATCH)]
    counter[0] += n
    keys = torch.stack([torch.stack([vector(t) for t in row], dim=1) for row in new])  # [B, H, n, D]
    start = layer.get_mask_sizes(n)[1]
    out_k, out_v = layer.update(keys, -keys)
    for b, row in enumerate(naive.rows):
        row.extend(new[b])
    for b, row in enumerate(naive.rows):
        for p in range(max(start, 0), len(row)):
            assert torch.equal(out_k[b, :, p - start], naive.expected(b, p)), (b, p)
            assert torch.equal(out_v[b, :, p - start], naive.expected(b, p, -1)), (b, p)


def check(layer: QuantizedLayer, naive: Naive) -> None:
    assert layer.row_lengths() == [len(r) for r in naive.rows]
    assert layer._quantized == naive.quantized()
    start = naive.first_visible()
    keys, values = layer._assemble(start)
    for b, row in enumerate(naive.rows):
        for p in range(start, len(row)):
            assert torch.equal(keys[b, :, p - start], naive.expected(b, p)), (b, p)
            assert torch.equal(values[b, :, p - start], naive.expected(b, p, -1)), (b, p)
    held = layer.state
    if "keys_q" in held:  # the quantized data: each token's own quantization, nothing else
        q_start = layer._q_start
        for b in range(BATCH):
            for p in range(q_start, layer._quantized):
                data, params = quantize(vector(naive.rows[b][p]), naive.bits, naive.group)
                assert torch.equal(held["keys_q"][b, :, p - q_start], data)
                assert torch.equal(held["params_k"][b, :, p - q_start], params)


def roundtrip(layer: QuantizedLayer, tmp_path, step: int) -> QuantizedLayer:
    path = tmp_path / f"q{step}.safetensors"
    save_cache(Cache([layer]), path)
    return load_cache(path).layers[0]


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("window", [None, WINDOW], ids=["full", "sliding"])
@pytest.mark.parametrize("seed", range(4))
def test_random_runs_match_the_naive_rows(bits, window, seed, tmp_path):
    rng = random.Random(seed)
    layer, naive, counter = make(window, bits), Naive(window, bits, 32), [1]
    feed(layer, naive, rng.randint(1, 6), counter)
    for step in range(60):
        op = rng.choice(["feed", "feed", "feed", "record", "uniform", "ragged", "commit", "copy", "select", "save"])
        if op == "feed":
            feed(layer, naive, rng.randint(1, 5), counter)
        elif op == "record":
            layer.activate_past_recording()
        elif op in ("uniform", "ragged"):
            crop_at_random(layer, naive.rows, rng, ragged=op == "ragged")
        elif op == "commit":
            layer.crop(0)
        elif op == "copy":
            layer = layer.copy()
        elif op == "select":
            order = list(range(BATCH))
            rng.shuffle(order)
            layer.reorder_cache(torch.tensor(order))
            naive.rows = [naive.rows[i] for i in order]
        elif op == "save":
            layer = roundtrip(layer, tmp_path, step)
        check(layer, naive)
        if all(len(r) == 0 for r in naive.rows):
            feed(layer, naive, 3, counter)


@pytest.mark.parametrize("window", [None, WINDOW], ids=["full", "sliding"])
def test_a_crop_into_tokens_quantized_while_recording_is_exact(window):
    """Recording from 6 tokens, 40 more one at a time (quantizing blocks on the way), then crop(-38):
    the layer equals one fed the 8 kept tokens at once, quantized data and full-precision part."""
    keys = torch.stack([vector(t) for t in range(46)], dim=1)[None]
    layer = make(window, 8)
    layer.update(keys[:, :, :6], -keys[:, :, :6])
    layer.activate_past_recording()
    for t in range(6, 46):
        layer.update(keys[:, :, t : t + 1], -keys[:, :, t : t + 1])
    assert layer._quantized == 40 and layer.max_rollback >= 38
    layer.crop(-38)
    layer.crop(0)  # commit: drop the full-precision copies recording kept
    fresh = make(window, 8)
    fresh.update(keys[:, :, :8], -keys[:, :, :8])
    mine, theirs = layer.state, fresh.state
    assert sorted(mine) == sorted(theirs) and all(torch.equal(mine[k], theirs[k]) for k in mine)
    assert layer.update(keys[:, :, 8:9], -keys[:, :, 8:9])[0].equal(fresh.update(keys[:, :, 8:9], -keys[:, :, 8:9])[0])


def test_what_cannot_be_rolled_back_is_refused_and_changes_nothing():
    keys = torch.stack([vector(t) for t in range(30)], dim=1)[None]
    layer = make(None, 4)
    layer.update(keys, -keys)  # not recording: 24 quantized, their copies gone
    assert layer._quantized == 24 and layer.max_rollback == 30 - 28
    before = {k: v.clone() for k, v in layer.state.items()}, layer.meta_state
    for bad in (-3, 5, 1.5, [-3], [0, 0]):
        with pytest.raises(RollbackError):
            layer.crop(bad)
    assert layer.meta_state == before[1] and all(torch.equal(layer.state[k], v) for k, v in before[0].items())
    for bad in ({"bits": 3}, {"group_size": 48}, {"residual": 0}):
        with pytest.raises(CacheInputError):
            QuantizedLayer(**bad)
    with pytest.raises(CacheInputError):
        make(None, 8).update(keys.to(torch.int64), keys.to(torch.int64))


def test_bytes_held_per_token():
    """int8 in groups of 64 holds 1.0625 bytes per value, int4 0.5625 (float16 scales and zero
    points included), plus the full-precision residual."""
    for bits, per_value in ((8, 1.0625), (4, 0.5625)):
        layer = QuantizedLayer(bits=bits, group_size=64, residual=32)
        keys = torch.randn(1, 2, 4096 + 40, 64, dtype=torch.float16)
        layer.update(keys, keys)
        layer.crop(0)
        held = layer.state
        quantized = sum(held[k].nbytes for k in ("keys_q", "values_q", "params_k", "params_v"))
        assert quantized == 2 * 4096 * 2 * 64 * per_value
