"""Property test: `RecurrentLayer` against a per-token timeline that recomputes every state.

The reference keeps, for every token ever fed (and not rolled back), its conv input column and the
recurrent state after it when that is known (step ends, intermediate states, or "no state at
all"). From that it recomputes what the layer must hold and return: the conv window is the last
`kernel` columns of zeros ++ inputs, the recurrent state is the one after the last kept token, and
a crop is possible exactly when the target token's state is known and lies after the commit point.
"""

from __future__ import annotations

import json

import torch
from hypothesis import assume
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvcache import CacheInputError, RecurrentLayer, RollbackError

UNKNOWN = "unknown"
CHANNELS, KERNEL, STATE = 3, 4, (2, 3)


class Token:
    def __init__(self, col: torch.Tensor | None, state: torch.Tensor | str | None, reported: bool) -> None:
        self.col, self.state, self.reported = col, state, reported


class Reference:
    """All tokens since the start: conv columns and the recurrent state after each token."""

    def __init__(self) -> None:
        self.tokens: list[Token] = []
        self.commit = 0

    def cols(self, upto: int | None = None) -> list[torch.Tensor]:
        return [t.col for t in self.tokens[:upto] if t.col is not None]

    def window(self, batch: int) -> torch.Tensor | None:
        cols = self.cols()
        if not cols:
            return None
        return torch.cat([torch.zeros(batch, CHANNELS, KERNEL), torch.stack(cols, -1)], -1)[..., -KERNEL:]

    def state(self) -> torch.Tensor | None:
        state = self.tokens[-1].state if self.tokens else None
        assert state is not UNKNOWN
        return state  # type: ignore[return-value]

    def can_crop(self, n: int, recording: bool) -> bool:
        p = len(self.tokens) - n
        if n == 0:
            return True
        return recording and p >= self.commit and (p == 0 or self.tokens[p - 1].state is not UNKNOWN)

    def index(self, idx: torch.Tensor) -> None:
        for t in self.tokens:
            t.col = None if t.col is None else t.col[idx]
            if isinstance(t.state, torch.Tensor):
                t.state = t.state[idx]


