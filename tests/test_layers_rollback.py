"""Attention layers: crop-and-regrow equals never-cropped, no per-token reallocation, O(1) crops,
and agreement with transformers' own `DynamicLayer` / `DynamicSlidingWindowLayer`."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kvcache import (
    CacheInputError,
    CacheOverflowError,
    DynamicLayer,
    RollbackError,
    SlidingWindowLayer,
    StaticLayer,
    StaticSlidingWindowLayer,
)
from kvcache.layers.base import CacheLayer


def kv(n: int, seed: int, batch: int = 2, heads: int = 2, dim: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(batch, heads, n, dim, generator=gen), torch.randn(batch, heads, n, dim, generator=gen)


def make(kind: str, window: int = 5, max_len: int = 64) -> CacheLayer:
    if kind == "sliding":
        return SlidingWindowLayer(window)
    if kind == "static_sliding":
        return StaticSlidingWindowLayer(window, max_len, rollback_tokens=6)
    return StaticLayer(max_len) if kind == "static" else DynamicLayer()


def seen_by_attention(
    kind: str, returned: torch.Tensor, offset: int, before: int, after: int, window: int
) -> torch.Tensor:
    """The part of an update's returned keys/values that the new queries can attend to: a static
    layer also returns slots that the mask hides (unwritten, or stale after a crop), whose contents
    are not part of the contract."""
    if kind == "static":
        return returned[:, :, :after]
    if kind == "static_sliding":
        first = before - min(before, window - 1)  # the oldest position the first new query sees
        return returned[:, :, first - offset : after - offset]
    return returned


def held_window(kind: str, state: dict[str, torch.Tensor], window: int) -> dict[str, torch.Tensor]:
    """A static sliding layer's ring may keep more or fewer old tokens after a crop than one that
    never cropped: what it must agree on is the window the next query sees."""
    if kind != "static_sliding" or not state:
        return state
    return {name: t[:, :, t.shape[2] - min(t.shape[2], window - 1) :] for name, t in state.items()}


def storage_ptr(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


# ----------------------------------------------------------------------------- crop and regrow
@given(
    kind=st.sampled_from(["dynamic", "sliding", "static", "static_sliding"]),
    window=st.integers(1, 6),
    record_after=st.integers(0, 12),
    before=st.lists(st.integers(1, 5), min_size=1, max_size=6),
    after=st.lists(st.integers(1, 5), min_size=1, max_size=6),
    data=st.data(),
)
def test_cropped_then_regrown_equals_never_cropped(kind, window, record_after, before, after, data) -> None:
    """Layer A sees tokens, rolls back n of them and grows on; layer B only ever sees the survivors
    and the same continuation. Every later return, length, mask size and held state agree bitwise."""
    a, b = make(kind, window), make(kind, window)
    tokens = [kv(n, seed) for seed, n in enumerate(before)]
    keys = torch.cat([k for k, _ in tokens], dim=2)
    values = torch.cat([v for _, v in tokens], dim=2)
    total = keys.shape[2]
    record_after = min(record_after, total)
    # A: first `record_after` tokens, start recording, then the rest in the drawn chunks.
    a.update(keys[:, :, :record_after], values[:, :, :record_after])
    a.activate_past_recording()
    a.update(keys[:, :, record_after:], values[:, :, record_after:])
    n = data.draw(st.integers(1, a.max_rollback) if a.max_rollback else st.just(0), label="n")
    if n:  # crop(-0) would be crop(0), a commit
        a.crop(-n)
    # B: the survivors, recording from the same point.
    keep = total - n
    b.update(keys[:, :, : min(record_after, keep)], values[:, :, : min(record_after, keep)])
    b.activate_past_recording()
    b.update(keys[:, :, min(record_after, keep) : keep], values[:, :, min(record_after, keep) : keep])
    assert a.get_seq_length() == b.get_seq_length() == keep
    for seed, m in enumerate(after, start=100):
        if kind == "static" and a.get_seq_length() + m > 64:
            break
        assert a.get_mask_sizes(m) == b.get_mask_sizes(m)
        seen, offset = a.get_seq_length(), a.get_mask_sizes(m)[1]
        new = kv(m, seed)
        for got, want in zip(a.update(*new), b.update(*new), strict=True):
            assert got.shape == want.shape
            visible = [seen_by_attention(kind, t, offset, seen, seen + m, window) for t in (got, want)]
            assert torch.equal(*visible)
        assert a.get_seq_length() == b.get_seq_length()
        sa, sb = held_window(kind, a.state, window), held_window(kind, b.state, window)
        assert sa.keys() == sb.keys() and all(torch.equal(sa[name], sb[name]) for name in sa)


def test_sliding_rolls_back_past_eviction_only_while_recording() -> None:
    window = 4
    layer = SlidingWindowLayer(window)
    keys, values = kv(10, 0)
    layer.update(keys[:, :, :6], values[:, :, :6])  # 6 >= window: tokens 0..2 evicted
    assert layer.max_rollback == 0 and not layer.is_croppable
    with pytest.raises(RollbackError, match="not recording"):
        layer.crop(-1)
    layer.activate_past_recording()
    layer.update(keys[:, :, 6:], values[:, :, 6:])  # 4 tokens recorded
    assert layer.is_croppable and layer.max_rollback == 4
    assert layer.state["keys"].shape[2] == window - 1 + 4
    layer.crop(-4)  # back to 6 tokens: the window before the recorded tokens is back
    k, _ = layer.update(keys[:, :, 6:7], values[:, :, 6:7])
    assert torch.equal(k, keys[:, :, 3:7])
    layer.crop(0)  # commit: shrink to the working set, nothing to roll back
    assert layer.max_rollback == 0 and layer.state["keys"].shape[2] == window - 1
    with pytest.raises(RollbackError):
        layer.crop(-1)


def test_sliding_before_first_eviction_can_crop_without_recording() -> None:
    layer = SlidingWindowLayer(8)
    keys, values = kv(5, 1)
    layer.update(keys, values)
    assert layer.max_rollback == 5 and not layer.is_croppable  # is_croppable: only while recording
    layer.crop(-5)
    assert layer.get_seq_length() == 0 and layer.get_mask_sizes(1) == (1, 0)


# ----------------------------------------------------------------------------- storage / cost
@pytest.mark.parametrize("kind", ["dynamic", "sliding", "static"])
def test_decode_appends_do_not_reallocate_within_capacity(kind: str) -> None:
    """Single-token appends write into spare capacity: the storage address stays put until the
    storage (measured by `nbytes`) has to change."""
    layer = make(kind, window=64, max_len=300)
    layer.update(*kv(1, 0))
    ptr, size, moves = storage_ptr(layer.state["keys"]), layer.nbytes(), 0
    for seed in range(1, 200):
        k, _ = layer.update(*kv(1, seed))
        assert storage_ptr(k) == storage_ptr(layer.state["keys"])
        if storage_ptr(k) != ptr:
            assert layer.nbytes() != size or kind == "sliding"  # a window may slide within its storage
            moves += 1
        ptr, size = storage_ptr(k), layer.nbytes()
    # dynamic: 64 -> 128 -> 192 -> 256 rows; sliding (8-row blocks, doubling up to the window's
    # 72 rows): 8 -> 24 -> 56 -> 72, then slides within those 72 rows
    assert moves <= {"dynamic": 4, "sliding": 5, "static": 0}[kind]


def test_dynamic_reallocations_grow_geometrically() -> None:
    """Over 6000 single-token appends the storage moves O(log n) times, not once per token."""
    layer = DynamicLayer()
    moves, ptr = 0, None
    for seed in range(6000):
        k, _ = layer.update(*kv(1, seed % 7, batch=1, heads=1, dim=2))
        moves += storage_ptr(k) != ptr
        ptr = storage_ptr(k)
    assert moves <= 22  # 64 rows, then x1.25 per regrowth: log(6000 / 64) / log(1.25) = 20.3


def test_appends_never_hold_more_than_the_growth_bound() -> None:
    """Storage stays within 1.25x of the live tokens plus one 64-token block, and a grown, loaded or
    copied layer has room for the next append (no regrowth on the first decode step)."""
    layer = DynamicLayer()
    for seed in range(3000):
        layer.update(*kv(1, seed % 7, batch=1, heads=1, dim=2))
        rows = layer.nbytes() // (2 * 2 * 4)  # keys+values, head_dim 2, fp32
        assert rows <= 1.25 * layer.get_seq_length() + 65
    for fork in (layer.copy(), DynamicLayer.from_state(layer.meta_state, layer.state)):
        before = fork.nbytes()
        fork.update(*kv(1, 0, batch=1, heads=1, dim=2))
        assert fork.nbytes() == before


def test_sliding_decode_keeps_one_storage_forever() -> None:
    """A sliding window decoding far past its window fills it in a few doublings, then reuses one
    storage forever (slides, never regrows), holding 1.125x its kept tokens in blocks of W / 8."""
    layer = SlidingWindowLayer(100)
    filling, settled = set(), set()
    for seed in range(3000):
        layer.update(*kv(1, seed % 5, batch=1, heads=1, dim=2))
        (filling if seed < 100 else settled).add(storage_ptr(layer.state["keys"]))
    assert len(settled) == 1 and len(filling) <= 5  # 13 -> 39 -> 91 -> 117 rows
    assert layer.nbytes() <= 2 * 2 * 4 * 117  # keys+values, 2 dims, fp32: 1.125 x 99 rows, in 13-row blocks


@pytest.mark.parametrize("recorded", [0, 1, 4, 16, 64])
def test_sliding_window_holds_its_bound_plus_an_eighth(recorded: int) -> None:
    """Bytes held by a recording window stay within 1.125x of `W - 1 + r` tokens plus 64 rows (its blocks: 128),
    after a long prefill, while recording, and after a long decode and commit."""
    window, row = 1024, 2 * 2 * 4  # keys+values, head_dim 2, fp32
    layer = SlidingWindowLayer(window)
    layer.update(*kv(2 * window, 0, batch=1, heads=1, dim=2))
    assert layer.nbytes() // row <= 1.125 * (window - 1) + 64
    layer.activate_past_recording()
    for seed in range(recorded):
        layer.update(*kv(1, seed % 5, batch=1, heads=1, dim=2))
    assert layer.nbytes() // row <= 1.125 * (window - 1 + recorded) + 64
    layer.crop(0)
    for seed in range(3 * window):  # long decode, committing every step as generate does
        layer.update(*kv(1, seed % 5, batch=1, heads=1, dim=2))
        layer.crop(0)
    assert layer.nbytes() // row <= 1.125 * (window - 1 + 1) + 64


@pytest.mark.parametrize("kind", ["dynamic", "sliding", "static"])
def test_crop_is_a_view_not_a_copy(kind: str) -> None:
    layer = make(kind, window=8, max_len=64)
    layer.activate_past_recording()
    for seed in range(20):
        layer.update(*kv(1, seed))
    ptr = storage_ptr(layer.state["keys"])
    layer.crop(-5)
    assert storage_ptr(layer.state["keys"]) == ptr
    k, _ = layer.update(*kv(1, 99))
    assert storage_ptr(k) == ptr


def test_dynamic_commit_shrinks_after_a_big_crop() -> None:
    layer = DynamicLayer()
    layer.update(*kv(4000, 0, batch=1, heads=1, dim=2))
    big = layer.nbytes()
    layer.crop(-3990)
    assert layer.nbytes() == big  # crop(-n) alone never copies
    layer.crop(0)
    assert layer.nbytes() < big / 4


# ------------------------------------------------------------------------------------ errors
@pytest.mark.parametrize("kind", ["dynamic", "sliding", "static"])
def test_error_messages_name_the_problem(kind: str) -> None:
    layer = make(kind, max_len=8)
    layer.update(*kv(3, 0))
    k, v = kv(1, 1)
    with pytest.raises(CacheInputError, match="batch 1 != 2"):
        layer.update(k[:1], v[:1])
    with pytest.raises(CacheInputError, match="kv_heads 1 != 2"):
        layer.update(k[:, :1], v[:, :1])
    with pytest.raises(CacheInputError, match="head_dim 3 != 4"):
        layer.update(k[..., :3], v[..., :3])
    with pytest.raises(CacheInputError, match=r"dtype torch\.float64"):
        layer.update(k.double(), v.double())
    with pytest.raises(CacheInputError, match="device meta"):
        layer.update(k.to("meta"), v.to("meta"))
    with pytest.raises(CacheInputError, match=r"\[batch, kv_heads, seq, head_dim\]"):
        layer.update(k[0], v[0])
    with pytest.raises(RollbackError, match="positive"):
        layer.crop(2)
    if kind == "static":
        with pytest.raises(CacheOverflowError, match="max_cache_len=8"):
            layer.update(*kv(6, 2))
    assert layer.get_seq_length() == 3


@pytest.mark.parametrize("bad", [0, -3, 2.0, True, None])
def test_constructors_reject_bad_sizes(bad) -> None:
    with pytest.raises(CacheInputError):
        SlidingWindowLayer(bad)
    with pytest.raises(CacheInputError):
        StaticLayer(bad)


# ----------------------------------------------------------------------- transformers agreement
cache_utils = pytest.importorskip("transformers.cache_utils")


@given(
    window=st.integers(2, 9),  # transformers' slice `[-window + 1:]` keeps everything for window 1
    chunks=st.lists(st.integers(1, 6), min_size=1, max_size=12),
    record_from=st.none() | st.integers(0, 11),
    queries=st.integers(1, 4),
)
def test_matches_transformers_layers_without_crops(window, chunks, record_from, queries) -> None:
    """Crop-free sequences: our layers return exactly what transformers' return, and announce the
    same mask sizes (recording or not, for the sliding window)."""
    pairs = [
        (DynamicLayer(), cache_utils.DynamicLayer()),
        (SlidingWindowLayer(window), cache_utils.DynamicSlidingWindowLayer(window)),
    ]
    for step, n in enumerate(chunks):
        if record_from == step:
            for ours, theirs in pairs:
                ours.activate_past_recording()
                if hasattr(theirs, "activate_past_recording"):
                    theirs.activate_past_recording()
        keys, values = kv(n, step)
        for ours, theirs in pairs:
            assert ours.get_mask_sizes(n) == theirs.get_mask_sizes(n)
            assert ours.get_mask_sizes(queries) == theirs.get_mask_sizes(queries)
            got, want = ours.update(keys, values), theirs.update(keys, values)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
            assert ours.get_seq_length() == theirs.get_seq_length()
            assert ours.get_max_length() == theirs.get_max_length()


# ---------------------------------------------------------------------------------- compile
def test_static_layer_compiles_once_for_all_decode_steps() -> None:
    """`is_compileable` is meant: a traced decode step reads no Python length, so it is compiled
    once (not once per position), writes exactly what eager updates write, and the bookkeeping
    (length, crop) is right afterwards."""
    dynamo_testing = pytest.importorskip("torch._dynamo.testing")
    compiled_layer, eager_layer = StaticLayer(32), StaticLayer(32)
    for layer in (compiled_layer, eager_layer):
        layer.update(*kv(4, 0))
    counter = dynamo_testing.CompileCounter()

    @torch.compile(backend=counter, fullgraph=True)
    def step(k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return compiled_layer.update(k, v)

    for seed in range(1, 11):
        got = step(*kv(1, seed))
        want = eager_layer.update(*kv(1, seed))
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert counter.frame_count == 1
    assert compiled_layer.get_seq_length() == 14 and compiled_layer.meta_state == eager_layer.meta_state
    compiled_layer.crop(-3)
    eager_layer.crop(-3)
    got, want = step(*kv(1, 50)), eager_layer.update(*kv(1, 50))
    assert torch.equal(got[0], want[0]) and compiled_layer.get_seq_length() == 12
    assert counter.frame_count == 1
    assert StaticLayer.is_compileable and not DynamicLayer.is_compileable
