"""Composite caches: transformers' protocol, atomic crops and batch operations, lazy layers,
layer types, overflow, copies and reset."""

from __future__ import annotations

import copy
import inspect

import pytest
import torch

from kvcache import (
    Cache,
    CacheInputError,
    CacheOverflowError,
    DynamicCache,
    DynamicLayer,
    EmptyLayer,
    RollbackError,
    SlidingWindowLayer,
    StaticCache,
    StaticLayer,
)


def kv(n: int, seed: int, batch: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(batch, 2, n, 4, generator=gen), torch.randn(batch, 2, n, 4, generator=gen)


def snapshot(cache: Cache) -> list:
    return [
        (layer.meta_state, {k: v.clone() for k, v in layer.state.items()}, layer.max_rollback) for layer in cache.layers
    ]


def assert_unchanged(cache: Cache, before: list) -> None:
    after = snapshot(cache)
    assert len(after) == len(before)
    for (meta_a, state_a, rb_a), (meta_b, state_b, rb_b) in zip(after, before, strict=True):
        assert meta_a == meta_b and rb_a == rb_b and state_a.keys() == state_b.keys()
        assert all(torch.equal(state_a[k], state_b[k]) for k in state_a)


def mixed_cache(window: int = 4) -> Cache:
    return Cache([DynamicLayer(), SlidingWindowLayer(window), StaticLayer(32)])


def feed(cache: Cache, n: int, seed: int, batch: int = 2) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [cache.update(*kv(n, seed + i, batch), i) for i in range(len(cache))]


# -------------------------------------------------------------------------------- the protocol
PROTOCOL_METHODS = [
    "update",
    "get_seq_length",
    "get_mask_sizes",
    "get_query_offset",
    "crop",
    "activate_past_recording",
    "is_recording_past",
    "reorder_cache",
    "batch_repeat_interleave",
    "batch_select_indices",
    "reset",
    "get_max_length",
]


@pytest.mark.parametrize("name", PROTOCOL_METHODS)
def test_method_signatures_match_transformers_cache(name: str) -> None:
    """Same parameter names, order and defaults as transformers' `Cache` (what model code calls)."""
    cache_utils = pytest.importorskip("transformers.cache_utils")
    theirs = inspect.signature(getattr(cache_utils.Cache, name)).parameters
    ours = inspect.signature(getattr(Cache, name)).parameters
    positional = [p for p in ours.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    their_positional = [p for p in theirs.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    assert [p.name for p in positional[: len(their_positional)]] == [p.name for p in their_positional]
    for ours_p, theirs_p in zip(positional, their_positional, strict=False):
        assert ours_p.default == theirs_p.default or theirs_p.default is inspect.Parameter.empty, name


def test_protocol_properties_and_flags() -> None:
    cache = mixed_cache()
    assert len(cache) == 3 and list(cache.layers) == list(cache)
    assert cache.is_sliding == [False, True, False]
    assert cache.is_compileable is False
    assert StaticCache(8, num_layers=2).is_compileable is True
    assert DynamicCache().is_compileable is False  # no layers yet, like transformers
    assert cache.is_croppable is False  # the sliding layer is not recording
    cache.activate_past_recording()
    assert cache.is_croppable is True
    assert [cache.is_recording_past(i) for i in range(3)] == [True, True, True]
    assert cache.is_recording_past(7) is False


def test_update_and_queries_forward_to_the_layer() -> None:
    cache = mixed_cache(window=4)
    k, v = kv(6, 0)
    outs = [cache.update(k, v, i, cache_kwargs={"cache_position": torch.arange(6)}) for i in range(3)]
    assert torch.equal(outs[0][0], k)
    assert torch.equal(outs[1][0], k)  # the first update of a window layer returns all new tokens
    assert outs[2][0].shape[2] == 32 and torch.equal(outs[2][0][:, :, :6], k)
    assert [cache.get_seq_length(i) for i in range(3)] == [6, 6, 6]
    assert cache.get_seq_length() == 6 and cache.get_query_offset() == 6 and cache.get_query_offset(1) == 6
    assert cache.get_mask_sizes(1, 0) == (7, 0)
    assert cache.get_mask_sizes(1, 1) == (4, 3)  # 3 = window - 1 cached + 1 query, offset 6 - 3
    assert cache.get_mask_sizes(1, 2) == (32, 0)
    assert cache.get_mask_sizes(torch.arange(2), 0) == (8, 0)  # older callers pass cache_position
    assert [cache.get_max_length(i) for i in range(3)] == [-1, 4, 32] and cache.get_max_length() == 32


@pytest.mark.parametrize("bad_idx", [-1, 1.0, True, "0"])
def test_bad_layer_index_is_a_clear_error(bad_idx) -> None:
    with pytest.raises(CacheInputError, match="layer_idx"):
        mixed_cache().update(*kv(1, 0), bad_idx)


def test_update_past_the_last_layer_of_a_fixed_cache_fails() -> None:
    cache = mixed_cache()
    with pytest.raises(CacheInputError, match="out of range"):
        cache.update(*kv(1, 0), 3)
    assert len(cache) == 3


# --------------------------------------------------------------------------- atomic operations
def test_crop_is_atomic_across_layer_kinds() -> None:
    """The sliding layer cannot go back (evicted, not recording): no layer may change."""
    cache = mixed_cache(window=4)
    feed(cache, 6, 0)
    assert cache.max_rollback == 0
    before = snapshot(cache)
    with pytest.raises(RollbackError, match="SlidingWindowLayer"):
        cache.crop(-1)
    assert_unchanged(cache, before)
    for bad in (3, 1.5, None, True):
        with pytest.raises(RollbackError):
            cache.crop(bad)
        assert_unchanged(cache, before)


@pytest.mark.parametrize(
    "make_cache", [lambda: Cache([]), DynamicCache, lambda: Cache([EmptyLayer()]), lambda: StaticCache(8)],
    ids=["no layers", "lazy, none built", "only an empty layer", "lazy static"],
)
def test_a_cache_holding_no_tokens_refuses_every_crop_but_a_commit(make_cache) -> None:
    """`max_rollback` is 0 before anything was written: crop(-1), crop(-7) and crop(-10**18) raise
    `RollbackError` and change nothing; crop(0) (a commit) and all-zero per-row counts are fine."""
    cache = make_cache()
    assert cache.max_rollback == 0
    for n in (1, 7, 10**18):
        with pytest.raises(RollbackError, match=f"cannot remove {n} token"):
            cache.crop(-n)
        with pytest.raises(RollbackError):
            cache.check_crop(-n)
    assert len(cache.layers) == len(make_cache().layers) and cache.get_seq_length() == 0
    cache.crop(0)
    cache.crop([0, 0])


def test_crop_within_max_rollback_restores_every_layer() -> None:
    cache = mixed_cache(window=4)
    feed(cache, 6, 0)
    cache.activate_past_recording()
    before = snapshot(cache)
    next_step = [cache.get_mask_sizes(2, i) for i in range(3)]
    feed(cache, 2, 10)
    feed(cache, 3, 20)
    assert cache.max_rollback == 5
    with pytest.raises(RollbackError):
        cache.crop(-6)
    cache.crop(-5)
    assert_unchanged(cache, before)
    assert [cache.get_mask_sizes(2, i) for i in range(3)] == next_step
    # The same step again returns what it returned the first time (a static layer: up to its
    # length; its slots past the length are hidden by the mask and may hold the cropped tokens).
    replay = mixed_cache(window=4)
    feed(replay, 6, 0)
    want = feed(replay, 2, 10)
    for layer, (gk, gv), (wk, wv) in zip(cache, feed(cache, 2, 10), want, strict=True):
        live = layer.get_seq_length() if layer.is_compileable else gk.shape[2]
        assert gk.shape == wk.shape
        assert torch.equal(gk[:, :, :live], wk[:, :, :live]) and torch.equal(gv[:, :, :live], wv[:, :, :live])


def test_crop_zero_commits_every_layer() -> None:
    cache = mixed_cache(window=4)
    cache.activate_past_recording()
    feed(cache, 9, 0)
    assert cache.max_rollback == 9  # recording began before the first token: nothing evicted yet
    cache.crop(0)
    assert cache.max_rollback == 0 and cache.is_croppable
    assert cache.layers[1].state["keys"].shape[2] == 3


@pytest.mark.parametrize(
    "call",
    [
        lambda c: c.reorder_cache(torch.tensor([0, 2])),
        lambda c: c.batch_select_indices(torch.tensor([-1])),
        lambda c: c.batch_select_indices(torch.tensor([[0]])),
        lambda c: c.batch_select_indices(torch.tensor([0.0])),
        lambda c: c.reorder_cache(torch.tensor([True, False])),
        lambda c: c.batch_repeat_interleave(0),
        lambda c: c.batch_repeat_interleave(2.0),
        lambda c: c.batch_select_indices("01"),
        lambda c: c.reorder_cache([[0, 1], [1]]),
    ],
)
def test_bad_batch_operations_change_nothing(call) -> None:
    cache = mixed_cache()
    feed(cache, 3, 0)
    before = snapshot(cache)
    with pytest.raises(CacheInputError):
        call(cache)
    assert_unchanged(cache, before)


def test_batch_operations_apply_to_every_layer() -> None:
    cache = mixed_cache(window=3)
    inputs = [kv(4, i, batch=3) for i in range(3)]
    for i, pair in enumerate(inputs):
        cache.update(*pair, i)
    cache.reorder_cache(torch.tensor([2, 0, 1]))
    cache.batch_select_indices(torch.tensor([0, 2]))  # old rows 2 and 1
    cache.batch_repeat_interleave(2)  # 2, 2, 1, 1
    rows = torch.tensor([2, 2, 1, 1])
    assert cache.batch_size == 4
    assert torch.equal(cache.layers[0].state["keys"], inputs[0][0][rows])
    assert torch.equal(cache.layers[1].state["values"], inputs[1][1][rows][:, :, -2:])
    assert torch.equal(cache.layers[2].state["keys"], inputs[2][0][rows])
    with pytest.raises(CacheInputError, match="batch"):
        cache.update(*kv(1, 9, batch=3), 0)


# ------------------------------------------------------------------------------ constructors
def test_dynamic_cache_creates_layers_lazily() -> None:
    cache = DynamicCache()
    assert len(cache) == 0 and cache.get_seq_length() == 0 and cache.get_mask_sizes(3, 5) == (3, 0)
    assert cache.max_rollback == 0 and cache.is_croppable and cache.batch_size is None
    cache.update(*kv(2, 0), 2)
    assert len(cache) == 3 and all(isinstance(layer, DynamicLayer) for layer in cache.layers)
    assert [cache.get_seq_length(i) for i in range(4)] == [0, 0, 2, 0]


def test_failing_update_leaves_no_lazily_created_layers() -> None:
    cache = DynamicCache()
    cache.update(*kv(2, 0), 0)
    with pytest.raises(CacheInputError):
        cache.update(torch.zeros(2, 2, 1), torch.zeros(2, 2, 1), 4)
    assert len(cache) == 1


def test_layers_created_after_activation_record() -> None:
    cache = DynamicCache()
    cache.activate_past_recording()
    cache.update(*kv(2, 0), 1)
    assert cache.is_recording_past(0) and cache.is_recording_past(1)
    clone = cache.copy()
    clone.update(*kv(2, 0), 2)
    assert clone.is_recording_past(2)


def test_dynamic_cache_from_layer_types() -> None:
    cache = DynamicCache(["full_attention", "sliding_attention", "full_attention"], sliding_window=5)
    kinds = [type(layer) for layer in cache.layers]
    assert kinds == [DynamicLayer, SlidingWindowLayer, DynamicLayer]
    assert cache.layers[1].sliding_window == 5 and cache.is_sliding == [False, True, False]
    with pytest.raises(CacheInputError, match="sliding_window"):
        DynamicCache(["sliding_attention"])
    with pytest.raises(CacheInputError, match="unknown layer type"):
        DynamicCache(["flash_attention"])
    with pytest.raises(CacheInputError):
        DynamicCache("full_attention")
    with pytest.raises(CacheInputError, match="out of range"):
        cache.update(*kv(1, 0), 3)  # built from layer types: no lazy layers


def test_static_cache_overflow_is_clear_and_changes_nothing() -> None:
    cache = StaticCache(8, num_layers=2)
    feed(cache, 6, 0)
    before = snapshot(cache)
    with pytest.raises(CacheOverflowError, match=r"6 \+ 3 token\(s\) exceed max_cache_len=8"):
        cache.update(*kv(3, 1), 1)
    assert_unchanged(cache, before)
    feed(cache, 2, 5)
    assert cache.get_seq_length(1) == 8
    lazy = StaticCache(4)
    lazy.update(*kv(1, 0), 1)
    assert len(lazy) == 2 and all(isinstance(layer, StaticLayer) for layer in lazy.layers)
    for bad in (0, -1, 2.5, True):
        with pytest.raises(CacheInputError):
            StaticCache(bad)
    with pytest.raises(CacheInputError):
        StaticCache(4, num_layers=-1)


# ---------------------------------------------------------------------------- copies / reset
@pytest.mark.parametrize("fork", [lambda c: c.copy(), copy.deepcopy])
def test_copies_are_independent(fork) -> None:
    cache = mixed_cache(window=4)
    cache.activate_past_recording()
    feed(cache, 5, 0)
    clone = fork(cache)
    assert type(clone) is type(cache)
    before = snapshot(clone)
    feed(cache, 3, 7)
    cache.crop(-4)
    cache.reorder_cache(torch.tensor([1, 0]))
    feed(cache, 1, 9)
    assert_unchanged(clone, before)
    # and the other way round
    original = snapshot(cache)
    feed(clone, 2, 11)
    clone.reset()
    assert_unchanged(cache, original)


def test_reset_forgets_tokens_keeps_layers_and_parameters() -> None:
    cache = mixed_cache(window=4)
    cache.activate_past_recording()
    feed(cache, 5, 0)
    cache.reset()
    assert len(cache) == 3 and [cache.get_seq_length(i) for i in range(3)] == [0, 0, 0]
    assert cache.layers[1].sliding_window == 4 and cache.layers[2].max_cache_len == 32
    assert [cache.is_recording_past(i) for i in range(3)] == [True, True, True]
    assert cache.get_mask_sizes(2, 1) == (2, 0)
    out = feed(cache, 2, 3)
    assert torch.equal(out[0][0], kv(2, 3)[0])
    assert torch.equal(out[2][0][:, :, 2:], torch.zeros_like(out[2][0][:, :, 2:]))  # static: no stale tokens


def test_to_moves_and_casts_every_layer_kind_with_its_history() -> None:
    """`to(dtype=)` casts keys, values, conv and recurrent states and the rollback history, in place:
    the cast cache equals the original cast tensor by tensor, still rolls back, and takes updates of
    the new dtype only. Bad arguments change nothing."""
    from kvcache import HybridLayer, RecurrentLayer, SlidingWindowLayer, StaticLayer
    from kvcache.encoder_decoder import EncoderDecoderCache

    gen = torch.Generator().manual_seed(0)
    cache = Cache([DynamicLayer(), SlidingWindowLayer(3), StaticLayer(8), RecurrentLayer(),
                   HybridLayer(DynamicLayer(), RecurrentLayer())])  # fmt: skip

    def step(dtype: torch.dtype) -> None:
        for i, layer in enumerate(cache.layers):
            if layer.has_attention:
                cache.update(torch.randn(1, 2, 1, 4, generator=gen).to(dtype), torch.randn(1, 2, 1, 4).to(dtype), i)
            if layer.has_recurrent:
                cache.update_conv_state(torch.randn(1, 3, 1).to(dtype), i, conv_kernel_size=2)
                cache.update_recurrent_state(torch.randn(1, 5).to(dtype), i)

    step(torch.float32)
    cache.activate_past_recording()
    step(torch.float32)
    before = [(layer.meta_state, {k: v.clone() for k, v in layer.state.items()}) for layer in cache.layers]
    for bad in ({"device": "no-such-device"}, {"dtype": torch.int64}, {"dtype": "float16"}):
        with pytest.raises(CacheInputError):
            cache.to(**bad)
    assert cache.to(device="cpu", dtype=torch.float64) is cache
    for layer, (meta, tensors) in zip(cache.layers, before, strict=True):
        assert layer.meta_state == meta
        assert all(torch.equal(layer.state[k], v.double()) and layer.state[k].dtype == torch.float64
                   for k, v in tensors.items())  # fmt: skip
    with pytest.raises(CacheInputError):
        cache.update(torch.zeros(1, 2, 1, 4), torch.zeros(1, 2, 1, 4), 0)  # float32 into a float64 layer
    step(torch.float64)
    cache.crop(-1)  # the history moved too
    for layer, (meta, tensors) in zip(cache.layers, before, strict=True):
        assert layer.meta_state == meta, type(layer).__name__
        assert all(torch.equal(layer.state[k], v.double()) for k, v in tensors.items()), type(layer).__name__

    pair = EncoderDecoderCache(DynamicCache(), DynamicCache())
    pair.update(torch.zeros(1, 2, 2, 4), torch.zeros(1, 2, 2, 4), 0)
    pair.cross_attention_cache.update(torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 3, 4), 0)
    assert pair.to(dtype=torch.float16).cross_attention_cache.layers[0].keys.dtype == torch.float16
