"""`HybridLayer`: an attention layer and a `RecurrentLayer` under one index, checked against the same two
layers driven separately (the reference), through random sequences of updates, crops and batch ops."""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kvcache import (
    LAYER_REGISTRY,
    CacheInputError,
    DynamicCache,
    DynamicLayer,
    HybridLayer,
    RecurrentLayer,
    RollbackError,
    SlidingWindowLayer,
)


def make_attention(kind: str):
    return DynamicLayer() if kind == "full" else SlidingWindowLayer(3)


def snapshot(layer) -> tuple:
    return json.dumps(layer.meta_state, sort_keys=True), {k: v.clone() for k, v in layer.state.items()}


def assert_same(a: tuple, b: tuple) -> None:
    assert a[0] == b[0] and a[1].keys() == b[1].keys()
    assert all(torch.equal(a[1][k], b[1][k]) for k in a[1])


ops = st.lists(
    st.one_of(
        st.tuples(st.just("step"), st.integers(1, 3), st.booleans()),
        st.tuples(st.just("crop"), st.integers(0, 6)),
        st.tuples(st.just("record"), st.booleans()),
        st.tuples(st.just("reorder"), st.permutations([0, 1])),
        st.tuples(st.just("copy")),
    ),
    max_size=25,
)


@given(kind=st.sampled_from(["full", "sliding"]), program=ops, seed=st.integers(0, 1000))
def test_hybrid_equals_its_parts_driven_separately(kind: str, program: list, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    hybrid = HybridLayer(make_attention(kind), RecurrentLayer())
    attention, recurrent = make_attention(kind), RecurrentLayer()
    for op in program:
        if op[0] == "step":
            _, n, inter = op
            k, v = torch.randn(2, 1, n, 2, generator=gen), torch.randn(2, 1, n, 2, generator=gen)
            x = torch.randn(2, 3, n, generator=gen)
            h = torch.randn(2, 2, generator=gen)
            kwargs = {"intermediate_states": torch.randn(2, n, 2, generator=gen)} if inter else {}
            got = hybrid.update(k, v)
            want = attention.update(k, v)
            assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
            assert torch.equal(hybrid.update_conv_state(x, conv_kernel_size=2), recurrent.update_conv_state(x, 0, 2))
            hybrid.update_recurrent_state(h, **kwargs)
            recurrent.update_recurrent_state(h, **kwargs)
        elif op[0] == "crop":
            n = op[1]
            ok = all(_can_crop(part, -n) for part in (attention, recurrent))
            before = snapshot(hybrid)
            if ok:
                hybrid.crop(-n)
                attention.crop(-n)
                recurrent.crop(-n)
            else:
                with pytest.raises(RollbackError):
                    hybrid.crop(-n)
                assert_same(before, snapshot(hybrid))  # a failing crop changes neither part
        elif op[0] == "record":
            for layer in (hybrid, attention, recurrent):
                layer.record_past = op[1]
        elif op[0] == "reorder":
            idx = torch.tensor(op[1])
            for layer in (hybrid, attention, recurrent):
                layer.reorder_cache(idx)
        else:
            hybrid = HybridLayer.from_state(json.loads(json.dumps(hybrid.meta_state)), hybrid.copy().state)
        assert_same(snapshot(hybrid.attention), snapshot(attention))
        assert_same(snapshot(hybrid.recurrent), snapshot(recurrent))
        assert hybrid.max_rollback == min(attention.max_rollback, recurrent.max_rollback)
        assert hybrid.is_croppable == (attention.is_croppable and recurrent.is_croppable)
        assert hybrid.record_past == recurrent.record_past == attention.record_past
        assert hybrid.get_seq_length() == attention.get_seq_length()


def _can_crop(layer, amount: int) -> bool:
    try:
        layer.check_crop(amount)
    except RollbackError:
        return False
    return True


def test_failing_recurrent_check_leaves_attention_untouched() -> None:
    hybrid = HybridLayer(DynamicLayer(), RecurrentLayer())
    hybrid.activate_past_recording()
    hybrid.update(torch.ones(1, 1, 3, 2), torch.ones(1, 1, 3, 2))
    hybrid.update_conv_state(torch.ones(1, 2, 3), conv_kernel_size=2)
    hybrid.update_recurrent_state(torch.ones(1, 4))
    with pytest.raises(RollbackError, match="step boundary"):
        hybrid.crop(-1)  # attention could, the recurrent step of 3 tokens cannot
    assert hybrid.get_seq_length() == 3 and hybrid.keys.shape[2] == 3
    hybrid.crop(-3)
    assert hybrid.get_seq_length() == 0 and hybrid.get_recurrent_state() is None


def test_batch_ops_reach_both_parts_and_stop_recording_commits_both() -> None:
    hybrid = HybridLayer(SlidingWindowLayer(2), RecurrentLayer())
    assert hybrid.is_sliding and hybrid.batch_size is None
    hybrid.activate_past_recording()
    keys = torch.arange(12.0).reshape(3, 1, 2, 2)
    hybrid.update(keys, keys)
    hybrid.update_conv_state(torch.arange(6.0).reshape(3, 1, 2), conv_kernel_size=2)
    hybrid.update_recurrent_state(torch.arange(3.0)[:, None])
    hybrid.batch_select_indices(torch.tensor([2, 0]))
    assert hybrid.batch_size == 2
    assert torch.equal(hybrid.get_recurrent_state(), torch.tensor([[2.0], [0.0]]))
    assert torch.equal(hybrid.get_conv_state()[:, 0], torch.tensor([[4.0, 5.0], [0.0, 1.0]]))
    hybrid.batch_repeat_interleave(2)
    assert hybrid.attention.batch_size == hybrid.recurrent.batch_size == 4
    hybrid.record_past = False
    assert not hybrid.attention.record_past and not hybrid.recurrent.record_past
    assert hybrid.max_rollback == 0 and not hybrid.is_croppable
    with pytest.raises(CacheInputError):
        hybrid.reorder_cache(torch.tensor([4]))
    hybrid.reset()
    assert hybrid.batch_size is None and hybrid.get_seq_length() == 0


def test_construction_and_loading_validate_parts() -> None:
    with pytest.raises(CacheInputError):
        HybridLayer(RecurrentLayer(), RecurrentLayer())
    with pytest.raises(CacheInputError):
        HybridLayer(DynamicLayer(), DynamicLayer())
    assert LAYER_REGISTRY["HybridLayer"] is HybridLayer
    good = HybridLayer(DynamicLayer(), RecurrentLayer()).meta_state
    for bad_class in ("NotALayer", "HybridLayer", "os.system"):
        meta = json.loads(json.dumps(good))
        meta["attention"]["class"] = bad_class
        with pytest.raises(CacheInputError):
            HybridLayer.from_state(meta, {})
    with pytest.raises(CacheInputError):
        HybridLayer.from_state(good, {"stray": torch.zeros(1)})


def test_hybrid_in_a_dynamic_cache_answers_both_protocols() -> None:
    cache = DynamicCache(["hybrid", "linear_attention"])
    cache.update(torch.ones(1, 1, 2, 2), torch.ones(1, 1, 2, 2), 0)
    cache.update_conv_state(torch.ones(1, 2, 2), 0, conv_kernel_size=2)
    assert cache.get_seq_length() == 2 and cache.get_mask_sizes(1, 0) == (3, 0)
    assert cache.has_previous_state(0) and not cache.has_previous_state(1)
