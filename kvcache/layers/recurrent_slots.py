"""The per-state-index bookkeeping of a `RecurrentLayer` (`Slot`, its recorded `Step`s) and the
rebuilding of a layer's slots from `meta_state` and `state` (persistence, copies)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..errors import CacheInputError

#: Conv history storage grows in multiples of this many columns.
CONV_BLOCK = 16

#: `Step.before` marker: the state before the step was overwritten in place before we saw it.
LOST = "lost"
#: Snapshot buffers a slot keeps for reuse when a commit or crop drops them: speculative decoding
#: records a few steps, commits, and records again, and reusing the buffers spares the allocator a
#: free and a malloc of a whole state per step (on glibc a free can trim, and stall for milliseconds).
SPARE_SNAPSHOTS = 8


def describe(t: Any) -> str:
    return f"{tuple(t.shape)} {t.dtype} on {t.device}" if isinstance(t, torch.Tensor) else type(t).__name__


def step_tokens(
    recurrent_states: torch.Tensor, intermediate_states: Any, num_tokens: Any, open_tokens: int | None
) -> tuple[int | None, int]:
    """Check an `update_recurrent_state` call's step arguments against each other and against the
    conv update that opened the step (`open_tokens`); return `(k, tokens)`: the number of
    intermediate states given (None: none) and the step's token count (the step rule). A step a
    conv update opened may get fewer states than tokens: the states after its last `k` tokens."""
    k = None
    if intermediate_states is not None:
        inter, like = intermediate_states, recurrent_states
        if (
            not isinstance(inter, torch.Tensor) or inter.dim() != like.dim() + 1 or inter.shape[0] != like.shape[0]
            or inter.shape[2:] != like.shape[1:] or inter.shape[1] < 1 or inter.dtype != like.dtype
            or inter.device != like.device
        ):  # fmt: skip
            raise CacheInputError(
                f"update_recurrent_state: intermediate_states must be [batch, k>=1, ...] like the state "
                f"{describe(like)}, got {describe(inter)}"
            )
        k = inter.shape[1]
    if num_tokens is not None and (isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 1):
        raise CacheInputError(f"num_tokens must be a positive int, got {num_tokens!r}")
    attach = open_tokens is not None
    tokens = open_tokens if attach else (k or num_tokens or 1)
    for given, label in ((k, "intermediate_states.shape[1]"), (num_tokens, "num_tokens")):
        if given is not None and given != tokens and not (attach and given is k and given < tokens):
            source = "the conv update of this step" if attach else "the other argument"
            raise CacheInputError(f"update_recurrent_state: {label} = {given} but {source} gave {tokens} token(s)")
    return k, tokens  # type: ignore[return-value]


@dataclass
class Step:
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
            return self.before is not LOST
        return self.inter is not None or (self.before is None and not self.rec_updated)


class Slot:
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
        "spare",
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
        self.steps: list[Step] = []
        self.spare: list[torch.Tensor] = []  # dropped snapshot buffers, reused by `snapshot`

    def snapshot(self, state: torch.Tensor) -> torch.Tensor:
        """A private copy of `state`, in a reused buffer when one fits."""
        while self.spare:
            buffer = self.spare.pop()
            if buffer.shape == state.shape and buffer.dtype == state.dtype and buffer.device == state.device:
                return buffer.copy_(state)
        return state.clone()

    def release(self, steps: list[Step]) -> None:
        """Keep the snapshot buffers of dropped steps for reuse (up to `SPARE_SNAPSHOTS`)."""
        for step in steps:
            if isinstance(step.before, torch.Tensor) and len(self.spare) < SPARE_SNAPSHOTS:
                self.spare.append(step.before)

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

    def state_at(self, keep: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(recurrent state, conv window) as they were with `keep` recorded tokens (checked with
        `can_keep`), without changing anything; views into the history, None where none existed."""
        i, offset = self.locate(keep)
        removed = self.steps[i:]
        if not removed:
            rec = self.rec
        elif offset == 0:
            rec = removed[0].before if isinstance(removed[0].before, torch.Tensor) else None
        else:
            inter = removed[0].inter
            rec = None if inter is None else inter[:, offset - 1]
        removed_conv = sum(s.conv_tokens for s in removed) - (offset if removed and removed[0].conv_tokens else 0)
        end = self.conv_end - removed_conv
        if self.conv is None or self.kernel is None or (self.conv_from_empty and end == self.kernel):
            return rec, None
        return rec, self.conv[..., end - self.kernel : end]

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
            self.release(removed[1:])
            del self.steps[i:]
        else:
            if first.inter is not None:
                self.rec = first.inter[:, offset - 1].clone()
                first.inter = first.inter[:, : offset - 1] if offset > 1 else None
            else:  # no recurrent state existed through this step
                self.rec = None
            first.tokens, first.conv_tokens = offset, (offset if first.conv_tokens else 0)
            self.release(removed[1:])
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
        self.release(self.steps)
        self.steps.clear()
        self.open_at_commit = self.open_tokens
        if self.conv is not None and self.conv.shape[-1] != self.kernel:
            self.conv = self.conv[..., self.conv_end - self.kernel : self.conv_end].clone()  # type: ignore[operator]
            self.conv_end = self.kernel  # type: ignore[assignment]
        self.conv_from_empty = self.conv is None

    def tensors(self) -> list[torch.Tensor]:
        held = [t for t in (self.conv, self.rec) if t is not None] + self.spare
        for step in self.steps:
            held += [t for t in (step.before, step.inter) if isinstance(t, torch.Tensor)]
        return held


def restore_slots(layer: Any, meta: dict[str, Any], state: dict[str, torch.Tensor]) -> Any:
    """Fill a fresh `RecurrentLayer` of `meta["num_states"]` slots from `meta` and `state`,
    checking every field and tensor against the others (`CacheInputError` naming the first
    disagreement)."""
    def bad(msg: str) -> CacheInputError:
        return CacheInputError(f"RecurrentLayer.from_state: {msg}")

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
            before: torch.Tensor | str | None = {"lost": LOST, "none": None}.get(kind)
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
            slot.steps.append(Step(tokens, conv_tokens, before, inter, st["rec_updated"], st["open"]))
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


def slot_tensors(slots: list[Slot]) -> dict[str, torch.Tensor]:
    """The tensors a layer's slots save: conv windows, recurrent states and what each recorded
    step keeps for rollback (`restore_slots` takes them back)."""
    out: dict[str, torch.Tensor] = {}
    for s, slot in enumerate(slots):
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


def slot_meta(held: list[Slot]) -> list[dict[str, Any]]:
    """What a layer's slots save besides tensors: kernel, lengths and each recorded step's counts."""
    slots = []
    for slot in held:
        steps = [
            {
                "tokens": st.tokens,
                "conv_tokens": st.conv_tokens,
                "before": "lost" if st.before is LOST else ("none" if st.before is None else "tensor"),
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
    return slots
