"""Conv and recurrent states in storage of fixed shape and address, with exact rollback, for `torch.compile`.

`RecurrentLayer` keeps rollback history in lists that grow per step: right for eager decoding,
but every step changes shapes and Python state, so a compiled decode loop recompiles. A
`StaticRecurrentLayer` allocates everything once, per state index:

* conv: the last `kernel + rollback_tokens` conv inputs, right-aligned, shifted in place;
* recurrent: the live state, plus a ring of `rollback_tokens` snapshots indexed by token count
  (the state after `c` tokens lives in slot `c % rollback_tokens`) and a device-side flag per
  slot saying whether it is known (a step of `q` tokens without `intermediate_states` leaves the
  `q - 1` counts inside it unknown, as in `RecurrentLayer`).

Calls, returns and the step rule are `RecurrentLayer`'s (its module docstring): a conv update
opens a step and snapshots the state before it; the following recurrent update closes it. A crop
restores in place, so addresses never change. Limits: at most `rollback_tokens` tokens can be
undone, not back into the first step (there was no state before it), and not past a recurrent-only
step of a state index that also has a conv window (nothing records which tokens had conv inputs).
Checking a crop reads one flag from the device.
"""

from __future__ import annotations

from typing import Any

import torch
from typing_extensions import Self

from ..errors import CacheInputError, RollbackError
from .base import CacheLayer, register_layer
from .recurrent_slots import describe, step_tokens
from .static_sliding import DEFAULT_ROLLBACK_TOKENS, positive_int


class StaticSlot:
    """One state index: fixed conv history, live recurrent state, snapshot ring, and counters."""

    __slots__ = ("base", "floor", "hist", "kernel", "known", "open_tokens", "rec", "seen", "snaps", "started")

    def __init__(self) -> None:
        self.kernel: int | None = None
        self.hist: torch.Tensor | None = None  # [batch, channels, kernel + rollback_tokens]
        self.rec: torch.Tensor | None = None
        self.snaps: torch.Tensor | None = None  # [rollback_tokens, *rec.shape]
        self.known: torch.Tensor | None = None  # [rollback_tokens] bool, on the states' device
        self.seen = 0  # tokens seen and not rolled back
        self.floor = 0  # counts below this have left the ring
        self.base = 0  # the commit point: crops never go below it
        self.open_tokens: int | None = None  # tokens of a conv update awaiting its recurrent update
        self.started = False  # a conv or recurrent state exists (transformers' has_previous_state)

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.hist, self.rec, self.snaps, self.known) if t is not None]


