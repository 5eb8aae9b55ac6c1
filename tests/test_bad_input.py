"""Bad input to every public operation, in every state: a `KVCacheError` naming what was wrong and
the cache deeply unchanged, or success on input that is valid. The findings of an adversarial run
(batch index dtypes, huge lazy layer indices, empty composites that accepted anything, wrong error
types) each have a test here; a property test then drives every public method of every layer and
composite with arbitrary Python values and tensors."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcache import (
    Cache,
    CacheInputError,
    DynamicCache,
    DynamicLayer,
    EncoderDecoderCache,
    HybridLayer,
    KVCacheError,
    RecurrentLayer,
    SlidingWindowLayer,
    StaticCache,
    StaticLayer,
    save_cache,
)
from kvcache.layers import QuantizedLayer, QuantizedRows


def kv(n: int = 2, batch: int = 2, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(batch, 2, n, 4, generator=gen), torch.randn(batch, 2, n, 4, generator=gen)


def feed(cache: Cache, steps: int = 2, batch: int = 2) -> Cache:
    gen = torch.Generator().manual_seed(1)
    for step in range(steps):
        for i, layer in enumerate(cache.layers):
            if layer.has_attention:
                cache.update(*kv(1, batch, seed=step * 10 + i), i)
            if layer.has_recurrent:
                cache.update_conv_state(torch.randn(batch, 3, 1, generator=gen), i, conv_kernel_size=2)
                cache.update_recurrent_state(torch.randn(batch, 3, generator=gen), i)
    return cache


def snapshot(cache: Any) -> Any:
    """Everything observable about a cache: per layer its class, meta_state and tensors (cloned)."""
    encoder_decoder = isinstance(cache, EncoderDecoderCache)
    parts = [cache.self_attention_cache, cache.cross_attention_cache] if encoder_decoder else [cache]
    out = []
    for part in parts:
        out.append([(type(layer).__name__, repr(layer.meta_state), {k: v.clone() for k, v in layer.state.items()})
                    for layer in part.layers])  # fmt: skip
    return out


def assert_unchanged(before: Any, after: Any) -> None:
    assert len(before) == len(after)
    for part_a, part_b in zip(before, after, strict=True):
        assert len(part_a) == len(part_b)
        for (cls_a, meta_a, t_a), (cls_b, meta_b, t_b) in zip(part_a, part_b, strict=True):
            assert (cls_a, meta_a) == (cls_b, meta_b)
            assert t_a.keys() == t_b.keys()
            for name in t_a:
                a, b = t_a[name], t_b[name]
                assert a.shape == b.shape and a.dtype == b.dtype
                assert a.device.type == "meta" or torch.equal(a, b), name


def recurrent_first() -> Cache:
    """Qwen3-Next's layout: a recurrent layer first, then attention."""
    return Cache([RecurrentLayer(), DynamicLayer(), SlidingWindowLayer(3)])


def mixed() -> Cache:
    return Cache([DynamicLayer(), SlidingWindowLayer(3), StaticLayer(8), RecurrentLayer(),
                  HybridLayer(DynamicLayer(), RecurrentLayer())])  # fmt: skip


# ------------------------------------------------------------------------------- findings
@pytest.mark.parametrize("method", ["reorder_cache", "batch_select_indices"])
def test_batch_index_dtypes_mean_the_same_in_every_layer(method: str) -> None:
    """A uint8 or bool index is a mask to torch: refused everywhere (before, a RecurrentLayer took
    it as one and dropped a row while attention layers raised, so a recurrent-first cache was left
    half reordered). int8/int16/int32 index like int64."""
    for bad in (torch.tensor([1, 0], dtype=torch.uint8), torch.tensor([True, False]), torch.tensor([1.0, 0.0])):
        cache = feed(recurrent_first())
        before = snapshot(cache)
        with pytest.raises(CacheInputError, match="1-D integer tensor"):
            getattr(cache, method)(bad)
        assert_unchanged(before, snapshot(cache))
    expected = feed(recurrent_first())
    getattr(expected, method)(torch.tensor([1, 0]))
    for dtype in (torch.int8, torch.int16, torch.int32):
        cache = feed(recurrent_first())
        getattr(cache, method)(torch.tensor([1, 0], dtype=dtype))
        assert_unchanged(snapshot(expected), snapshot(cache))


@pytest.mark.parametrize("layer_idx", [10**6, 2**40])
def test_a_huge_layer_index_on_a_lazy_cache_is_refused_at_once(layer_idx: int) -> None:
    for cache in (DynamicCache(), StaticCache(8)):
        started = time.perf_counter()
        with pytest.raises(CacheInputError, match="layer_idx"):
            cache.update(*kv(), layer_idx)
        assert time.perf_counter() - started < 0.5 and len(cache.layers) == 0
    cache = DynamicCache()
    with pytest.raises(CacheInputError):
        cache.update(torch.randn(2, 2, 1, 4), "not a tensor", 3)  # bad input: no layers built for it
    assert len(cache.layers) == 0


