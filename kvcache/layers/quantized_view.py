"""What each row of a ragged `QuantizedLayer` batch sees: rows share the quantized part (set by
the shortest row), so a longer row's own whole blocks are held in full precision; it must still
see them quantized, as it would alone or in a batch of rows as long as it."""

from __future__ import annotations

from typing import Any

import torch


def rows_ahead(layer: Any) -> dict[int, int]:
    """Rows of `layer` whose own length quantizes more than the shortest row's: row -> the tokens
    it quantizes."""
    shortest = layer._quantized
    targets = {b: layer._target(n) for b, n in enumerate(layer.row_lengths())}
    return {b: q for b, q in targets.items() if q > shortest}


def seen_as_alone(layer: Any, returned: tuple[torch.Tensor, torch.Tensor], start: int, seen: int,
                  ahead: dict[int, int]) -> None:  # fmt: skip
    """Write into `returned` (the keys and values `layer` hands attention, from position `start`,
    quantized up to `seen`) each row of `ahead`'s own blocks past `seen` as quantized and read
    back from their full-precision copies."""
    fp_keys, fp_values = layer._fp.tail(len(layer._fp))
    split = max(seen, start)
    for b, upto in ahead.items():
        if upto <= split:
            continue
        lo = layer._block_floor(split)  # >= the shared quantized part: its copies are held
        for i, (fp, whole) in enumerate(zip((fp_keys, fp_values), returned, strict=True)):
            back = layer._read_back(fp[b : b + 1].narrow(2, lo - layer._fp_start, upto - lo), layer._per_channel[i])
            whole[b : b + 1].narrow(2, split - start, upto - split).copy_(back.narrow(2, split - lo, upto - split))