@register_layer
class StaticRecurrentLayer(CacheLayer):
    """`RecurrentLayer`'s conv/recurrent states in fixed storage: see the module docstring."""

    has_attention = False
    has_recurrent = True
    is_compileable = True

    def __init__(self, num_states: int = 1, rollback_tokens: int = DEFAULT_ROLLBACK_TOKENS) -> None:
        super().__init__()
        self.num_states = positive_int(num_states, "num_states")
        self.rollback_tokens = positive_int(rollback_tokens, "rollback_tokens")
        self._slots = [StaticSlot() for _ in range(self.num_states)]

    def _slot(self, state_idx: Any) -> StaticSlot:
        if isinstance(state_idx, bool) or not isinstance(state_idx, int) or not 0 <= state_idx < self.num_states:
            raise CacheInputError(f"state_idx must be an int in [0, {self.num_states}), got {state_idx!r}")
        return self._slots[state_idx]

    def _check_like(self, new: torch.Tensor, held: torch.Tensor | None, dims: slice, what: str) -> None:
        batch = self.batch_size
        if batch is not None and new.shape[0] != batch:
            raise CacheInputError(f"{type(self).__name__}.{what}: batch size {new.shape[0]} != {batch} held")
        if held is not None and (
            new.shape[dims] != held.shape[dims] or new.dtype != held.dtype or new.device != held.device
        ):
            raise CacheInputError(f"{type(self).__name__}.{what}: {describe(new)} does not match {describe(held)}")

    # ----------------------------------------------------------------------------- recording
    def _open_step(self, slot: StaticSlot, tokens: int, before_lost: bool) -> None:
        """Snapshot the state before a step of `tokens` tokens (while recording) and count the tokens."""
        if self._recording and slot.rec is not None:
            ring = self.rollback_tokens
            if slot.snaps is None:
                slot.snaps = slot.rec.new_zeros(ring, *slot.rec.shape)
                slot.known = torch.zeros(ring, dtype=torch.bool, device=slot.rec.device)
            assert slot.known is not None
            inside = (torch.arange(tokens, device=slot.known.device) + slot.seen) % ring
            slot.known.index_fill_(0, inside[-ring:], False)  # counts inside the step: unknown until given
            if tokens <= ring and not before_lost:
                slot.snaps[slot.seen % ring].copy_(slot.rec)
                slot.known[slot.seen % ring] = True
        slot.seen += tokens
        slot.floor = torch.sym_max(slot.floor, slot.seen - self.rollback_tokens)

    def _keep_intermediate(self, slot: StaticSlot, inter: torch.Tensor, tokens: int) -> None:
        """Store the states inside the step just counted: `inter[:, i]` is the state after its token
        `tokens - k + i` (`k = inter.shape[1]`, which may be less than `tokens`), the last one excluded."""
        k = inter.shape[1]
        if not self._recording or k < 2 or slot.snaps is None or slot.known is None:
            return
        ring = self.rollback_tokens
        take = min(k - 1, ring)
        counts = torch.arange(take, device=slot.known.device) + (slot.seen - take)
        slot.snaps.index_copy_(0, counts % ring, inter[:, k - 1 - take : k - 1].transpose(0, 1))
        slot.known.index_fill_(0, counts % ring, True)

    # -------------------------------------------------------------------------- conv states
    def update_conv_state(
        self, conv_states: torch.Tensor, state_idx: int = 0, conv_kernel_size: int | None = None, **kwargs: Any
    ) -> torch.Tensor:
        """As `RecurrentLayer.update_conv_state`: returns what the causal conv must read."""
        slot = self._slot(state_idx)
        if not isinstance(conv_states, torch.Tensor) or conv_states.dim() != 3 or conv_states.shape[-1] < 1:
            raise CacheInputError(
                f"update_conv_state expects a [batch, channels, time>=1] tensor, got {describe(conv_states)}"
            )
        self._check_like(conv_states, slot.hist, slice(0, 2), "update_conv_state")
        if slot.kernel is not None and conv_kernel_size is not None and conv_kernel_size != slot.kernel:
            raise CacheInputError(f"update_conv_state: conv_kernel_size {conv_kernel_size!r} != {slot.kernel} held")
        n = conv_states.shape[-1]
        if slot.kernel is None:
            slot.kernel = n if conv_kernel_size is None else positive_int(conv_kernel_size, "conv_kernel_size")
            width = slot.kernel + self.rollback_tokens
            slot.hist = conv_states.new_zeros(*conv_states.shape[:2], width)
        assert slot.hist is not None
        kernel, width = slot.kernel, slot.hist.shape[-1]
        if slot.started:
            returned = torch.cat([slot.hist[..., width - kernel :], conv_states], dim=-1)
        else:  # the first update: the inputs, left-padded to the kernel (what RecurrentLayer returns)
            returned = (
                conv_states.contiguous() if n >= kernel else torch.nn.functional.pad(conv_states, (kernel - n, 0))
            )
        if n >= width:
            slot.hist.copy_(conv_states[..., n - width :])
        else:
            slot.hist.copy_(torch.cat([slot.hist[..., n:], conv_states], dim=-1))
        self._open_step(slot, n, before_lost=False)
        slot.open_tokens, slot.started = n, True
        return returned

    def get_conv_state(self, state_idx: int = 0) -> torch.Tensor | None:
        """The held conv window `[batch, channels, kernel]` (a view: in-place updates stick)."""
        slot = self._slot(state_idx)
        if slot.hist is None or not slot.started:
            return None
        return slot.hist[..., slot.hist.shape[-1] - slot.kernel :]  # type: ignore[operator]

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
        """As `RecurrentLayer.update_recurrent_state`: stores the state after a step, in place."""
        slot = self._slot(state_idx)
        if not isinstance(recurrent_states, torch.Tensor) or recurrent_states.dim() < 1:
            raise CacheInputError("update_recurrent_state expects a tensor with a batch dimension first")
        self._check_like(recurrent_states, slot.rec, slice(None), "update_recurrent_state")
        inter = intermediate_states
        _, tokens = step_tokens(recurrent_states, inter, num_tokens, slot.open_tokens)
        attach = slot.open_tokens is not None
        if not attach:  # a step of its own: the held state, unless the model already overwrote it
            lost = slot.rec is not None and (
                recurrent_states is slot.rec
                or (not torch.compiler.is_compiling() and recurrent_states.data_ptr() == slot.rec.data_ptr())
            )
            self._open_step(slot, tokens, before_lost=lost)
            if slot.kernel is not None:  # tokens without conv inputs in a slot that has a conv window:
                slot.floor = slot.seen  # the history cannot say which columns to drop, so none is undone
        if slot.rec is None:
            slot.rec = recurrent_states.clone()
        else:
            slot.rec.copy_(recurrent_states)
        if inter is not None:
            self._keep_intermediate(slot, inter, tokens)
        slot.open_tokens, slot.started = None, True
        return slot.rec

    def increase_count(self, state_idx: int = 0) -> None:
        """As `RecurrentLayer.increase_count`. The in-place write shifted only the window, not the
        columns before it, so no token before this one can be undone any more."""
        if self._recording:
            raise RollbackError(
                "a model updated a conv window in place while the layer records: that token could not be rolled back"
            )
        slot = self._slot(state_idx)
        self._open_step(slot, 1, before_lost=False)
        slot.floor = slot.seen
        slot.open_tokens, slot.started = 1, True

    def open_step_tokens(self, state_idx: int = 0) -> int | None:
        """Tokens of the step a conv update opened and no recurrent update has closed yet (None: no
        open step): the count an `intermediate_states=` for that step must have."""
        return self._slot(state_idx).open_tokens

    def get_recurrent_state(self, state_idx: int = 0) -> torch.Tensor | None:
        slot = self._slot(state_idx)
        return slot.rec if slot.started else None

    def has_previous_state(self, state_idx: int | None = None) -> bool:
        slots = self._slots if state_idx is None else [self._slot(state_idx)]
        return all(slot.started for slot in slots)

    # ------------------------------------------------------------------- attention (absent)
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        raise CacheInputError(
            f"{type(self).__name__} holds no keys/values; use update_conv_state / update_recurrent_state"
        )

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        raise CacheInputError(f"{type(self).__name__} holds no keys/values, so it has no attention mask sizes")

    def get_seq_length(self) -> int:
        return max(slot.seen for slot in self._slots)

    # ------------------------------------------------------------------------------ rollback
    def _active(self) -> list[StaticSlot]:
        return [slot for slot in self._slots if slot.started]

    @property
    def max_rollback(self) -> int:
        if not self._recording:
            return 0
        return min((slot.seen - max(slot.floor, slot.base) for slot in self._active()), default=0)

    @staticmethod
    def _restorable(slot: StaticSlot, count: int, ring: int) -> bool:
        if count == slot.seen or slot.rec is None:  # a conv window alone is restorable at every token
            return True
        return slot.known is not None and bool(slot.known[count % ring])

    @property
    def is_croppable(self) -> bool:
        return self._recording and all(
            slot.base >= slot.floor and self._restorable(slot, slot.base, self.rollback_tokens)
            for slot in self._active()
        )

    def check_crop(self, tokens_to_remove: int) -> None:
        super().check_crop(tokens_to_remove)
        if not isinstance(tokens_to_remove, int):
            return  # per-row counts: `_check_rows` checked them (uniform ones came back here)
        n, ring = -tokens_to_remove, self.rollback_tokens
        for state_idx, slot in enumerate(self._slots):
            if n and slot.started and not self._restorable(slot, slot.seen - n, ring):
                low = max(slot.floor, slot.base)
                bounds = [slot.seen - c for c in range(slot.seen, low - 1, -1) if self._restorable(slot, c, ring)]
                raise RollbackError(
                    f"{type(self).__name__} state {state_idx}: removing {n} token(s) does not land on a known "
                    f"state; removable token counts now: {bounds}"
                )

    def _rollback_hint(self) -> str:
        if not self._recording:
            return "not recording: call activate_past_recording"
        return f"the ring keeps {self.rollback_tokens} state(s), none before the commit point or the first step"

    def _remove_last(self, n: int) -> None:
        for slot in self._active():
            slot.seen -= n
            if slot.rec is not None and slot.snaps is not None:
                slot.rec.copy_(slot.snaps[slot.seen % self.rollback_tokens])
            if slot.hist is not None:
                slot.hist.copy_(torch.nn.functional.pad(slot.hist[..., : slot.hist.shape[-1] - n], (n, 0)))
            slot.open_tokens = None

    def _commit(self) -> None:
        for slot in self._slots:
            slot.base = slot.seen

    # ------------------------------------------------------------------------- batch / misc
    def reset(self) -> None:
        for slot in self._slots:  # storage and addresses kept
            for t in slot.tensors():
                t.zero_()
            slot.seen = slot.floor = slot.base = 0
            slot.open_tokens, slot.started = None, False

    @property
    def batch_size(self) -> int | None:
        held = next((t for slot in self._slots for t in (slot.hist, slot.rec) if t is not None), None)
        return None if held is None else held.shape[0]

    def _index_batch(self, index: torch.Tensor) -> None:
        for slot in self._slots:
            if slot.hist is not None:
                slot.hist = slot.hist.index_select(0, index.to(slot.hist.device))
            if slot.rec is not None:
                slot.rec = slot.rec.index_select(0, index.to(slot.rec.device))
            if slot.snaps is not None:
                slot.snaps = slot.snaps.index_select(1, index.to(slot.snaps.device))

    def nbytes(self) -> int:
        return sum(t.nbytes for slot in self._slots for t in slot.tensors())

    # --------------------------------------------------------------------------- persistence
    _TENSORS = (("conv", "hist"), ("recurrent", "rec"), ("snapshots", "snaps"), ("known", "known"))

    @property
    def state(self) -> dict[str, torch.Tensor]:
        out = {}
        for s, slot in enumerate(self._slots):
            for name, attr in self._TENSORS:
                t = getattr(slot, attr)
                if t is not None:
                    out[f"{name}.{s}"] = t
        return out

    @property
    def meta_state(self) -> dict[str, Any]:
        slots = [
            {
                "kernel": sl.kernel,
                "seen": int(sl.seen),
                "floor": int(sl.floor),
                "base": int(sl.base),
                "open_tokens": sl.open_tokens,
                "started": sl.started,
            }
            for sl in self._slots
        ]
        return {
            "num_states": self.num_states,
            "rollback_tokens": self.rollback_tokens,
            "record_past": self._recording,
            "slots": slots,
        }

    @classmethod
    def from_state(cls, meta_state: dict[str, Any], state: dict[str, torch.Tensor]) -> Self:
        name = cls.__name__
        try:
            layer = cls(meta_state["num_states"], meta_state["rollback_tokens"])
            recording, slots_meta = meta_state["record_past"], meta_state["slots"]
            if (
                not isinstance(recording, bool)
                or not isinstance(slots_meta, list)
                or len(slots_meta) != layer.num_states
            ):
                raise CacheInputError(f"{name}: record_past must be a bool and 'slots' a list of num_states entries")
            used: set[str] = set()
            for s, (slot, sm) in enumerate(zip(layer._slots, slots_meta, strict=True)):
                _restore_slot(slot, sm, state, s, layer.rollback_tokens, used, name)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise CacheInputError(f"{name}: malformed meta_state or state ({exc!r})") from exc
        if set(state) - used:
            raise CacheInputError(f"{name}: unexpected tensors {sorted(set(state) - used)}")
        batches = {t.shape[0] for slot in layer._slots for t in (slot.hist, slot.rec) if t is not None}
        if len(batches) > 1:
            raise CacheInputError(f"{name}: state tensors disagree on batch size: {sorted(batches)}")
        layer._recording = recording
        return layer