def test_errors_are_kvcache_errors_that_blame_the_right_thing(tmp_path: Any) -> None:
    meta = DynamicCache()
    meta.update(torch.empty(1, 2, 3, 4, device="meta"), torch.empty(1, 2, 3, 4, device="meta"), 0)
    with pytest.raises(CacheInputError, match="meta device"):
        save_cache(meta, tmp_path / "m.safetensors")
    deep: list = []
    node = deep
    for _ in range(5000):
        node.append([])
        node = node[0]
    with pytest.raises(CacheInputError, match="nested deeper"):
        save_cache(DynamicCache(), tmp_path / "d.safetensors", metadata={"deep": deep})
    assert not list(tmp_path.iterdir())
    from kvcache import load_cache

    save_cache(feed(mixed()), tmp_path / "ok.safetensors")
    assert load_cache(tmp_path / "ok.safetensors", device="cpu:0").get_seq_length() == 2  # not "invalid file"
    with pytest.raises(CacheInputError, match="device"):
        load_cache(tmp_path / "ok.safetensors", device="no-such-device")
    for make in (lambda: Cache(5), lambda: DynamicCache(5), lambda: Cache([DynamicLayer(), 3]),
                 lambda: DynamicCache("full_attention"), lambda: Cache(layer_factory=5)):  # fmt: skip
        with pytest.raises(CacheInputError):
            make()


@pytest.mark.parametrize("make", [lambda: Cache([]), DynamicCache, lambda: StaticCache(8), lambda: feed(mixed())],
                         ids=["empty", "lazy", "lazy static", "populated"])  # fmt: skip
def test_composites_check_arguments_in_every_state(make: Callable[[], Cache]) -> None:
    cache = make()
    before = snapshot(cache)
    bad_calls = [
        lambda: cache.crop(5), lambda: cache.crop("x"), lambda: cache.crop(None), lambda: cache.crop(1.0),
        lambda: cache.crop(True), lambda: cache.reorder_cache("garbage"), lambda: cache.batch_select_indices(None),
        lambda: cache.batch_repeat_interleave(0), lambda: cache.get_mask_sizes(-5, 0),
        lambda: cache.get_mask_sizes(2.5, 0), lambda: cache.get_mask_sizes(torch.zeros(2, 2), 0),
    ]  # fmt: skip
    for accessor in ("get_seq_length", "get_max_length", "is_recording_past", "has_previous_state"):
        for bad in ("x", None if accessor in ("get_seq_length", "is_recording_past") else "y", 1.5, True, -1):
            bad_calls.append(lambda accessor=accessor, bad=bad: getattr(cache, accessor)(bad))
    bad_calls.append(lambda: cache.get_mask_sizes(1, "x"))
    for call in bad_calls:
        with pytest.raises(KVCacheError):
            call()
        assert_unchanged(before, snapshot(cache))


# --------------------------------------------------------------------------- property test
def _tensors() -> st.SearchStrategy[torch.Tensor]:
    dtypes = st.sampled_from([torch.float32, torch.float16, torch.int64, torch.uint8, torch.bool])
    shapes = st.lists(st.integers(0, 3), min_size=0, max_size=5)
    return st.builds(
        lambda dtype, shape, meta: torch.empty(shape, dtype=dtype, device="meta") if meta
        else torch.zeros(shape, dtype=dtype),
        dtypes, shapes, st.booleans(),
    )  # fmt: skip


VALUES = st.one_of(
    st.integers(-(2**41), 2**41), st.integers(-3, 8), st.floats(allow_nan=True), st.booleans(), st.none(),
    st.text(max_size=3), _tensors(), st.lists(st.integers(-2, 4), max_size=3),
)  # fmt: skip

COMPOSITE_METHODS = [
    "update", "get_seq_length", "get_mask_sizes", "get_max_length", "crop", "check_crop", "reorder_cache",
    "batch_select_indices", "batch_repeat_interleave", "update_conv_state", "update_recurrent_state",
    "get_conv_state", "get_recurrent_state", "has_previous_state", "is_recording_past", "to",
]  # fmt: skip
LAYER_METHODS = [
    "update", "get_mask_sizes", "crop", "check_crop", "reorder_cache", "batch_select_indices",
    "batch_repeat_interleave", "update_conv_state", "update_recurrent_state", "get_conv_state",
    "get_recurrent_state", "has_previous_state", "to",
]  # fmt: skip
STATES = ["empty", "populated", "recording"]


