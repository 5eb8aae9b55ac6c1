"""Per-row rollback of a `RecurrentLayer`'s slots: each batch row goes back by its own count.

Recurrent states have no sequence axis to cut, so a row's state after a per-row crop is the one
recorded at that row's count: a step boundary's snapshot, or a state inside a step that handed
over intermediate states. The rows' states are gathered into fresh tensors, and the recorded
history is released, since its steps no longer line up across rows: the layer can roll back only
what it records from then on (a commit point per row). A row taken back to before the layer's
first state gets zeros, which is what a model starts from (and what the first conv update pads
with).
"""

from __future__ import annotations

import torch

from .recurrent_slots import Slot


def _gather(per_row: list[torch.Tensor | None], layout: torch.memory_format = torch.preserve_format
            ) -> torch.Tensor | None:  # fmt: skip
    """Row b of `per_row[b]` for every b, in fresh memory laid out as the first given state (zeros
    for a row whose state did not exist yet); None when no row has one."""
    like = next((t for t in per_row if t is not None), None)
    if like is None:
        return None
    zeros = None
    rows = []
    for b, state in enumerate(per_row):
        if state is None:
            zeros = like.new_zeros(like.shape[1:]) if zeros is None else zeros
            rows.append(zeros)
        else:
            rows.append(state[b])
    return torch.empty_like(like, memory_format=layout).copy_(torch.stack(rows))


def crop_rows(slots: list[Slot], lengths: list[int], counts: list[int]) -> list[int] | None:
    """Take row b of every active slot back by `counts[b]` tokens (checked: each count lands on a
    restorable boundary). `lengths` are the rows' token counts before; returns how many tokens
    each row is then behind the longest (None: all rows alike)."""
    distinct = sorted(set(counts))
    kept = [n - c for n, c in zip(lengths, counts, strict=True)]
    drop = max(lengths) - max(kept)  # the longest row's count moves back this far
    for slot in slots:
        if not slot.active:
            continue
        states = {n: slot.state_at(slot.recorded - n) for n in distinct}
        rec = _gather([states[c][0] for c in counts])
        conv = _gather([states[c][1] for c in counts], torch.contiguous_format)
        slot.release(slot.steps)
        slot.steps.clear()
        slot.rec, slot.conv = rec, conv
        slot.conv_end = 0 if conv is None else conv.shape[-1]
        slot.conv_from_empty = conv is None
        slot.open_tokens = slot.open_at_commit = None
        slot.seen -= drop
    return None if len(set(kept)) == 1 else [max(kept) - n for n in kept]