class RecurrentMachine(RuleBasedStateMachine):
    """One state index; `KIND` says what the model keeps: conv and recurrent, conv only, recurrent only."""

    KIND = "conv+rec"

    @initialize(seed=st.integers(0, 2**16), recording=st.sampled_from([True, True, True, False]))
    def setup(self, seed: int, recording: bool) -> None:
        self.kind = self.KIND
        self.gen = torch.Generator().manual_seed(seed)
        self.layer = RecurrentLayer()
        self.ref = Reference()
        self.batch = 2
        self.points: dict[int, tuple] = {}  # position -> snapshot taken there while recording
        if recording:
            self.layer.activate_past_recording()
            self.mark()

    def rand(self, *shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=self.gen)

    @property
    def recording(self) -> bool:
        return self.layer.record_past

    # ----------------------------------------------------------------------------- growth
    @rule(
        steps=st.lists(
            st.tuples(st.integers(1, 5), st.sampled_from(["update", "inter", "inplace", "none", "num_tokens"])),
            min_size=1,
            max_size=3,
        )
    )
    def decode(self, steps: list[tuple[int, str]]) -> None:
        for n, how in steps:
            self.step(n, how)

    def step(self, n: int, how: str) -> None:
        b, layer, ref = self.batch, self.layer, self.ref
        has_rec = ref.state() is not None
        if self.kind == "rec" and how in ("inplace", "none"):
            how = "update"
        if self.kind == "conv":
            how = "none"
        if how == "inplace" and not has_rec:
            how = "update"
        cols = [None] * n
        if self.kind != "rec":
            x = self.rand(b, CHANNELS, n)
            first = not ref.cols()
            before = ref.cols()
            got = layer.update_conv_state(x, conv_kernel_size=KERNEL if first or n % 2 else None)
            full = torch.cat([torch.zeros(b, CHANNELS, KERNEL), *[c[..., None] for c in before], x], -1)
            width = max(KERNEL, n) if first else KERNEL + n
            assert torch.equal(got, full[..., -width:])
            cols = list(x.unbind(-1))
        states: list[torch.Tensor | str | None]
        if how == "none":
            states = [ref.state()] * n if not has_rec else [UNKNOWN] * (n - 1) + [ref.state().clone()]
        elif how == "inplace":
            live = layer.get_recurrent_state()
            live.mul_(0.5).add_(self.rand(b, *STATE))  # the Mamba2 decode kernel's in-place update
            states = [UNKNOWN] * (n - 1) + [live.clone()]
        else:
            new = self.rand(b, *STATE)
            kwargs = {}
            states = [UNKNOWN] * (n - 1) + [new.clone()]
            if how == "inter":
                inter = torch.cat([self.rand(b, n - 1, *STATE), new[:, None]], 1)
                kwargs["intermediate_states"] = inter
                states = [s.clone() for s in inter.unbind(1)]
            elif how == "num_tokens" or self.kind == "rec":
                kwargs["num_tokens"] = n
            if self.kind == "rec" and how == "update" and n == 1:
                kwargs.pop("num_tokens")  # default: one token per call
            held = layer.update_recurrent_state(new, **kwargs)
            assert torch.equal(held, new)
            new.add_(100.0)  # the model reuses its buffer: the cache must not alias it
            if "intermediate_states" in kwargs:
                kwargs["intermediate_states"].add_(100.0)
        ref.tokens += [Token(c, s, True) for c, s in zip(cols, states, strict=True)]
        self.mark()

    @precondition(lambda self: not self.layer.record_past and self.ref.tokens and self.kind == "conv+rec")
    @rule()
    def fast_path(self) -> None:
        """transformers' single-token decode without recording: both states updated in place, no call."""
        window, live = self.layer.get_conv_state(), self.layer.get_recurrent_state()
        assume(window is not None and live is not None)
        x = self.rand(self.batch, CHANNELS)
        window.copy_(torch.cat([window[..., 1:], x[..., None]], -1))
        live.mul_(0.9).add_(self.rand(self.batch, *STATE))
        self.ref.tokens.append(Token(x, live.clone(), reported=False))
        self.points.clear()

    # ---------------------------------------------------------------------------- rollback
    @rule(data=st.data(), valid=st.booleans())
    def crop(self, data: st.DataObject, valid: bool) -> None:
        total = len(self.ref.tokens)
        possible = [n for n in range(1, total + 1) if self.ref.can_crop(n, self.recording)]
        if valid and possible:
            n = data.draw(st.sampled_from(possible), label="n")
        else:
            n = min(data.draw(st.integers(0, total + 2), label="n"), total)
        if self.ref.can_crop(n, self.recording):
            self.layer.crop(-n)
            del self.ref.tokens[len(self.ref.tokens) - n :]
            pos = len(self.ref.tokens)
            if n == 0:
                self.ref.commit = pos
                self.points.clear()
                self.mark()
            elif pos in self.points:  # a boundary we passed: the layer is exactly as it was there
                self.assert_same(self.points[pos], self.snapshot())
            self.points = {p: snap for p, snap in self.points.items() if p <= pos}
        else:
            before = self.snapshot()
            try:
                self.layer.crop(-n)
            except RollbackError:
                pass
            else:
                raise AssertionError(f"crop(-{n}) should have failed")
            self.assert_same(before, self.snapshot())

    @rule(on=st.booleans())
    def set_recording(self, on: bool) -> None:
        if on and not self.recording:
            self.ref.commit = len(self.ref.tokens)
            self.layer.activate_past_recording()
            self.points.clear()
            self.mark()
        elif on:
            self.layer.activate_past_recording()  # already recording: nothing changes
        else:
            self.layer.record_past = False
            self.ref.commit = len(self.ref.tokens)
            self.points.clear()

    @rule()
    def reset(self) -> None:
        self.layer.reset()
        self.ref = Reference()
        self.points.clear()
        self.mark()

    def index_points(self, idx: torch.Tensor) -> None:
        """Apply a batch index to the reference and to the snapshots taken at past positions."""
        self.ref.index(idx)
        for pos, (meta, tensors, *rest) in self.points.items():
            self.points[pos] = (meta, {k: v[idx] for k, v in tensors.items()}, *rest)

    def mark(self) -> None:
        if self.recording:
            self.points[len(self.ref.tokens)] = self.snapshot()

    # ------------------------------------------------------------------------------- batch
    @rule(data=st.data(), op=st.sampled_from(["reorder", "select", "repeat"]))
    def batch_op(self, data: st.DataObject, op: str) -> None:
        if op == "select" and self.batch > 1:
            keep = sorted(data.draw(st.sets(st.integers(0, self.batch - 1), min_size=1)))
            idx = torch.tensor(keep)
            self.layer.batch_select_indices(idx)
            self.index_points(idx)
            self.batch = len(keep)
        elif op == "repeat" and self.batch <= 2:
            self.layer.batch_repeat_interleave(2)
            self.index_points(torch.arange(self.batch).repeat_interleave(2))
            self.batch *= 2
        else:
            perm = torch.tensor(data.draw(st.permutations(range(self.batch))))
            self.layer.reorder_cache(perm)
            self.index_points(perm)

    @rule()
    def bad_inputs_change_nothing(self) -> None:
        before = self.snapshot()
        bad_calls = [
            lambda: self.layer.update_conv_state(torch.zeros(self.batch, CHANNELS)),
            lambda: self.layer.update_recurrent_state(torch.zeros(self.batch, *STATE), num_tokens=True),
            lambda: self.layer.update_recurrent_state(
                torch.zeros(self.batch, *STATE), intermediate_states=torch.zeros(self.batch, 2, 9)
            ),
            lambda: self.layer.update_recurrent_state(torch.zeros(self.batch, *STATE), num_tokens=0),
            lambda: self.layer.update_recurrent_state(torch.zeros(self.batch, *STATE), state_idx=1),
            lambda: self.layer.crop(1),
        ]
        if self.ref.tokens:  # the batch size is known
            bad_calls.append(lambda: self.layer.update_conv_state(torch.zeros(self.batch + 1, CHANNELS, 1)))
            bad_calls.append(lambda: self.layer.update_recurrent_state(torch.zeros(self.batch + 1, *STATE)))
            bad_calls.append(lambda: self.layer.reorder_cache(torch.tensor([self.batch])))
        if self.ref.cols():
            bad_calls.append(lambda: self.layer.update_conv_state(torch.zeros(self.batch, CHANNELS + 1, 1)))
            bad_calls.append(lambda: self.layer.update_conv_state(torch.zeros(self.batch, CHANNELS, 1), 0, KERNEL + 1))
        for call in bad_calls:
            try:
                call()
            except (CacheInputError, RollbackError):
                pass
            else:
                raise AssertionError("bad input accepted")
            self.assert_same(before, self.snapshot())

    # -------------------------------------------------------------------------- copies
    @rule(how=st.sampled_from(["copy", "reload"]))
    def fork(self, how: str) -> None:
        if how == "copy":
            self.copy_is_independent()
        else:
            self.persistence_round_trip()

    def copy_is_independent(self) -> None:
        clone = self.layer.copy()
        before = self.snapshot(clone)
        for t in self.layer.state.values():
            t.add_(1.0)  # mutate the original in place
        self.assert_same(before, self.snapshot(clone))
        self.layer = clone

    def persistence_round_trip(self) -> None:
        meta = json.loads(json.dumps(self.layer.meta_state))
        rebuilt = RecurrentLayer.from_state(meta, {k: v.clone() for k, v in self.layer.state.items()})
        self.assert_same(self.snapshot(), self.snapshot(rebuilt))
        self.layer = rebuilt

    # ------------------------------------------------------------------------- checks
    def snapshot(self, layer: RecurrentLayer | None = None) -> tuple:
        layer = layer or self.layer
        return (
            json.dumps(layer.meta_state, sort_keys=True),
            {k: v.clone() for k, v in layer.state.items()},
            layer.max_rollback,
            layer.is_croppable,
        )

    @staticmethod
    def assert_same(a: tuple, b: tuple) -> None:
        assert a[0] == b[0] and a[2:] == b[2:]
        assert a[1].keys() == b[1].keys()
        for k in a[1]:
            assert torch.equal(a[1][k], b[1][k]), k

    @invariant()
    def matches_reference(self) -> None:
        if not hasattr(self, "ref"):
            return
        layer, ref = self.layer, self.ref
        window = ref.window(self.batch)
        got = layer.get_conv_state()
        assert (got is None) == (window is None)
        if window is not None:
            assert torch.equal(got, window)
        state = ref.state()
        got_state = layer.get_recurrent_state()
        assert (got_state is None) == (state is None)
        if state is not None:
            assert torch.equal(got_state, state)
        assert layer.get_seq_length() == sum(t.reported for t in ref.tokens)
        assert layer.has_previous_state() == bool(ref.tokens)
        recorded = len(ref.tokens) - ref.commit if self.recording else 0
        assert layer.max_rollback == recorded
        assert layer.is_croppable == self.recording
        if ref.tokens:
            assert layer.batch_size == self.batch
        # memory: no copies while not recording; conv inputs since the commit point and 1 + r states
        held = layer.state
        n_states = sum(v.shape[1] if k.startswith("intermediate") else 1 for k, v in held.items() if "conv" not in k)
        assert n_states <= 1 + recorded
        if "conv.0" in held:
            assert held["conv.0"].shape[-1] == KERNEL + recorded
        if not self.recording:
            assert set(held) <= {"conv.0", "recurrent.0"}


class ConvOnlyMachine(RecurrentMachine):
    KIND = "conv"


class RecurrentOnlyMachine(RecurrentMachine):
    KIND = "rec"


TestConvAndRecurrent = RecurrentMachine.TestCase
TestConvOnly = ConvOnlyMachine.TestCase
TestRecurrentOnly = RecurrentOnlyMachine.TestCase
