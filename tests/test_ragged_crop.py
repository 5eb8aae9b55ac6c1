"""Per-row rollback (`crop` with one count per batch row) for every layer kind, against a naive
model that keeps each row as a plain list of tokens.

Every token is a distinct value, so "what a row holds" is checkable exactly: after each step the
keys an attention layer returns must hold, at each position a row's queries may see (its own
tokens; the last `W - 1` before them for a sliding window), that row's token; a recurrent layer's
state must be the sum of the row's tokens (the fake model below hands its cumulative sums over as
intermediate states) and its conv window the row's last inputs. Random runs mix uniform steps,
per-row crops (up to what each row may lose), uniform crops, commits, batch selection, copies and
save/load round trips; bad per-row arguments must raise and change nothing.
"""

from __future__ import annotations

import random

import pytest
import torch
from crop_kit import crop_at_random

from kvcache import Cache, DynamicCache, RollbackError
from kvcache.encoder_decoder import EncoderDecoderCache
from kvcache.layers.base import CacheLayer
from kvcache.layers.dynamic import DynamicLayer
from kvcache.layers.hybrid import HybridLayer
from kvcache.layers.recurrent import RecurrentLayer
from kvcache.layers.sliding import SlidingWindowLayer
from kvcache.layers.static import StaticLayer
from kvcache.layers.static_recurrent import StaticRecurrentLayer
from kvcache.layers.static_sliding import StaticSlidingWindowLayer
from kvcache.persistence import load_cache, save_cache

HEADS, DIM, KERNEL, BATCH = 2, 3, 3, 4
WINDOW = 3


