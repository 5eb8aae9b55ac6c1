"""A forward whose rows feed different numbers of real tokens, computed at the cost of those tokens.

A batch forward is a rectangle `[batch, length]`, but its rows often carry fewer real tokens than
its width: a verify forward where one row drafts 16 tokens and the others none, the rests of a
group of prompts right-padded to the longest. The positions after a row's real tokens are fillers
whose outputs nobody reads. The linear layers (projections, MLP, head: most of a small model's
time) then run on the real tokens only, packed as `[tokens, features]`; attention, which needs the
rectangle, gets the fillers' queries, keys and values as zeros (no real query sees them: they come
after each row's last real token, and the caller crops them from the cache).
"""

from __future__ import annotations

from typing import Any

import torch

from ..errors import CacheInputError


def check_tokens_per_row(tokens_per_row: Any, batch: int, length: int) -> list[int] | None:
    """`tokens_per_row` as host ints (one per row, each in `[1, length]`), or `CacheInputError`
    naming what is wrong; None when it is None."""
    if tokens_per_row is None:
        return None
    if isinstance(tokens_per_row, torch.Tensor):
        if tokens_per_row.dim() != 1 or tokens_per_row.dtype not in (torch.int32, torch.int64):
            raise CacheInputError(f"tokens_per_row must be a 1-D integer tensor or a list of ints, got a "
                                  f"{tokens_per_row.dtype} tensor of shape {tuple(tokens_per_row.shape)}")  # fmt: skip
        tokens_per_row = tokens_per_row.tolist()
    if not isinstance(tokens_per_row, (list, tuple)) or any(
        not isinstance(n, int) or isinstance(n, bool) for n in tokens_per_row
    ):
        raise CacheInputError(f"tokens_per_row must be a list of ints (one per row), got {tokens_per_row!r}")
    if len(tokens_per_row) != batch:
        raise CacheInputError(f"tokens_per_row has {len(tokens_per_row)} entries for a batch of {batch} rows")
    if any(n < 1 or n > length for n in tokens_per_row):
        raise CacheInputError(f"tokens_per_row entries must lie in [1, {length}] (the forward's width), "
                              f"got {list(tokens_per_row)}")  # fmt: skip
    return list(tokens_per_row)


class Packing:
    """Which positions of a `[batch, length]` forward are computed: each row's first `counts[b]`."""

    #: Fillers a forward must hold to be packed: packing costs about ten small operations per
    #: layer, which fewer fillers do not pay back. Measured on the bundled model (hidden 128, the
    #: smallest whose forwards are packed; a wider model pays back sooner), one thread, 250 tokens
    #: of context: 8 rows x 5 with 28 fillers 2.5 ms packed against 3.1 ms, 8 x 9 with 56 fillers
    #: 2.9 against 4.0, 32 x 9 with 192 fillers 8.4 against 11.7; with 20 fillers 2.83 against
    #: 2.77, with 4 fillers 1.88 against 1.75.
    MIN_FILLERS = 24

    def __init__(self, counts: list[int], batch: int, length: int, device: torch.device) -> None:
        self.batch, self.length = batch, length
        flat = [b * length + t for b, n in enumerate(counts) for t in range(n)]
        self.index = torch.tensor(flat, dtype=torch.long, device=device)

    @classmethod
    def of(cls, counts: list[int] | None, batch: int, length: int, device: torch.device) -> Packing | None:
        """The packing of a forward, or None where it holds fewer than `MIN_FILLERS` fillers."""
        if counts is None or batch * length - sum(counts) < max(cls.MIN_FILLERS, 1):
            return None
        return cls(counts, batch, length, device)

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        """`[batch, length, features]` -> `[tokens, features]`, the real positions in row order."""
        return x.reshape(self.batch * self.length, -1).index_select(0, self.index)

    def unpack(self, x: torch.Tensor) -> torch.Tensor:
        """`[tokens, features]` -> `[batch, length, features]`, the fillers zeros."""
        out = x.new_zeros(self.batch * self.length, x.shape[-1])
        return out.index_copy_(0, self.index, x).view(self.batch, self.length, -1)

    def unpack_last(self, x: torch.Tensor, keep: int, head: Any) -> torch.Tensor:
        """`head` applied to the packed positions among each row's last `keep` columns, as
        `[batch, keep, out]` (the fillers zeros): the logits a `logits_to_keep` forward returns."""
        columns = self.index % self.length
        kept = (columns >= self.length - keep).nonzero().squeeze(1)
        out = head(x.index_select(0, kept))
        rows, shifted = self.index[kept] // self.length, columns[kept] - (self.length - keep)
        full = out.new_zeros(self.batch * keep, out.shape[-1])
        return full.index_copy_(0, rows * keep + shifted, out).view(self.batch, keep, -1)
