"""Conv and recurrent states (Mamba, Mamba2, gated delta net, short conv) with exact rollback.

A `RecurrentLayer` holds, per state index, a conv window `[batch, channels, kernel]` and/or a
recurrent state (any shape, batch first). Neither has a sequence axis one could cut, so rollback
needs history, kept only while recording (docs/contract.md, "The recurrent step rule"):

* conv: the window at the commit point plus every input since, in one growth buffer; the window
  at any token since the commit point is a slice of it, so conv rollback is token-exact.
* recurrent: one private snapshot per recorded step, the state *before* the step (the state after
  it is the next snapshot or the live state): `1 + r` states for `r` steps. A step that hands
  `intermediate_states=[batch, k, ...]` also keeps the `k - 1` states inside it, so it can be
  rolled back to any of its tokens.

Step rule. A step of a state index opens with `update_conv_state` (its token count is the conv
input's time length) and closes with the following `update_recurrent_state`, if any. An
`update_recurrent_state` without an open step is a step of its own, of
`intermediate_states.shape[1]` tokens, else `num_tokens=`, else 1 token. The "before" snapshot is
taken when the step opens, so a model that mutates the live state in place after
`update_conv_state` (transformers' Mamba2 decode path while recording) is still rolled back
exactly. A model that mutates the held state in place and then passes that same tensor to
`update_recurrent_state` without a conv update has destroyed the state before the step: the layer
marks that boundary as lost, `is_croppable` turns False and a crop onto it raises `RollbackError`.

Conv semantics match transformers' `LinearAttentionLayer` (cache_utils.py): the first update
returns its input, left-padded with zeros to the kernel size when shorter; later ones return the
held `kernel`-wide window followed by the new inputs; the held window is the last `kernel` inputs.
Return values do not depend on recording. While not recording, `get_conv_state` returns the held
window tensor itself, so a model that updates it in place (transformers' single-token fast path)
updates the cache; while recording, models must go through `update_conv_state` (transformers
models do: they check `is_recording_past`).

Token count: `get_seq_length` counts the tokens reported through updates (conv inputs, or the
recurrent rule above). Model code that takes the in-place fast path while not recording reports
nothing, so the count is a lower bound there; rollback only ever needs the recorded counts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from typing_extensions import Self

from ..errors import CacheInputError, RollbackError
from .base import CacheLayer, register_layer

#: Conv history storage grows in multiples of this many columns.
CONV_BLOCK = 16

#: `_Step.before` marker: the state before the step was overwritten in place before we saw it.
_LOST = "lost"


@dataclass
class _Step:
    """One recorded step of one state index."""

    tokens: int
    conv_tokens: int  # conv inputs this step added (0 or `tokens`)
    before: torch.Tensor | str | None  # private copy of the recurrent state before the step; None: none existed
    inter: torch.Tensor | None = None  # [batch, tokens - 1, ...]: states after each token but the last
    rec_updated: bool = False  # update_recurrent_state was called in this step
    open: bool = True  # opened by a conv update; the step's recurrent update may still come

    def restorable_at(self, offset: int) -> bool:
        """Whether the state `offset` tokens into this step (0 <= offset < tokens) is known."""
        if offset == 0:
            return self.before is not _LOST
        return self.inter is not None or (self.before is None and not self.rec_updated)


class _Slot:
    """One state index: its conv window (with recorded inputs) and recurrent state (with snapshots)."""

    __slots__ = (
        "conv",
        "conv_end",
        "conv_from_empty",
        "kernel",
        "open_at_commit",
        "open_tokens",
        "rec",
        "seen",
        "steps",
    )

    def __init__(self) -> None:
        self.kernel: int | None = None
        self.conv: torch.Tensor | None = None  # storage [batch, channels, capacity]
        self.conv_end = 0  # columns in use: the window at the commit point, then recorded inputs
        self.conv_from_empty = True  # no conv state at the commit point
        self.rec: torch.Tensor | None = None
        self.seen = 0
        self.open_tokens: int | None = None  # tokens of a conv update awaiting its recurrent update
        self.open_at_commit: int | None = None  # `open_tokens` at the commit point
        self.steps: list[_Step] = []

    @property
    def active(self) -> bool:
        return self.conv is not None or self.rec is not None or bool(self.steps)

    @property
    def recorded(self) -> int:
        return sum(step.tokens for step in self.steps)

    def window(self) -> torch.Tensor | None:
        if self.conv is None:
            return None
        if self.conv.shape[-1] == self.conv_end == self.kernel:
            return self.conv  # the held tensor itself: in-place updates by model code stick
        return self.conv[..., self.conv_end - self.kernel : self.conv_end]  # type: ignore[operator]

    def batch_size(self) -> int | None:
        held = self.conv if self.conv is not None else self.rec
        return None if held is None else held.shape[0]

    def locate(self, keep: int) -> tuple[int, int]:
        """(step index, tokens kept of that step) for keeping `keep` recorded tokens."""
        start = 0
        for i, step in enumerate(self.steps):
            if keep < start + step.tokens:
                return i, keep - start
            start += step.tokens
        return len(self.steps), 0

    def can_keep(self, keep: int) -> bool:
        i, offset = self.locate(keep)
        return i == len(self.steps) or self.steps[i].restorable_at(offset)

    def keep(self, keep: int) -> None:
        """Roll back to `keep` recorded tokens (checked with `can_keep`)."""
        i, offset = self.locate(keep)
        removed = self.steps[i:]
        if not removed:
            return
        removed_tokens = sum(s.tokens for s in removed) - offset
        removed_conv = sum(s.conv_tokens for s in removed) - (offset if removed[0].conv_tokens else 0)
        first = removed[0]
        if offset == 0:
            self.rec = first.before  # type: ignore[assignment]  # private copy, moved back
            del self.steps[i:]
        else:
            if first.inter is not None:
                self.rec = first.inter[:, offset - 1].clone()
                first.inter = first.inter[:, : offset - 1] if offset > 1 else None
            else:  # no recurrent state existed through this step
                self.rec = None
            first.tokens, first.conv_tokens = offset, (offset if first.conv_tokens else 0)
            del self.steps[i + 1 :]
        # bookkeeping as it was at that boundary: a conv-opened step without a recurrent update
        # is still open (transformers' Mamba2 decode path); a point inside a step is closed
        last = self.steps[-1] if self.steps else None
        if offset:
            last.open, self.open_tokens = False, None  # type: ignore[union-attr]
        elif last is None:
            self.open_tokens = self.open_at_commit
        else:
            last.open = bool(last.conv_tokens) and not last.rec_updated
            self.open_tokens = last.tokens if last.open else None
        self.seen -= removed_tokens
        self.conv_end -= removed_conv
        if self.conv is not None and self.conv_from_empty and self.conv_end == self.kernel:
            self.conv, self.conv_end, self.kernel = None, 0, None  # back before the first conv input

    def commit(self) -> None:
        self.steps.clear()
        self.open_at_commit = self.open_tokens
        if self.conv is not None and self.conv.shape[-1] != self.kernel:
            self.conv = self.conv[..., self.conv_end - self.kernel : self.conv_end].clone()  # type: ignore[operator]
            self.conv_end = self.kernel  # type: ignore[assignment]
        self.conv_from_empty = self.conv is None

    def tensors(self) -> list[torch.Tensor]:
        held = [t for t in (self.conv, self.rec) if t is not None]
        for step in self.steps:
            held += [t for t in (step.before, step.inter) if isinstance(t, torch.Tensor)]
        return held


def _positive_int(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise CacheInputError(f"{name} must be a positive int, got {value!r}")
    return value


def _describe(t: torch.Tensor) -> str:
    return f"{tuple(t.shape)} {t.dtype} on {t.device}"


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


@register_layer
class RecurrentLayer(CacheLayer):
    """Conv and recurrent states of one model layer, `num_states` of each, with exact rollback.

    See the module docstring for the step and token-count rules. Memory: while not recording,
    one conv window and one recurrent state per state index, no copies; while recording `r` steps,
    the conv inputs since the commit point and `1 + r` recurrent states (plus `k - 1` per step that
    handed `k` intermediate states).
    """

    has_attention = False
    has_recurrent = True

    def __init__(self, num_states: int = 1) -> None:
        super().__init__()
        self.num_states = _positive_int(num_states, "num_states")
        self._slots = [_Slot() for _ in range(self.num_states)]

    # ------------------------------------------------------------------------------ checks
    def _slot(self, state_idx: Any) -> _Slot:
        if isinstance(state_idx, bool) or not isinstance(state_idx, int) or not 0 <= state_idx < self.num_states:
            raise CacheInputError(
                f"state_idx must be an int in [0, {self.num_states}) for this RecurrentLayer, got {state_idx!r}"
            )
        return self._slots[state_idx]

    def _check_batch(self, batch: int, what: str) -> None:
        held = self.batch_size
        if held is not None and batch != held:
            raise CacheInputError(f"RecurrentLayer.{what}: batch size {batch} != {held} held by the layer")

    # -------------------------------------------------------------------------- conv states
    def update_conv_state(
        self, conv_states: torch.Tensor, state_idx: int = 0, conv_kernel_size: int | None = None, **kwargs: Any
    ) -> torch.Tensor:
        """Feed new conv inputs `[batch, channels, n]`; return what the causal conv must read.

        First call: the inputs, left-padded with zeros to the kernel size (`conv_kernel_size`, else
        `n`) when shorter. Later calls: the held `kernel`-wide window followed by the inputs.
        """
        slot = self._slot(state_idx)
        if not isinstance(conv_states, torch.Tensor) or conv_states.dim() != 3 or conv_states.shape[-1] < 1:
            got = _describe(conv_states) if isinstance(conv_states, torch.Tensor) else type(conv_states).__name__
            raise CacheInputError(f"update_conv_state expects a [batch, channels, time>=1] tensor, got {got}")
        n = conv_states.shape[-1]
        if slot.conv is None:
            kernel = n if conv_kernel_size is None else _positive_int(conv_kernel_size, "conv_kernel_size")
            self._check_batch(conv_states.shape[0], "update_conv_state")
        else:
            kernel = slot.kernel  # type: ignore[assignment]
            if conv_kernel_size is not None and conv_kernel_size != kernel:
                raise CacheInputError(f"update_conv_state: conv_kernel_size {conv_kernel_size!r} != {kernel} held")
            held = slot.conv
            if (
                conv_states.shape[:2] != held.shape[:2]
                or conv_states.dtype != held.dtype
                or conv_states.device != held.device
            ):
                raise CacheInputError(
                    f"update_conv_state: new inputs {_describe(conv_states)} do not match the held conv state "
                    f"{_describe(held)} (batch, channels, dtype and device must agree)"
                )
        if slot.rec is not None and slot.rec.device != conv_states.device:
            raise CacheInputError(
                f"update_conv_state: inputs on {conv_states.device}, recurrent state on {slot.rec.device}"
            )

        if self._recording:
            if slot.steps:
                slot.steps[-1].open = False
            before = None if slot.rec is None else slot.rec.clone()
            slot.steps.append(_Step(tokens=n, conv_tokens=n, before=before))
            returned = self._append_conv(slot, conv_states, kernel)
        elif slot.conv is None:
            returned = conv_states.contiguous()  # the same layout the recording path returns
            if n < kernel:
                returned = torch.nn.functional.pad(conv_states, (kernel - n, 0))
            slot.conv, slot.kernel, slot.conv_end = returned[..., -kernel:].clone(), kernel, kernel
        else:
            returned = torch.cat([slot.conv, conv_states], dim=-1)
            slot.conv.copy_(returned[..., -kernel:])
        slot.open_tokens = n
        slot.seen += n
        return returned

    def _append_conv(self, slot: _Slot, inputs: torch.Tensor, kernel: int) -> torch.Tensor:
        """Append recorded conv inputs to the history buffer; return the conv's view of them."""
        n = inputs.shape[-1]
        first = slot.conv is None
        if first:
            slot.kernel, slot.conv_end = kernel, kernel
        need = slot.conv_end + n
        if first or slot.conv.shape[-1] < need:  # type: ignore[union-attr]
            capacity = max(need, 2 * (0 if first else slot.conv.shape[-1]))  # type: ignore[union-attr]
            capacity = -(-capacity // CONV_BLOCK) * CONV_BLOCK
            storage = inputs.new_zeros((*inputs.shape[:2], capacity))
            if not first:
                storage[..., : slot.conv_end] = slot.conv[..., : slot.conv_end]  # type: ignore[index]
            slot.conv = storage
        slot.conv[..., slot.conv_end : need] = inputs  # type: ignore[index]
        slot.conv_end = need
        width = max(kernel, n) if first else kernel + n
        # a fresh contiguous tensor, as the not-recording path returns: the conv must not see the
        # history buffer's capacity in its strides (it would change the kernel path, and the bits)
        return slot.conv[..., need - width : need].clone(memory_format=torch.contiguous_format)  # type: ignore[index]

    def get_conv_state(self, state_idx: int = 0) -> torch.Tensor | None:
        """The held conv window `[batch, channels, kernel]`, None before the first conv update."""
        return self._slot(state_idx).window()

    # --------------------------------------------------------------------- recurrent states
    def update_recurrent_state(
        self,
        recurrent_states: torch.Tensor,
        state_idx: int = 0,
        *,
        intermediate_states: torch.Tensor | None = None,
        num_tokens: int | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        """Store the state after a step; return the held state.

        `intermediate_states[:, i]` is the state after token i of a k-token step (the last one
        equals `recurrent_states`); while recording they let `crop` land inside the step.
        """
        slot = self._slot(state_idx)
        if not isinstance(recurrent_states, torch.Tensor) or recurrent_states.dim() < 1:
            raise CacheInputError("update_recurrent_state expects a tensor with a batch dimension first")
        held = slot.rec
        if held is None:
            self._check_batch(recurrent_states.shape[0], "update_recurrent_state")
            if slot.conv is not None and slot.conv.device != recurrent_states.device:
                raise CacheInputError(
                    f"update_recurrent_state: state on {recurrent_states.device}, conv state on {slot.conv.device}"
                )
        elif (
            recurrent_states.shape != held.shape
            or recurrent_states.dtype != held.dtype
            or recurrent_states.device != held.device
        ):
            raise CacheInputError(
                f"update_recurrent_state: new state {_describe(recurrent_states)} does not match the held "
                f"state {_describe(held)}"
            )
        k = None
        if intermediate_states is not None:
            inter = intermediate_states
            if (
                not isinstance(inter, torch.Tensor)
                or inter.dim() != recurrent_states.dim() + 1
                or inter.shape[0] != recurrent_states.shape[0]
                or inter.shape[2:] != recurrent_states.shape[1:]
                or inter.shape[1] < 1
                or inter.dtype != recurrent_states.dtype
                or inter.device != recurrent_states.device
            ):
                got = _describe(inter) if isinstance(inter, torch.Tensor) else type(inter).__name__
                raise CacheInputError(
                    f"update_recurrent_state: intermediate_states must be [batch, k>=1, ...] like the state "
                    f"{_describe(recurrent_states)}, got {got}"
                )
            k = inter.shape[1]
        if num_tokens is not None:
            _positive_int(num_tokens, "num_tokens")
        attach = slot.open_tokens is not None
        tokens = slot.open_tokens if attach else (k or num_tokens or 1)
        for given, label in ((k, "intermediate_states.shape[1]"), (num_tokens, "num_tokens")):
            if given is not None and given != tokens:
                source = "the conv update of this step" if attach else "the other argument"
                raise CacheInputError(f"update_recurrent_state: {label} = {given} but {source} gave {tokens} token(s)")

        if self._recording:
            inter_copy = None if k is None or k == 1 else intermediate_states[:, : k - 1].clone()  # type: ignore[index]
            step = slot.steps[-1] if attach and slot.steps and slot.steps[-1].open else None
            if step is None:
                if slot.steps:
                    slot.steps[-1].open = False
                if held is None:
                    before: torch.Tensor | str | None = None
                elif _same_storage(recurrent_states, held):
                    before = _LOST  # mutated in place before we could snapshot it
                else:
                    before = held.clone()
                step = _Step(tokens=tokens, conv_tokens=0, before=before)  # type: ignore[arg-type]
                slot.steps.append(step)
            step.inter, step.rec_updated, step.open = inter_copy, True, False
        if held is None:
            slot.rec = recurrent_states.clone()
        else:
            held.copy_(recurrent_states)
        if not attach:
            slot.seen += tokens  # type: ignore[operator]
        slot.open_tokens = None
        return slot.rec  # type: ignore[return-value]

    def get_recurrent_state(self, state_idx: int = 0) -> torch.Tensor | None:
        """The held recurrent state, None before the first recurrent update."""
        return self._slot(state_idx).rec

    def has_previous_state(self, state_idx: int | None = None) -> bool:
        """Whether state `state_idx` (default: every state index) holds a conv or recurrent state."""
        slots = self._slots if state_idx is None else [self._slot(state_idx)]
        return all(slot.conv is not None or slot.rec is not None for slot in slots)

    # ------------------------------------------------------------------- attention (absent)
    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        raise CacheInputError("RecurrentLayer holds no keys/values; use update_conv_state / update_recurrent_state")

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        raise CacheInputError("RecurrentLayer holds no keys/values, so it has no attention mask sizes")

    def get_seq_length(self) -> int:
        return max(slot.seen for slot in self._slots)

    # ------------------------------------------------------------------------------ rollback
    @property
    def max_rollback(self) -> int:
        if not self._recording:
            return 0
        return min((slot.recorded for slot in self._slots if slot.active), default=0)

    @property
    def is_croppable(self) -> bool:
        return self._recording and not any(step.before is _LOST for slot in self._slots for step in slot.steps)

    def check_crop(self, tokens_to_remove: int) -> None:
        super().check_crop(tokens_to_remove)
        n = -tokens_to_remove
        for state_idx, slot in enumerate(self._slots):
            if n and slot.active and not slot.can_keep(slot.recorded - n):
                bounds = self._boundaries(slot)
                raise RollbackError(
                    f"RecurrentLayer state {state_idx}: removing {n} token(s) does not land on a restorable step "
                    f"boundary; removable token counts now: {bounds}"
                )

    @staticmethod
    def _boundaries(slot: _Slot) -> list[int]:
        total = slot.recorded
        return [n for n in range(total + 1) if slot.can_keep(total - n)]

    def _rollback_hint(self) -> str:
        return "recording, at step granularity" if self._recording else "not recording: call activate_past_recording"

    def _remove_last(self, n: int) -> None:
        for slot in self._slots:
            if slot.active:
                slot.keep(slot.recorded - n)

    def _commit(self) -> None:
        for slot in self._slots:
            slot.commit()

    # ------------------------------------------------------------------------- batch / misc
    def reset(self) -> None:
        self._slots = [_Slot() for _ in range(self.num_states)]

    @property
    def batch_size(self) -> int | None:
        return next((b for b in (slot.batch_size() for slot in self._slots) if b is not None), None)

    def _index_batch(self, index: torch.Tensor) -> None:
        for slot in self._slots:
            if slot.conv is not None:
                slot.conv = slot.conv[index.to(slot.conv.device), :, : slot.conv_end]
            if slot.rec is not None:
                slot.rec = slot.rec[index.to(slot.rec.device)]
            for step in slot.steps:
                if isinstance(step.before, torch.Tensor):
                    step.before = step.before[index.to(step.before.device)]
                if step.inter is not None:
                    step.inter = step.inter[index.to(step.inter.device)]

    def nbytes(self) -> int:
        """Bytes of storage held (conv history capacity included)."""
        seen: set[int] = set()
        total = 0
        for slot in self._slots:
            for t in slot.tensors():
                storage = t.untyped_storage()
                if storage.data_ptr() not in seen:
                    seen.add(storage.data_ptr())
                    total += storage.nbytes()
        return total

    # --------------------------------------------------------------------------- persistence
    @property
    def state(self) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for s, slot in enumerate(self._slots):
            if slot.conv is not None:
                out[f"conv.{s}"] = slot.conv[..., : slot.conv_end]
            if slot.rec is not None:
                out[f"recurrent.{s}"] = slot.rec
            for i, step in enumerate(slot.steps):
                if isinstance(step.before, torch.Tensor):
                    out[f"recurrent_history.{s}.{i}"] = step.before
                if step.inter is not None:
                    out[f"intermediate.{s}.{i}"] = step.inter
        return out

    @property
    def meta_state(self) -> dict[str, Any]:
        slots = []
        for slot in self._slots:
            steps = [
                {
                    "tokens": st.tokens,
                    "conv_tokens": st.conv_tokens,
                    "before": "lost" if st.before is _LOST else ("none" if st.before is None else "tensor"),
                    "intermediate": st.inter is not None,
                    "rec_updated": st.rec_updated,
                    "open": st.open,
                }
                for st in slot.steps
            ]
            slots.append(
                {
                    "kernel": slot.kernel,
                    "conv_columns": slot.conv_end if slot.conv is not None else 0,
                    "conv_from_empty": slot.conv_from_empty,
                    "seen": slot.seen,
                    "open_tokens": slot.open_tokens,
                    "open_at_commit": slot.open_at_commit,
                    "steps": steps,
                }
            )
        return {"num_states": self.num_states, "record_past": self._recording, "slots": slots}

    def __repr__(self) -> str:
        held = [
            f"{s}: conv={None if sl.kernel is None else sl.kernel}, recurrent="
            f"{None if sl.rec is None else tuple(sl.rec.shape)}, steps={len(sl.steps)}"
            for s, sl in enumerate(self._slots)
            if sl.active
        ]
        return f"RecurrentLayer(num_states={self.num_states}, record_past={self._recording}, held={held})"

    @classmethod
    def from_state(cls, meta_state: dict[str, Any], state: dict[str, torch.Tensor]) -> Self:
        try:
            return cls._from_state(meta_state, state)
        except CacheInputError:
            raise
        except (KeyError, TypeError, ValueError, AttributeError, IndexError) as exc:
            raise CacheInputError(f"RecurrentLayer: malformed meta_state or state ({exc!r})") from exc

    @classmethod
    def _from_state(cls, meta: dict[str, Any], state: dict[str, torch.Tensor]) -> Self:
        def bad(msg: str) -> CacheInputError:
            return CacheInputError(f"RecurrentLayer.from_state: {msg}")

        layer = cls(meta["num_states"])
        recording = meta["record_past"]
        slots_meta = meta["slots"]
        if not isinstance(recording, bool) or not isinstance(slots_meta, list) or len(slots_meta) != layer.num_states:
            raise bad("record_past must be a bool and 'slots' a list of num_states entries")
        layer._recording = recording
        used: set[str] = set()

        def take(name: str) -> torch.Tensor:
            t = state.get(name)
            if not isinstance(t, torch.Tensor):
                raise bad(f"missing tensor {name!r}")
            used.add(name)
            return t

        def nonneg(value: Any, what: str, allow_none: bool = False) -> Any:
            if allow_none and value is None:
                return None
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise bad(f"{what} must be a non-negative int, got {value!r}")
            return value

        batches: set[int] = set()
        for s, sm in enumerate(slots_meta):
            slot = layer._slots[s]
            slot.kernel = nonneg(sm["kernel"], f"slots[{s}].kernel", allow_none=True)
            columns = nonneg(sm["conv_columns"], f"slots[{s}].conv_columns")
            slot.seen = nonneg(sm["seen"], f"slots[{s}].seen")
            slot.open_tokens = nonneg(sm["open_tokens"], f"slots[{s}].open_tokens", allow_none=True)
            slot.open_at_commit = nonneg(sm["open_at_commit"], f"slots[{s}].open_at_commit", allow_none=True)
            slot.conv_from_empty = sm["conv_from_empty"]
            if not isinstance(slot.conv_from_empty, bool):
                raise bad(f"slots[{s}].conv_from_empty must be a bool")
            if f"conv.{s}" in state:
                conv = take(f"conv.{s}")
                if slot.kernel is None or slot.kernel < 1 or conv.dim() != 3 or conv.shape[-1] != columns:
                    raise bad(f"conv.{s} {tuple(conv.shape)} does not hold {columns} columns of kernel {slot.kernel}")
                if columns < slot.kernel or (not recording and columns != slot.kernel):
                    raise bad(f"conv.{s} holds {columns} columns, inconsistent with kernel {slot.kernel}")
                slot.conv, slot.conv_end = conv, columns
                batches.add(conv.shape[0])
            elif columns or slot.kernel is not None:
                raise bad(f"slots[{s}] announces a conv state but conv.{s} is missing")
            if f"recurrent.{s}" in state:
                slot.rec = take(f"recurrent.{s}")
                if slot.rec.dim() < 1:
                    raise bad(f"recurrent.{s} has no batch dimension")
                batches.add(slot.rec.shape[0])
            for i, st in enumerate(sm["steps"]):
                tokens = nonneg(st["tokens"], f"slots[{s}].steps[{i}].tokens")
                conv_tokens = nonneg(st["conv_tokens"], f"slots[{s}].steps[{i}].conv_tokens")
                if tokens < 1 or conv_tokens not in (0, tokens):
                    raise bad(f"slots[{s}].steps[{i}]: {tokens} token(s) with {conv_tokens} conv input(s)")
                kind = st["before"]
                if kind not in ("lost", "none", "tensor"):
                    raise bad(f"slots[{s}].steps[{i}].before must be 'lost', 'none' or 'tensor'")
                before: torch.Tensor | str | None = {"lost": _LOST, "none": None}.get(kind)
                if kind == "tensor":
                    before = take(f"recurrent_history.{s}.{i}")
                    if slot.rec is None or before.shape != slot.rec.shape or before.dtype != slot.rec.dtype:
                        raise bad(f"recurrent_history.{s}.{i} does not match recurrent.{s}")
                inter = None
                if st["intermediate"] is True:
                    inter = take(f"intermediate.{s}.{i}")
                    expected = None if slot.rec is None else (slot.rec.shape[0], tokens - 1, *slot.rec.shape[1:])
                    if expected is None or tuple(inter.shape) != expected or inter.dtype != slot.rec.dtype:  # type: ignore[union-attr]
                        raise bad(f"intermediate.{s}.{i} {tuple(inter.shape)} should be {expected}")
                if not isinstance(st["rec_updated"], bool) or not isinstance(st["open"], bool):
                    raise bad(f"slots[{s}].steps[{i}]: rec_updated and open must be bools")
                slot.steps.append(_Step(tokens, conv_tokens, before, inter, st["rec_updated"], st["open"]))
            if slot.steps and not recording:
                raise bad(f"slots[{s}] holds recorded steps but the layer is not recording")
            conv_recorded = sum(st.conv_tokens for st in slot.steps)
            if slot.conv is not None and columns - slot.kernel != conv_recorded:  # type: ignore[operator]
                raise bad(f"conv.{s} holds {columns - slot.kernel} recorded input(s), steps say {conv_recorded}")  # type: ignore[operator]
            if slot.conv is None and conv_recorded:
                raise bad(f"slots[{s}] steps record conv inputs but there is no conv state")
            if slot.recorded > slot.seen:
                raise bad(f"slots[{s}] records {slot.recorded} token(s) but has seen only {slot.seen}")
        if len(batches) > 1:
            raise bad(f"state tensors disagree on batch size: {sorted(batches)}")
        unknown = set(state) - used
        if unknown:
            raise bad(f"unexpected tensors {sorted(unknown)}")
        return layer