def token_keys(tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys/values `[batch, heads, n, dim]` that spell out token values `[batch, n]` (values negated)."""
    keys = tokens[:, None, :, None].expand(-1, HEADS, -1, DIM).clone()
    return keys, -keys


class Naive:
    """The reference: one list of token values per row; what a layer of `kind` must show."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.rows: list[list[float]] = [[] for _ in range(BATCH)]
        self.committed = [0] * BATCH

    @property
    def attention(self) -> str | None:
        return {"recurrent": None, "hybrid": "dynamic", "hybrid_sliding": "sliding"}.get(self.kind, self.kind)

    @property
    def recurrent(self) -> bool:
        return self.kind in ("recurrent", "hybrid", "hybrid_sliding")

    def reach(self, layer: CacheLayer) -> list[int]:
        """How far each row may be cropped: the layer's own claim, checked against the rule."""
        return layer.row_rollback()


def feed(layer: CacheLayer, naive: Naive, n: int, counter: list[float]) -> None:
    """One step of `n` new tokens per row; checks what the layer returns against the naive rows."""
    batch = len(naive.rows)
    tokens = torch.tensor([[counter[0] + b * 1000 + i for i in range(n)] for b in range(batch)], dtype=torch.float64)
    counter[0] += n
    if naive.attention is not None:
        offset = layer.get_mask_sizes(n)[1]
        keys, values = layer.update(*token_keys(tokens))
        for b, row in enumerate(naive.rows):
            full = row + tokens[b].tolist()
            first = 0 if naive.attention in ("dynamic", "static") else max(len(row) - (WINDOW - 1), 0)
            for p in range(first, len(full)):
                assert keys[b, 0, p - offset, 0].item() == full[p], (b, p)
                assert values[b, 1, p - offset, 2].item() == -full[p], (b, p)
    if naive.recurrent:
        conv = tokens[:, None, :].expand(-1, 2, -1).clone()
        layer.update_conv_state(conv, 0, KERNEL)
        held = layer.get_recurrent_state(0)
        start = torch.zeros(batch, 1, dtype=torch.float64) if held is None else held
        sums = start[:, None, :] + tokens.cumsum(1)[:, :, None]  # [batch, n, 1]: the state after each token
        layer.update_recurrent_state(sums[:, -1], 0, intermediate_states=sums)
    for b in range(batch):
        naive.rows[b].extend(tokens[b].tolist())


def check(layer: CacheLayer, naive: Naive) -> None:
    """Lengths per row, and the recurrent state and conv window of each row."""
    if layer.batch_size is None:  # back before the first update: no rows at all
        assert not any(naive.rows) and layer.row_lengths() == []
        return
    assert layer.row_lengths() == [len(r) for r in naive.rows]
    assert layer.is_ragged == (len({len(r) for r in naive.rows}) > 1)
    if naive.recurrent and any(naive.rows):
        state, window = layer.get_recurrent_state(0), layer.get_conv_state(0)
        for b, row in enumerate(naive.rows):
            assert state[b, 0].item() == sum(row), b
            last = ([0.0] * KERNEL + row)[-KERNEL:]
            assert window[b, 0].tolist() == last, b


def make(kind: str) -> CacheLayer:
    attention = {"dynamic": DynamicLayer, "sliding": lambda: SlidingWindowLayer(WINDOW),
                 "static": lambda: StaticLayer(512)}  # fmt: skip
    if kind == "recurrent":
        return RecurrentLayer()
    if kind == "hybrid":
        return HybridLayer(DynamicLayer(), RecurrentLayer())
    if kind == "hybrid_sliding":
        return HybridLayer(SlidingWindowLayer(WINDOW), RecurrentLayer())
    return attention[kind]()


def roundtrip(layer: CacheLayer, tmp_path, step: int) -> CacheLayer:
    cache = Cache([layer])
    path = tmp_path / f"c{step}.safetensors"
    save_cache(cache, path)
    return load_cache(path).layers[0]


KINDS = ["dynamic", "sliding", "static", "recurrent", "hybrid", "hybrid_sliding"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("seed", range(6))
def test_random_runs_match_the_naive_rows(kind, seed, tmp_path):
    rng = random.Random(seed)
    layer, naive, counter = make(kind), Naive(kind), [1.0]
    layer.activate_past_recording()
    feed(layer, naive, rng.randint(1, 5), counter)
    check(layer, naive)
    for step in range(40):
        op = rng.choice(["feed", "feed", "ragged", "ragged", "uniform", "commit", "copy", "select", "save"])
        if op == "feed":
            feed(layer, naive, rng.randint(1, 4), counter)
        elif op in ("uniform", "ragged"):
            crop_at_random(layer, naive.rows, rng, ragged=op == "ragged", as_tensor=True)
        elif op == "commit":
            layer.crop(0)
        elif op == "copy":
            layer = layer.copy()
        elif op == "select" and len(naive.rows) > 1:
            keep = sorted(rng.sample(range(len(naive.rows)), rng.randint(1, len(naive.rows))))
            order = keep if rng.random() < 0.5 else keep[::-1]  # reorder_cache too
            layer.batch_select_indices(torch.tensor(order))
            naive.rows = [naive.rows[i] for i in order]
        elif op == "save":
            layer = roundtrip(layer, tmp_path, step)
        check(layer, naive)


def test_a_ragged_crop_moves_no_storage():
    """A per-row crop of an attention layer only moves each row's end: the buffer stays where it
    was, and the next step writes the new tokens only (the storage is not reallocated)."""
    layer, naive, counter = DynamicLayer(), Naive("dynamic"), [1.0]
    feed(layer, naive, 20, counter)
    storage = layer._kv.keys.untyped_storage().data_ptr()
    layer.crop(torch.tensor([0, -3, -7, -1]))
    assert layer._kv.keys.untyped_storage().data_ptr() == storage
    assert layer.row_lengths() == [20, 17, 13, 19]
    keys, _ = layer.update(*token_keys(torch.full((BATCH, 1), 99.0, dtype=torch.float64)))
    assert layer._kv.keys.untyped_storage().data_ptr() == storage
    assert keys.shape[2] == 21 and [keys[b, 0, n, 0].item() for b, n in enumerate([20, 17, 13, 19])] == [99.0] * 4


def _snapshot(layer: CacheLayer) -> dict:
    return {"meta": layer.meta_state, "state": {k: v.clone() for k, v in layer.state.items()}}


def _same(layer: CacheLayer, snap: dict) -> None:
    assert layer.meta_state == snap["meta"]
    now = layer.state
    assert sorted(now) == sorted(snap["state"])
    for name, tensor in snap["state"].items():
        assert torch.equal(now[name], tensor), name


BAD_COUNTS = [
    ([-1, -1], "one count per batch row"),
    ([-1, -1, 1, 0], "must be <= 0"),
    (torch.tensor([True, False, True, False]), "1-D integer tensor"),
    (torch.tensor([-1.0, 0.0, 0.0, 0.0]), "1-D integer tensor"),
    (torch.zeros(2, 2, dtype=torch.long), "1-D integer tensor"),
    ([-1, "a", 0, 0], "non-positive int"),
    ([-30, 0, 0, 0], "cannot remove 30"),
]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(("counts", "message"), BAD_COUNTS)
def test_bad_per_row_counts_raise_and_change_nothing(kind, counts, message):
    layer, naive, counter = make(kind), Naive(kind), [1.0]
    layer.activate_past_recording()
    feed(layer, naive, 4, counter)
    layer.crop(torch.tensor([0, -1, -2, 0]))  # ragged already: the checks must hold there too
    before = _snapshot(layer)
    with pytest.raises(RollbackError, match=message):
        layer.crop(counts)
    with pytest.raises(RollbackError, match=message):
        layer.check_crop(counts)
    _same(layer, before)


def test_an_empty_layer_takes_only_zero_counts():
    layer = DynamicLayer()
    layer.crop(torch.tensor([0, 0]))  # a commit
    with pytest.raises(RollbackError, match="holds no rows"):
        layer.crop(torch.tensor([0, -1]))
    assert layer.get_seq_length() == 0


@pytest.mark.parametrize(
    "make_fixed",
    [lambda: StaticSlidingWindowLayer(WINDOW, 64), lambda: StaticRecurrentLayer(1, rollback_tokens=8)],
    ids=["static_sliding", "static_recurrent"],
)
def test_fixed_ring_layers_refuse_different_counts_and_change_nothing(make_fixed):
    """The fixed-shape ring layers share one ring position across rows: they crop every row alike
    (uniform counts, even given per row) and refuse different ones."""
    layer = make_fixed()
    layer.activate_past_recording()
    tokens = torch.arange(12, dtype=torch.float64).view(BATCH, 3)
    if isinstance(layer, StaticSlidingWindowLayer):
        layer.update(*token_keys(tokens))
    else:
        for t in range(3):  # single-token steps: each one's state is recorded
            layer.update_conv_state(tokens[:, None, t : t + 1].expand(-1, 2, -1).clone(), 0, KERNEL)
            layer.update_recurrent_state(tokens[:, : t + 1].sum(1, keepdim=True), 0)
    before = _snapshot(layer)
    with pytest.raises(RollbackError, match="different counts"):
        layer.crop(torch.tensor([0, -1, 0, 0]))
    _same(layer, before)
    layer.crop(torch.tensor([-1, -1, -1, -1]))
    assert layer.get_seq_length() == 2


def test_cache_crops_rows_across_layers_and_refuses_as_a_whole():
    """A composite checks every layer before cropping any: a count one layer cannot take leaves
    all of them as they were."""
    cache = DynamicCache(layer_types=["full_attention", "sliding_attention"], sliding_window=WINDOW)
    cache.activate_past_recording()
    tokens = torch.arange(24, dtype=torch.float64).view(BATCH, 6)
    for i in range(2):
        cache.update(*token_keys(tokens), i)
    cache.crop(0)  # commit: the sliding layer keeps only its window
    cache.update(*token_keys(tokens[:, :2] + 100), 0)
    cache.update(*token_keys(tokens[:, :2] + 100), 1)
    assert cache.get_seq_lengths().tolist() == [8] * BATCH
    before = [_snapshot(layer) for layer in cache]
    with pytest.raises(RollbackError, match="SlidingWindowLayer"):
        cache.crop(torch.tensor([0, -5, 0, 0]))  # the full layer could, the window cannot
    for layer, snap in zip(cache, before, strict=True):
        _same(layer, snap)
    cache.crop(torch.tensor([0, -2, -1, 0]))
    assert cache.get_seq_lengths().tolist() == [8, 6, 7, 8] and cache.is_ragged
    assert [layer.row_lengths() for layer in cache] == [[8, 6, 7, 8]] * 2


def test_encoder_decoder_cache_crops_the_self_attention_part_per_row():
    self_part, cross = DynamicCache(), DynamicCache()
    cache = EncoderDecoderCache(self_part, cross)
    tokens = torch.arange(20, dtype=torch.float64).view(BATCH, 5)
    self_part.update(*token_keys(tokens), 0)
    cross.update(*token_keys(tokens[:, :3]), 0)
    cache.crop(torch.tensor([-1, 0, -4, -2]))
    assert cache.get_seq_lengths().tolist() == [4, 5, 1, 3] and cache.is_ragged
    assert cross.get_seq_lengths().tolist() == [3] * BATCH


@pytest.mark.parametrize("kind", ["dynamic", "static"])
def test_a_uniform_crop_reaches_only_as_far_as_the_shortest_row(kind):
    """Rows of 8 and 2 tokens: `max_rollback` is 2 (a uniform crop takes n from every row), a crop of
    4 is refused and changes nothing, a crop of 2 empties the short row."""
    layer = make(kind)
    layer.update(*token_keys(torch.arange(16, dtype=torch.float64).view(2, 8)))
    layer.crop([0, -6])
    assert layer.row_lengths() == [8, 2] and layer.max_rollback == 2
    before = _snapshot(layer)
    with pytest.raises(RollbackError, match="at most 2"):
        layer.crop(-4)
    _same(layer, before)
    layer.crop(-2)
    assert layer.row_lengths() == [6, 0]


def test_a_cache_refuses_a_uniform_crop_past_its_shortest_row():
    cache = DynamicCache()
    tokens = torch.arange(16, dtype=torch.float64).view(2, 8)
    cache.update(*token_keys(tokens), 0)
    cache.update(*token_keys(tokens), 1)
    cache.crop([0, -6])
    assert cache.max_rollback == 2
    before = [_snapshot(layer) for layer in cache]
    with pytest.raises(RollbackError, match="rows hold"):
        cache.crop(-4)
    for layer, snap in zip(cache, before, strict=True):
        _same(layer, snap)
    cache.copy().batch_select_indices(torch.tensor([1, 0]))  # a consistent cache: every operation works