def _composite(kind: str, state: str) -> Any:
    cache = {"mixed": mixed, "lazy": DynamicCache, "static": lambda: StaticCache(8), "recurrent_first": recurrent_first,
             "encoder_decoder": lambda: EncoderDecoderCache(DynamicCache(), DynamicCache())}[kind]()  # fmt: skip
    if state != "empty":
        _grow(cache, steps=2)
        if state == "recording":
            cache.activate_past_recording()
            _grow(cache, steps=1)
    return cache


def _grow(cache: Any, steps: int) -> None:
    if isinstance(cache, EncoderDecoderCache):
        for step in range(steps):
            cache.update(*kv(1, seed=step), 0)
        if not cache.cross_attention_cache.layers:
            cache.cross_attention_cache.update(*kv(3), 0)
    elif isinstance(cache.layer_factory, type) or (cache.layer_factory is not None and not cache.layers):
        for step in range(steps):
            cache.update(*kv(1, seed=step), 0)
    else:
        feed(cache, steps)


def call_and_check(target: Any, cache: Any, method: str, args: list) -> None:
    """Call `target.method(*args)`: success, or a KVCacheError with `cache` deeply unchanged."""
    if not hasattr(target, method):
        return
    before = snapshot(cache)
    try:
        getattr(target, method)(*args)
    except KVCacheError:
        assert_unchanged(before, snapshot(cache))
    except TypeError as err:  # a wrong number of arguments is Python's call error, not a value check
        assert "positional argument" in str(err) or "takes" in str(err), err
        assert_unchanged(before, snapshot(cache))


def _layer(kind: str, state: str) -> Any:
    makers = {"dynamic": DynamicLayer, "sliding": lambda: SlidingWindowLayer(3), "static": lambda: StaticLayer(8),
              "recurrent": RecurrentLayer, "hybrid": lambda: HybridLayer(DynamicLayer(), RecurrentLayer())}  # fmt: skip
    layer = makers[kind]()
    if state != "empty":
        for step in range(2):
            if state == "recording" and step == 1:
                layer.activate_past_recording()
            if layer.has_attention:
                layer.update(*kv(1, seed=step))
            if layer.has_recurrent:
                layer.update_conv_state(torch.randn(2, 3, 1), conv_kernel_size=2)
                layer.update_recurrent_state(torch.randn(2, 3))
    return layer


def _layer_in_cache(kind: str, state: str) -> tuple[Any, Cache]:
    layer = _layer(kind, state)
    return layer, Cache([layer])


#: What the property test drives: the kinds to build, the methods to call, and a builder returning
#: (object to call, composite whose deep state must stay unchanged on an error).
TARGETS: dict[str, tuple[list[str], list[str], Callable[[str, str], tuple[Any, Any]]]] = {
    "composite": (["mixed", "lazy", "static", "recurrent_first", "encoder_decoder"], COMPOSITE_METHODS,
                  lambda kind, state: (cache := _composite(kind, state), cache)),
    "layer": (["dynamic", "sliding", "static", "recurrent", "hybrid"], LAYER_METHODS, _layer_in_cache),
}  # fmt: skip


@pytest.mark.parametrize("target", sorted(TARGETS))
@settings(max_examples=300)
@given(data=st.data())
def test_every_public_method_with_arbitrary_values(target: str, data: st.DataObject) -> None:
    """Every public method of every layer and composite, in every state, with arbitrary values."""
    kinds, methods, build = TARGETS[target]
    kind, state = data.draw(st.sampled_from(kinds), "kind"), data.draw(st.sampled_from(STATES), "state")
    method = data.draw(st.sampled_from(methods), "method")
    args = data.draw(st.lists(VALUES, min_size=0, max_size=3), "args")
    subject, cache = build(kind, state)
    call_and_check(subject, cache, method, args)


@pytest.mark.parametrize("kind", ["dynamic", "sliding", "static", "recurrent", "hybrid", "quantized", "quantized rows"])
@pytest.mark.parametrize("state", STATES)
def test_record_past_takes_only_a_bool(kind: str, state: str) -> None:
    """`layer.record_past = "false"` (or 1, or None) is refused in every state, the layer unchanged:
    any truthy value started recording before, so the string "false" turned recording on."""
    if kind.startswith("quantized"):
        layer = QuantizedLayer(4, 32, residual=4)
        if state == "recording":
            layer.activate_past_recording()
        if state != "empty":
            layer.update(*kv(6, batch=1))
        if kind == "quantized rows":
            layer = QuantizedRows([layer], [0])
    else:
        layer = _layer(kind, state)
    cache = Cache([layer])
    for value in ("false", 1, None, torch.tensor(True)):
        before, recording = snapshot(cache), layer.record_past
        with pytest.raises(CacheInputError, match="record_past must be True or False"):
            layer.record_past = value
        assert_unchanged(before, snapshot(cache))
        assert layer.record_past is recording
    layer.record_past = True
    assert layer.record_past is True
