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

Step rule (docs/contract.md states it in full): a step opens with `update_conv_state` and closes
with the next `update_recurrent_state`; an `update_recurrent_state` alone is a step of its own.
The "before" snapshot is taken when the step opens, so a model that mutates the live state in
place after `update_conv_state` is still rolled back exactly; a model that mutates the held state
in place without a conv update destroys it, and a crop onto that boundary raises `RollbackError`.

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

from typing import Any

import torch
from typing_extensions import Self

from ..errors import CacheInputError, RollbackError
from ..validation import check_positive_int, check_row_lengths
from .base import CacheLayer, register_layer
from .recurrent_rows import crop_rows
from .recurrent_slots import CONV_BLOCK, LOST, Slot, Step, restore_slots, slot_meta, slot_tensors, step_tokens


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
    crops_rows = True

    def __init__(self, num_states: int = 1) -> None:
        super().__init__()
        self.num_states = check_positive_int(num_states, "num_states")
        self._slots = [Slot() for _ in range(self.num_states)]
        self._behind: list[int] | None = None  # after a per-row crop: tokens each row is behind the count

    # ------------------------------------------------------------------------------ checks
    def _slot(self, state_idx: Any) -> Slot:
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
            kernel = n if conv_kernel_size is None else check_positive_int(conv_kernel_size, "conv_kernel_size")
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
            before = None if slot.rec is None else slot.snapshot(slot.rec)
            slot.steps.append(Step(tokens=n, conv_tokens=n, before=before))
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

    def _append_conv(self, slot: Slot, inputs: torch.Tensor, kernel: int) -> torch.Tensor:
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
        k, tokens = step_tokens(recurrent_states, intermediate_states, num_tokens, slot.open_tokens)
        attach = slot.open_tokens is not None

        if self._recording:
            partial = k is not None and k < tokens  # states after the step's last k tokens only
            inter_copy = None if k is None or k == 1 or partial else intermediate_states[:, : k - 1].clone()  # type: ignore[index]
            step = slot.steps[-1] if attach and slot.steps and slot.steps[-1].open else None
            if step is None:
                if slot.steps:
                    slot.steps[-1].open = False
                if held is None:
                    before: torch.Tensor | str | None = None
                elif _same_storage(recurrent_states, held):
                    before = LOST  # mutated in place before we could snapshot it
                else:
                    before = slot.snapshot(held)
                step = Step(tokens=tokens, conv_tokens=0, before=before)  # type: ignore[arg-type]
                slot.steps.append(step)
            step.inter, step.rec_updated, step.open = inter_copy, True, False
            if partial and k > 1:  # type: ignore[operator]
                self._split_step(slot, step, intermediate_states[:, : k - 1])  # type: ignore[index]
        if held is None:
            slot.rec = recurrent_states.clone()
        else:
            held.copy_(recurrent_states)
        if not attach:
            slot.seen += tokens  # type: ignore[operator]
        slot.open_tokens = None
        return slot.rec  # type: ignore[return-value]

    @staticmethod
    def _split_step(slot: Slot, step: Step, known: torch.Tensor) -> None:
        """Record a step whose states are known only after its last `known.shape[1] + 1` tokens as two
        steps: its first tokens up to the first known state (restorable only at its start), then the
        rest, which starts on that state and knows every state inside it."""
        tail = known.shape[1]  # tokens after the first known state
        head = step.tokens - tail
        step.tokens, step.conv_tokens = head, head if step.conv_tokens else 0
        inter = known[:, 1:].clone() if tail > 1 else None
        rest = Step(tokens=tail, conv_tokens=tail if step.conv_tokens else 0, before=slot.snapshot(known[:, 0]))
        rest.inter, rest.rec_updated, rest.open = inter, True, False
        slot.steps.append(rest)

    def increase_count(self, state_idx: int = 0) -> None:
        """Count one token whose conv input the model wrote into the held window in place (transformers
        >= 5.25 reports its single-token fast path so). The recurrent update that may follow belongs
        to that token's step. Models take that path only while not recording (they ask
        `is_recording_past`); while recording the window's history would be lost, so it is refused."""
        if self._recording:
            raise RollbackError(
                "a model updated a conv window in place while the layer records: that token could not be rolled back"
            )
        slot = self._slot(state_idx)
        slot.seen += 1
        slot.open_tokens = 1

    def open_step_tokens(self, state_idx: int = 0) -> int | None:
        """Tokens of the step a conv update opened and no recurrent update has closed yet (None: no
        open step): the count an `intermediate_states=` for that step must have."""
        return self._slot(state_idx).open_tokens

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
        return self._recording and not any(step.before is LOST for slot in self._slots for step in slot.steps)

    def check_crop(self, tokens_to_remove: int) -> None:
        super().check_crop(tokens_to_remove)
        if not isinstance(tokens_to_remove, int):
            return  # per-row counts: `_check_rows` checked each (and came back here for uniform ones)
        n = -tokens_to_remove
        for state_idx, slot in enumerate(self._slots):
            if n and slot.active and not slot.can_keep(slot.recorded - n):
                bounds = self._boundaries(slot)
                raise RollbackError(
                    f"RecurrentLayer state {state_idx}: removing {n} token(s) does not land on a restorable step "
                    f"boundary; removable token counts now: {bounds}"
                )

    @staticmethod
    def _boundaries(slot: Slot) -> list[int]:
        total = slot.recorded
        return [n for n in range(total + 1) if slot.can_keep(total - n)]

    def _rollback_hint(self) -> str:
        return "recording, at step granularity" if self._recording else "not recording: call activate_past_recording"

    def _remove_last(self, n: int) -> None:
        for slot in self._slots:
            if slot.active:
                slot.keep(slot.recorded - n)

    # ------------------------------------------------------------------------ per-row rollback
    def row_lengths(self) -> list[int]:
        seen = self.get_seq_length()
        return [seen - b for b in self._behind] if self._behind is not None else super().row_lengths()

    @property
    def is_ragged(self) -> bool:
        return self._behind is not None

    def _check_rows(self, counts: list[int]) -> None:
        super()._check_rows(counts)
        for n in sorted(set(counts)):
            self.check_crop(-n)  # each count lands on a restorable boundary of every state index

    def _remove_rows(self, counts: list[int]) -> None:
        """Each row takes the states it had `counts[b]` tokens ago (`recurrent_rows.crop_rows`)."""
        self._behind = crop_rows(self._slots, self.row_lengths(), counts)

    def _commit(self) -> None:
        for slot in self._slots:
            slot.commit()

    # ------------------------------------------------------------------------- batch / misc
    def reset(self) -> None:
        self._slots = [Slot() for _ in range(self.num_states)]
        self._behind = None

    @property
    def batch_size(self) -> int | None:
        return next((b for b in (slot.batch_size() for slot in self._slots) if b is not None), None)

    def _index_batch(self, index: torch.Tensor) -> None:
        if self._behind is not None:
            behind = [self._behind[i] for i in index.tolist()]
            low = min(behind, default=0)  # the longest kept row sets the count
            for slot in self._slots:
                if slot.active:
                    slot.seen -= low
            self._behind = None if len(set(behind)) <= 1 else [b - low for b in behind]
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
        held = [t.untyped_storage() for slot in self._slots for t in slot.tensors()]
        return sum({storage.data_ptr(): storage.nbytes() for storage in held}.values())

    # --------------------------------------------------------------------------- persistence
    @property
    def state(self) -> dict[str, torch.Tensor]:
        return slot_tensors(self._slots)

    @property
    def meta_state(self) -> dict[str, Any]:
        meta = {"num_states": self.num_states, "record_past": self._recording, "slots": slot_meta(self._slots)}
        if self._behind is not None:
            meta["row_lengths"] = self.row_lengths()
        return meta

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
            layer = restore_slots(cls(meta_state["num_states"]), meta_state, state)
            seen = layer.get_seq_length()
            lengths = check_row_lengths(meta_state.get("row_lengths"), layer.batch_size, seen, "RecurrentLayer")
            if lengths is not None:
                layer._behind = None if len(set(lengths)) == 1 else [seen - n for n in lengths]
            return layer
        except CacheInputError:
            raise
        except (KeyError, TypeError, ValueError, AttributeError, IndexError) as exc:
            raise CacheInputError(f"RecurrentLayer: malformed meta_state or state ({exc!r})") from exc