def _restore_slot(slot: StaticSlot, sm: dict[str, Any], state: dict[str, torch.Tensor], s: int, ring: int,
                  used: set[str], name: str) -> None:  # fmt: skip
    """Fill `slot` from its meta entry and tensors (copies), checking them against each other."""

    def count(key: str, allow_none: bool = False) -> Any:
        value = sm[key]
        if allow_none and value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise CacheInputError(f"{name}: slots[{s}].{key} must be a non-negative int, got {value!r}")
        return value

    slot.kernel, slot.open_tokens = count("kernel", True), count("open_tokens", True)
    slot.seen, slot.floor, slot.base = count("seen"), count("floor"), count("base")
    slot.started = sm["started"]
    if not isinstance(slot.started, bool) or slot.base > slot.seen or slot.floor > slot.seen:
        raise CacheInputError(f"{name}: slots[{s}] counts are inconsistent (seen {slot.seen}, base {slot.base})")
    for key, attr in StaticRecurrentLayer._TENSORS:
        t = state.get(f"{key}.{s}")
        if t is not None:
            used.add(f"{key}.{s}")
            setattr(slot, attr, t.clone())
    hist, rec, snaps, known = slot.hist, slot.rec, slot.snaps, slot.known
    if (hist is None) != (slot.kernel is None) or (
        hist is not None and (hist.dim() != 3 or hist.shape[-1] != slot.kernel + ring)  # type: ignore[operator]
    ):
        raise CacheInputError(f"{name}: conv.{s} does not match kernel {slot.kernel} and rollback_tokens {ring}")
    if (snaps is None) != (known is None) or (snaps is not None and rec is None):
        raise CacheInputError(f"{name}: snapshots.{s} and known.{s} come together, with recurrent.{s}")
    if snaps is not None and (
        snaps.shape != (ring, *rec.shape) or snaps.dtype != rec.dtype  # type: ignore[union-attr]
        or known.shape != (ring,) or known.dtype != torch.bool  # type: ignore[union-attr]
    ):  # fmt: skip
        raise CacheInputError(
            f"{name}: snapshots.{s} / known.{s} do not match recurrent.{s} and rollback_tokens {ring}"
        )
    if slot.started != (hist is not None or rec is not None):
        raise CacheInputError(f"{name}: slots[{s}].started disagrees with the tensors held")
