"""Fixed-shape layers for `torch.compile`: `StaticRecurrentLayer` against `RecurrentLayer` (the
eager reference, whose own tests hold it to a naive model), fixed addresses, and whole reference
models on a `StaticCache`: close to a forward without cache, bitwise after crop-and-regrow and
after save/load. (`StaticSlidingWindowLayer` runs in the naive-model state machine of
test_layers_stateful.py and the crop-and-regrow property of test_layers_rollback.py.)"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kvcache import (
    CacheInputError,
    CacheOverflowError,
    HybridLayer,
    RecurrentLayer,
    RollbackError,
    StaticCache,
    StaticLayer,
    StaticRecurrentLayer,
    StaticSlidingWindowLayer,
    load_cache,
    save_cache,
)
from kvcache.models import DecoderConfig, DecoderLM, HybridConfig, HybridLM

RING = 5


def rand(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


# ----------------------------------------------------------------- recurrent: the eager reference
step_strategy = st.tuples(
    st.integers(1, 4),  # tokens
    st.integers(0, 4),  # intermediate states the model hands (0: none; fewer than tokens: the last ones)
    st.sampled_from(["conv+rec", "rec", "conv"]),  # what the step updates
)


@given(
    steps=st.lists(st.tuples(step_strategy, st.integers(0, RING + 1), st.booleans()), min_size=1, max_size=14),
    prefill=st.integers(1, 6),
)
def test_static_recurrent_layer_agrees_with_recurrent_layer(steps, prefill) -> None:
    """Same calls to both: same returns, same held states; a crop the static layer accepts lands
    where the eager one lands, and one it refuses is beyond its ring or not a known boundary."""
    ours, ref = StaticRecurrentLayer(rollback_tokens=RING), RecurrentLayer()
    conv_channels, shape = 3, (2, 2, 3)

    def step(n: int, inter: bool, what: str, seed: int) -> None:
        if what != "rec":
            x = rand(2, conv_channels, n, seed=seed)
            assert torch.equal(
                ours.update_conv_state(x, conv_kernel_size=3), ref.update_conv_state(x, conv_kernel_size=3)
            )
        if what != "conv":
            states = rand(2, n, *shape[1:], seed=seed + 1)
            k = n if what == "rec" else min(inter, n)  # only a conv-opened step may get fewer states than tokens
            plain = {"num_tokens": n} if what == "rec" else {}
            kwargs = {"intermediate_states": states[:, n - k :]} if inter else plain
            assert torch.equal(ours.update_recurrent_state(states[:, -1].clone(), **kwargs),
                               ref.update_recurrent_state(states[:, -1].clone(), **kwargs))  # fmt: skip

    def same_held() -> None:
        assert ours.get_seq_length() == ref.get_seq_length()
        for get in ("get_conv_state", "get_recurrent_state"):
            a, b = getattr(ours, get)(), getattr(ref, get)()
            assert (a is None) == (b is None) and (a is None or torch.equal(a, b))

    step(prefill, False, "conv+rec", 0)
    ours.activate_past_recording()
    ref.activate_past_recording()
    kinds = {what for (_, _, what), _, _ in steps}
    if len(kinds) > 1:  # a layer's steps are all of one shape (a model calls its cache the same way each step)
        steps = [((n, inter, "conv+rec"), crop, commit) for (n, inter, _), crop, commit in steps]
    for i, ((n, inter, what), crop, commit) in enumerate(steps, start=1):
        step(n, inter, what, 10 * i)
        same_held()
        if commit:
            ours.crop(0)
            ref.crop(0)
        if crop:
            try:
                ours.check_crop(-crop)
            except RollbackError:
                ok = False
                assert crop > ours.max_rollback or not _restorable_in(ref, crop)
            else:
                ok = True
                ref.check_crop(-crop)  # the eager layer keeps everything: it must agree
            if ok:
                ours.crop(-crop)
                ref.crop(-crop)
        same_held()


def _restorable_in(layer: RecurrentLayer, n: int) -> bool:
    try:
        layer.check_crop(-n)
    except RollbackError:
        return False
    return True


def test_static_recurrent_keeps_its_addresses_and_refuses_what_its_ring_lost() -> None:
    layer = StaticRecurrentLayer(rollback_tokens=3)
    layer.update_conv_state(rand(1, 2, 4, seed=0), conv_kernel_size=3)
    layer.update_recurrent_state(rand(1, 5, seed=1))
    layer.activate_past_recording()
    ptrs = (layer.get_conv_state().data_ptr(), layer.get_recurrent_state().data_ptr())
    for i in range(5):
        layer.update_conv_state(rand(1, 2, 1, seed=10 + i))
        layer.update_recurrent_state(rand(1, 5, seed=20 + i))
        if i == 2:
            layer.crop(-2)
    assert (layer.get_conv_state().data_ptr(), layer.get_recurrent_state().data_ptr()) == ptrs
    assert layer.max_rollback == 3
    with pytest.raises(RollbackError, match="at most 3"):
        layer.crop(-4)
    before = layer.meta_state, {k: v.clone() for k, v in layer.state.items()}
    with pytest.raises(CacheInputError):
        layer.update_recurrent_state(rand(2, 5, seed=0))  # wrong batch: nothing changes
    assert layer.meta_state == before[0] and all(torch.equal(layer.state[k], v) for k, v in before[1].items())
    with pytest.raises(CacheInputError, match="rollback_tokens"):
        StaticRecurrentLayer(rollback_tokens=0)


def test_static_sliding_layer_fixed_shape_and_overflow() -> None:
    layer = StaticSlidingWindowLayer(4, max_cache_len=64, rollback_tokens=3)
    assert layer.capacity == 6
    layer.update(rand(1, 2, 10, 4, seed=0), rand(1, 2, 10, 4, seed=1))  # a prefill: served eagerly
    ptr, shapes = layer.keys.data_ptr(), set()
    for i in range(6):
        k = rand(1, 2, 1 + i % 3, 4, seed=10 + i)
        shapes.add(layer.update(k, k)[0].shape)
    assert shapes == {(1, 2, 6, 4)} and layer.keys.data_ptr() == ptr
    small = StaticSlidingWindowLayer(8, max_cache_len=4)  # the whole budget is shorter than the window
    small.update(rand(1, 1, 4, 2, seed=0), rand(1, 1, 4, 2, seed=0))
    with pytest.raises(CacheOverflowError, match="max_cache_len=4"):
        small.update(rand(1, 1, 1, 2, seed=0), rand(1, 1, 1, 2, seed=0))
    assert small.get_seq_length() == 4


def test_hybrid_layer_pairs_static_parts_and_refuses_mismatches() -> None:
    layer = HybridLayer(StaticLayer(8), StaticRecurrentLayer())
    assert layer.is_compileable and not HybridLayer(StaticLayer(8), RecurrentLayer()).is_compileable
    with pytest.raises(CacheInputError, match="recurrent must be"):
        HybridLayer(StaticLayer(8), StaticLayer(8))


# ----------------------------------------------------------------------------- whole models
def _model(kind: str) -> DecoderLM:
    torch.manual_seed(0)
    if kind == "decoder":
        return DecoderLM(DecoderConfig(layer_types=["full_attention", "sliding_attention"])).eval()
    model = HybridLM(HybridConfig()).eval()
    model.set_return_intermediate_states(True)
    return model


#: A static cache's attention reads fixed-shape keys (unwritten slots masked) where a forward without
#: cache reads exactly the tokens: different reductions. Measured at 1 and 2 threads: max 4.5e-7.
STATIC_ATOL = 1e-5


@pytest.mark.parametrize("kind", ["decoder", "hybrid"])
def test_reference_models_on_a_static_cache(kind: str, tmp_path) -> None:
    model = _model(kind)
    ids = torch.randint(0, 256, (1, 48), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        whole = model(ids)
        cache = model.new_static_cache(64)
        steps = [model(ids[:, :20], cache=cache)] + [model(ids[:, i : i + 1], cache=cache) for i in range(20, 48)]
        assert torch.allclose(torch.cat(steps, 1), whole, atol=STATIC_ATOL, rtol=0)
        assert cache.is_compileable and cache.get_seq_length() == 48

        cache = model.new_static_cache(64)
        cache.activate_past_recording()
        model(ids[:, :20], cache=cache)
        pos = 20
        for draft in (4, 2, 5, 1, 3, 4, 5):  # verify forwards of up to rollback_tokens - 1 drafts, most rejected
            before = cache.copy()
            model(ids[:, pos : pos + draft + 1], cache=cache)
            cache.crop(-draft)  # the first token stays: it was computed in the chunk, so compare from the next
            replay = before
            model(ids[:, pos : pos + draft + 1], cache=replay)
            replay.crop(-draft)
            got, want = model(ids[:, pos + 1 : pos + 2], cache=cache), model(ids[:, pos + 1 : pos + 2], cache=replay)
            assert torch.equal(got, want)
            pos += 2
        path = tmp_path / "static.kvc"
        save_cache(cache, path)
        loaded = load_cache(path)
        assert torch.equal(model(ids[:, pos : pos + 1], cache=loaded), model(ids[:, pos : pos + 1], cache=cache))


def test_crop_and_regrow_on_a_static_cache_equals_the_run_that_never_went_further() -> None:
    """The crop path proper: A takes 1 token, 4 drafts it then rejects; B took the same 1-token step
    and nothing else. The next step of both is the same computation, so it is bitwise equal."""
    model = _model("hybrid")
    ids = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        a, b = model.new_static_cache(64), model.new_static_cache(64)
        for c in (a, b):
            c.activate_past_recording()
            model(ids[:, :24], cache=c)
            model(ids[:, 24:25], cache=c)
        model(ids[:, 25:29], cache=a)
        a.crop(-4)
        assert torch.equal(model(ids[:, 25:26], cache=a), model(ids[:, 25:26], cache=b))


def test_static_cache_arguments() -> None:
    cache = StaticCache(32, layer_types=["full_attention", "sliding_attention", "linear_attention", "hybrid"],
                        sliding_window=4, rollback_tokens=2)  # fmt: skip
    kinds = [type(layer).__name__ for layer in cache]
    assert kinds == ["StaticLayer", "StaticSlidingWindowLayer", "StaticRecurrentLayer", "HybridLayer"]
    assert cache.layers[1].capacity == 5 and cache.layers[2].rollback_tokens == 2
    for bad in ({"layer_types": ["sliding_attention"]}, {"layer_types": ["nope"]}, {"layer_types": "full"},
                {"num_layers": 2, "layer_types": ["full_attention"]}):  # fmt: skip
        with pytest.raises(CacheInputError):
            StaticCache(32, **bad)
