"""Stateful property tests: each attention layer kind against a naive list-of-tokens model.

Hypothesis drives long random sequences of `update` (1..8 tokens, sometimes malformed), `crop`
(exact, too far, positive, not an int), `crop(0)`, `activate_past_recording`, `record_past = False`,
batch operations (valid and invalid indices), `reset` and forks (`copy`, `deepcopy`, rebuild from
`state`/`meta_state`). After every step, every observable of the layer must agree with
`NaiveLayer`, and every call the model says must fail has to raise the predicted error and leave
the layer exactly as it was.

`NaiveLayer` holds every token not rolled back as its own `(key, value)` slice, and decides what a
sliding-window layer holds from first principles: the tokens some reachable state still needs
(a state the layer can crop back to needs the `W - 1` tokens before it); evicted tokens are gone
for good. It shares no formula or code with the layers under test.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from dataclasses import dataclass

import pytest
import torch
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

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

#: `rollback_tokens` of the static sliding layers under test: small, so the ring wraps often.
RING_ROOM = 4

FAULTS = ("rank3", "rank5", "seq_mismatch", "batch", "heads", "key_dim", "value_dim", "dtype", "kv_dtype", "device")


@dataclass(frozen=True)
class Spec:
    """What the first update fixed: every later update must match it."""

    batch: int
    heads: int
    key_dim: int
    value_dim: int
    dtype: torch.dtype
    device: torch.device


class NaiveLayer:
    """Reference model: a plain list of per-token `(key, value)` slices `[batch, heads, dim]`.

    `floor` is the index of the oldest token a sliding-window layer still holds; a token below it
    was evicted and can never come back. `commit` is the commit point (activation or last crop(0)).
    """

    def __init__(self, kind: str, window: int | None = None, max_len: int | None = None) -> None:
        self.kind, self.window, self.max_len = kind, window, max_len
        if kind == "static_sliding":  # a ring of the window plus RING_ROOM positions
            self.capacity = min(max_len, window - 1 + RING_ROOM)  # type: ignore[operator,type-var]
        self.visible = (0, 0)  # the slice of the last update's return that queries can attend to
        self.tokens: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.spec: Spec | None = None
        self.recording = False
        self.commit = 0
        self.floor = 0

    # ----------------------------------------------------------------------------- observables
    @property
    def seen(self) -> int:
        return len(self.tokens)

    def needed_from(self, length: int) -> int:
        """Oldest token index that a layer holding `length` tokens needs for its next update."""
        if self.kind not in ("sliding", "static_sliding"):
            return 0
        return max(0, length - (self.window - 1))

    def can_restore(self, length: int) -> bool:
        """Can the layer be put back exactly to `length` tokens: is everything that state needs held?"""
        return 0 <= length <= self.seen and self.needed_from(length) >= self.floor

    @property
    def max_rollback(self) -> int:
        return max(n for n in range(self.seen + 1) if self.can_restore(self.seen - n))

    @property
    def is_croppable(self) -> bool:
        if self.kind == "static_sliding":
            return self.recording and self.seen - self.commit <= self.max_rollback
        return self.recording if self.kind == "sliding" else True

    def fixed_shape(self, query_length: int) -> bool:
        """A static sliding update served from the ring: it fits, or the window plus it fits."""
        return self.seen + query_length <= self.capacity or query_length <= self.capacity - (self.window - 1)

    def mask_sizes(self, query_length: int) -> tuple[int, int]:
        if self.kind == "static":
            return self.max_len, 0
        if self.kind == "static_sliding" and self.fixed_shape(query_length):
            return self.capacity, max(self.seen + query_length - self.capacity, 0)
        first_visible = self.needed_from(self.seen)
        return self.seen - first_visible + query_length, first_visible

    @property
    def max_length(self) -> int:
        return {"dynamic": -1, "sliding": self.window, "static_sliding": self.window, "static": self.max_len}[self.kind]

    def stacked(self, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokens [lo, hi) as `[batch, heads, n, dim]` keys and values."""
        assert self.spec is not None
        s = self.spec
        keys = [k for k, _ in self.tokens[lo:hi]]
        values = [v for _, v in self.tokens[lo:hi]]
        empty_k = torch.empty(s.batch, s.heads, 0, s.key_dim, dtype=s.dtype)
        empty_v = torch.empty(s.batch, s.heads, 0, s.value_dim, dtype=s.dtype)
        return (
            torch.stack(keys, dim=2) if keys else empty_k,
            torch.stack(values, dim=2) if values else empty_v,
        )

    def held(self) -> tuple[torch.Tensor, torch.Tensor]:
        """What the layer keeps: all tokens from `floor` on."""
        return self.stacked(self.floor, self.seen)

    # -------------------------------------------------------------------------------- actions
    def update_error(self, keys: object, values: object) -> type[Exception] | None:
        """The error `update(keys, values)` must raise, or None when it is valid."""
        if not isinstance(keys, torch.Tensor) or not isinstance(values, torch.Tensor):
            return CacheInputError
        if keys.dim() != 4 or values.dim() != 4 or keys.shape[:3] != values.shape[:3]:
            return CacheInputError
        if keys.dtype != values.dtype or keys.device != values.device:
            return CacheInputError
        s = self.spec
        if s is not None and (
            (keys.shape[0], keys.shape[1], keys.shape[3], values.shape[3], keys.dtype, keys.device)
            != (s.batch, s.heads, s.key_dim, s.value_dim, s.dtype, s.device)
        ):
            return CacheInputError
        if self.kind == "static" and self.seen + keys.shape[2] > self.max_len:
            return CacheOverflowError
        if self.kind == "static_sliding" and not self.fixed_shape(keys.shape[2]) and self.capacity < self.window - 1:
            return CacheOverflowError
        return None

    def update(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append and return what attention must see."""
        if self.spec is None:
            self.spec = Spec(keys.shape[0], keys.shape[1], keys.shape[3], values.shape[3], keys.dtype, keys.device)
        before, n = self.seen, keys.shape[2]
        ring = self.kind == "static_sliding" and self.fixed_shape(n)
        self.tokens += [(keys[:, :, i].clone(), values[:, :, i].clone()) for i in range(n)]
        first = self.needed_from(before)
        assert first >= self.floor, "model broken: a needed token was evicted"
        if self.kind == "dynamic":
            out = self.stacked(0, self.seen)
        elif self.kind == "static" or ring:
            # fixed shape: positions [offset, offset + length); only those the queries can see matter
            length = self.max_len if self.kind == "static" else self.capacity
            offset = 0 if self.kind == "static" else max(self.seen - length, 0)
            out = self.padded(first, offset, length)
            self.visible = (first - offset, self.seen - offset)
        else:
            out = self.stacked(first, self.seen)
        if not (self.kind == "static" or ring):
            self.visible = (0, out[0].shape[2])
        self._evict()
        return out

    def padded(self, first: int, offset: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokens [first, seen) placed at their positions in a zero tensor of positions [offset, offset + length)."""
        s = self.spec
        assert s is not None
        k, v = self.stacked(first, self.seen)
        full_k = torch.zeros(s.batch, s.heads, length, s.key_dim, dtype=s.dtype)
        full_v = torch.zeros(s.batch, s.heads, length, s.value_dim, dtype=s.dtype)
        full_k[:, :, first - offset : self.seen - offset], full_v[:, :, first - offset : self.seen - offset] = k, v
        return full_k, full_v

    def _evict(self) -> None:
        """Drop what no reachable state needs: while recording, any length back to the commit point
        is reachable; otherwise only the current one."""
        if self.kind == "sliding":
            oldest_reachable = self.commit if self.recording else self.seen
            self.floor = max(self.floor, self.needed_from(oldest_reachable))
        elif self.kind == "static_sliding":  # the ring keeps the last `capacity` positions, recording or not
            self.floor = max(self.floor, self.seen - self.capacity)

    def crop_error(self, arg: object) -> type[Exception] | None:
        if isinstance(arg, bool) or not isinstance(arg, int) or arg > 0:
            return RollbackError
        return None if self.can_restore(self.seen + arg) else RollbackError

    def crop(self, arg: int) -> None:
        if arg == 0:
            self.commit = self.seen
            self._evict()
        else:
            del self.tokens[self.seen + arg :]
            self.commit = min(self.commit, self.seen)

    def activate(self) -> None:
        if not self.recording:
            self.crop(0)
            self.recording = True

    def stop_recording(self) -> None:
        if self.recording:
            self.crop(0)
            self.recording = False

    def reset(self) -> None:
        """Forget every token. A static layer keeps its preallocated storage (fixed addresses for
        compiled graphs), so what its first update fixed still holds."""
        self.tokens, self.commit, self.floor = [], 0, 0
        if self.kind not in ("static", "static_sliding"):
            self.spec = None

    def index_error(self, index: object) -> type[Exception] | None:
        t = torch.as_tensor(index)
        if t.dim() != 1 or t.dtype == torch.bool or t.is_floating_point():
            return CacheInputError
        if self.spec is not None and t.numel() and (int(t.min()) < 0 or int(t.max()) >= self.spec.batch):
            return CacheInputError
        return None

    def index_batch(self, index: torch.Tensor) -> None:
        if self.spec is None:
            return
        self.tokens = [(k[index], v[index]) for k, v in self.tokens]
        self.spec = dataclasses.replace(self.spec, batch=len(index))

    def repeat(self, repeats: int) -> None:
        if self.spec is None:
            return
        self.tokens = [(k.repeat_interleave(repeats, 0), v.repeat_interleave(repeats, 0)) for k, v in self.tokens]
        self.spec = dataclasses.replace(self.spec, batch=self.spec.batch * repeats)


# ------------------------------------------------------------------------------------ helpers
def snapshot(layer: CacheLayer) -> tuple:
    """Everything observable about a layer, detached from its storage."""
    return (
        layer.meta_state,
        {name: t.clone() for name, t in layer.state.items()},
        layer.get_seq_length(),
        layer.max_rollback,
        layer.is_croppable,
        layer.record_past,
        layer.batch_size,
    )


def assert_same_snapshot(a: tuple, b: tuple) -> None:
    assert a[0] == b[0] and a[2:] == b[2:], (a[0], b[0], a[2:], b[2:])
    assert a[1].keys() == b[1].keys()
    for name in a[1]:
        assert_bitwise(a[1][name], b[1][name])


def assert_bitwise(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.shape == want.shape, (tuple(got.shape), tuple(want.shape))
    assert got.dtype == want.dtype
    assert torch.equal(got, want)


def build_layer(kind: str, window: int, max_len: int) -> CacheLayer:
    if kind == "dynamic":
        return DynamicLayer()
    if kind == "sliding":
        return SlidingWindowLayer(window)
    if kind == "static_sliding":
        return StaticSlidingWindowLayer(window, max_len, rollback_tokens=RING_ROOM)
    return StaticLayer(max_len)


# ---------------------------------------------------------------------------- state machines
class LayerMachine(RuleBasedStateMachine):
    kind = "dynamic"

    @initialize(
        window=st.integers(1, 7),
        max_len=st.integers(1, 48),
        batch=st.integers(1, 3),
        heads=st.integers(1, 2),
        key_dim=st.integers(1, 3),
        value_dim=st.integers(1, 4),
        record_first=st.booleans(),
    )
    def setup(self, window, max_len, batch, heads, key_dim, value_dim, record_first) -> None:
        self.layer = build_layer(self.kind, window, max_len)
        self.model = NaiveLayer(self.kind, window, max_len)
        self.dims = (batch, heads, key_dim, value_dim)
        self.last_returned: tuple[torch.Tensor, ...] | None = None
        self.stale_forks: list[tuple[CacheLayer, tuple]] = []
        if record_first:
            self.layer.activate_past_recording()
            self.model.activate()

    # -------------------------------------------------------------------------------- inputs
    def make_kv(self, n: int, seed: int, fault: str | None) -> tuple[object, object]:
        s = self.model.spec
        batch, heads, key_dim, value_dim = (s.batch, s.heads, s.key_dim, s.value_dim) if s else self.dims
        dtype = s.dtype if s else torch.float32
        gen = torch.Generator().manual_seed(seed)
        k_shape, v_shape = [batch, heads, n, key_dim], [batch, heads, n, value_dim]
        if fault == "batch":
            k_shape[0] = v_shape[0] = batch + 1
        elif fault == "heads":
            k_shape[1] = v_shape[1] = heads + 1
        elif fault == "key_dim":
            k_shape[3] += 1
        elif fault == "value_dim":
            v_shape[3] += 1
        elif fault == "seq_mismatch":
            v_shape[2] += 1
        keys = torch.randn(k_shape, generator=gen).to(dtype)
        values = torch.randn(v_shape, generator=gen).to(dtype)
        if fault == "rank3":
            keys = keys[0]
        elif fault == "rank5":
            values = values[None]
        elif fault == "dtype":
            keys, values = keys.double(), values.double()
        elif fault == "kv_dtype":
            values = values.half()
        elif fault == "device":
            keys, values = keys.to("meta"), values.to("meta")
            if s is None:  # a first update on meta would be valid but uncomparable
                keys = keys[0]
        return keys, values

    def expect_unchanged(self, expected_error: type[Exception], call) -> None:
        before = snapshot(self.layer)
        with pytest.raises(expected_error) as info:
            call()
        assert type(info.value) is expected_error or expected_error is RollbackError, info.value
        assert str(info.value)
        assert_same_snapshot(snapshot(self.layer), before)

    # --------------------------------------------------------------------------------- rules
    @rule(n=st.integers(0, 8), seed=st.integers(0, 2**31 - 1))
    def update(self, n, seed) -> None:
        self.check_update(*self.make_kv(n, seed, None))

    @rule(seed=st.integers(0, 2**31 - 1))
    def decode_step(self, seed) -> None:
        self.check_update(*self.make_kv(1, seed, None))

    @rule(n=st.integers(0, 3), seed=st.integers(0, 2**31 - 1), fault=st.sampled_from(FAULTS))
    def bad_update(self, n, seed, fault) -> None:
        self.check_update(*self.make_kv(n, seed, fault))

    def check_update(self, keys, values) -> None:
        n = keys.shape[2] if isinstance(keys, torch.Tensor) and keys.dim() == 4 else 0
        error = self.model.update_error(keys, values)
        if error is not None:
            self.expect_unchanged(error, lambda: self.layer.update(keys, values))
            return
        predicted = self.layer.get_mask_sizes(n)
        got_k, got_v = self.layer.update(keys, values)
        want_k, want_v = self.model.update(keys, values)
        # A static layer returns fixed-shape tensors whose other slots the mask hides (unwritten,
        # or holding cropped tokens): only the visible slots are part of the contract.
        lo, hi = self.model.visible
        assert got_k.shape == want_k.shape and got_v.shape == want_v.shape
        assert_bitwise(got_k[:, :, lo:hi], want_k[:, :, lo:hi])
        assert_bitwise(got_v[:, :, lo:hi], want_v[:, :, lo:hi])
        # The mask sizes announced before the update describe exactly what it returned.
        assert predicted[0] == got_k.shape[2]
        first, last = predicted[1] + lo, predicted[1] + hi  # the absolute positions of the visible slots
        assert_bitwise(got_k[:, :, lo:hi], self.model.stacked(first, last)[0])
        self.last_returned = (got_k[:, :, lo:hi], got_v[:, :, lo:hi], want_k[:, :, lo:hi], want_v[:, :, lo:hi])

    @rule(n=st.integers(0, 12))
    def crop_back(self, n) -> None:
        error = self.model.crop_error(-n)
        if error is not None:
            assert n > self.layer.max_rollback
            self.expect_unchanged(error, lambda: self.layer.crop(-n))
            return
        self.layer.crop(-n)
        self.model.crop(-n)
        self.last_returned = None

    @rule(n=st.integers(0, 4))
    def crop_exactly_max(self, n) -> None:
        """Probe the boundary: max_rollback works, max_rollback + 1 + n does not."""
        most = self.model.max_rollback
        assert self.layer.max_rollback == most
        self.expect_unchanged(RollbackError, lambda: self.layer.crop(-(most + 1 + n)))
        if most:
            self.layer.crop(-most)
            self.model.crop(-most)
            self.last_returned = None

    @rule(arg=st.sampled_from([1, 5, 1.0, -1.0, True, False, "2", None]))
    def crop_bad_argument(self, arg) -> None:
        self.expect_unchanged(RollbackError, lambda: self.layer.crop(arg))

    @rule()
    def commit(self) -> None:
        self.layer.crop(0)
        self.model.crop(0)
        self.last_returned = None

    @rule()
    def activate(self) -> None:
        self.layer.activate_past_recording()
        self.model.activate()
        self.last_returned = None

    @rule()
    def stop_recording(self) -> None:
        self.layer.record_past = False
        self.model.stop_recording()
        self.last_returned = None

    @rule(data=st.data())
    def batch_index(self, data) -> None:
        batch = self.model.spec.batch if self.model.spec else 3
        index = data.draw(
            st.lists(st.integers(-1, batch), min_size=1, max_size=4).map(torch.tensor)
            | st.sampled_from([torch.tensor([[0]]), torch.tensor([0.0]), torch.tensor([True])]),
            label="index",
        )
        method = data.draw(st.sampled_from(["reorder_cache", "batch_select_indices"]), label="method")
        error = self.model.index_error(index)
        if error is not None:
            self.expect_unchanged(error, lambda: getattr(self.layer, method)(index))
            return
        getattr(self.layer, method)(index)
        self.model.index_batch(index)
        self.last_returned = None

    @rule(repeats=st.sampled_from([1, 2, 0, -1, True, 1.5]))
    def repeat_interleave(self, repeats) -> None:
        valid = isinstance(repeats, int) and not isinstance(repeats, bool) and repeats >= 1
        if not valid:
            self.expect_unchanged(CacheInputError, lambda: self.layer.batch_repeat_interleave(repeats))
            return
        if self.model.spec is not None and self.model.spec.batch * repeats > 4:
            return
        self.layer.batch_repeat_interleave(repeats)
        self.model.repeat(repeats)
        self.last_returned = None

    @rule()
    def reset(self) -> None:
        self.layer.reset()
        self.model.reset()
        self.last_returned = None

    @rule(how=st.sampled_from(["copy", "deepcopy", "from_state"]))
    def fork(self, how) -> None:
        """Continue with a fork; the original, changed afterwards, must not affect it."""
        if how == "copy":
            fork = self.layer.copy()
        elif how == "deepcopy":
            fork = copy.deepcopy(self.layer)
        else:
            state = {name: t.clone() for name, t in self.layer.state.items()}
            fork = type(self.layer).from_state(self.layer.meta_state, state)
        assert_same_snapshot(snapshot(fork), snapshot(self.layer))
        old, self.layer = self.layer, fork
        self.last_returned = None  # views into `old`, which the next rule may mutate
        self.stale_forks = [(old, snapshot(fork))]

    @precondition(lambda self: self.stale_forks)
    @rule(seed=st.integers(0, 2**31 - 1))
    def scribble_on_original(self, seed) -> None:
        """Mutate the layer we forked from; the fork (the layer under test) must not notice."""
        old, _ = self.stale_forks.pop()
        before = snapshot(self.layer)
        if old.get_seq_length() and old.max_rollback:
            old.crop(-1)
        held = old.state
        if held and (self.kind != "static" or old.get_seq_length() < old.get_max_length()):
            gen = torch.Generator().manual_seed(seed)
            k, v = held["keys"], held["values"]
            with contextlib.suppress(CacheOverflowError):  # a static sliding ring smaller than its window, full
                old.update(
                    torch.randn(*k.shape[:2], 1, k.shape[3], generator=gen).to(k.dtype),
                    torch.randn(*v.shape[:2], 1, v.shape[3], generator=gen).to(v.dtype),
                )
        old.reset()
        assert_same_snapshot(snapshot(self.layer), before)

    # ---------------------------------------------------------------------------- invariants
    @invariant()
    def agrees_with_model(self) -> None:
        layer, model = self.layer, self.model
        assert layer.get_seq_length() == model.seen
        assert layer.max_rollback == model.max_rollback
        assert layer.is_croppable == model.is_croppable
        assert layer.record_past == model.recording
        assert layer.get_max_length() == model.max_length
        for q in (0, 1, 5):
            assert layer.get_mask_sizes(q) == model.mask_sizes(q)
        state = layer.state
        if model.spec is None:
            assert state == {} or state["keys"].shape[2] == 0
            assert layer.batch_size is None
            return
        assert layer.batch_size == model.spec.batch
        want_k, want_v = model.held()
        assert_bitwise(state["keys"], want_k)
        assert_bitwise(state["values"], want_v)
        if self.kind == "sliding":
            recorded = model.seen - model.commit if model.recording else 0
            assert state["keys"].shape[2] <= layer.sliding_window - 1 + recorded

    @invariant()
    def last_returned_still_valid(self) -> None:
        """Until the next mutating call, the tensors the last update returned keep their values
        (failing calls and queries count as non-mutating)."""
        if self.last_returned is not None:
            got_k, got_v, want_k, want_v = self.last_returned
            assert_bitwise(got_k, want_k)
            assert_bitwise(got_v, want_v)


class SlidingMachine(LayerMachine):
    kind = "sliding"


class StaticMachine(LayerMachine):
    kind = "static"


class StaticSlidingMachine(LayerMachine):
    kind = "static_sliding"


TestDynamicLayer = LayerMachine.TestCase
TestSlidingWindowLayer = SlidingMachine.TestCase
TestStaticLayer = StaticMachine.TestCase
TestStaticSlidingWindowLayer = StaticSlidingMachine.TestCase
