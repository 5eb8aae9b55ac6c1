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
        rec_like = next((r for r, _ in states.values() if r is not None), None)
        conv_like = next((c for _, c in states.values() if c is not None), None)
        rec = None if rec_like is None else torch.zeros_like(rec_like)
        conv = None if conv_like is None else torch.zeros_like(conv_like, memory_format=torch.contiguous_format)
        for n, (rec_n, conv_n) in states.items():
            rows = torch.tensor([b for b, c in enumerate(counts) if c == n])
            if rec is not None and rec_n is not None:
                rec[rows.to(rec.device)] = rec_n[rows.to(rec.device)]
            if conv is not None and conv_n is not None:
                conv[rows.to(conv.device)] = conv_n[rows.to(conv.device)]
        slot.release(slot.steps)
        slot.steps.clear()
        slot.rec, slot.conv = rec, conv
        slot.conv_end = 0 if conv is None else conv.shape[-1]
        slot.conv_from_empty = conv is None
        slot.open_tokens = slot.open_at_commit = None
        slot.seen -= drop
    return None if len(set(kept)) == 1 else [max(kept) - n for n in kept]
