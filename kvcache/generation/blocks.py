"""Prefill in position-aligned blocks: the forward calls a prompt gets depend only on the prompt,
not on where an earlier run stopped, so a run resumed from a saved (or stored) cache makes exactly
the calls an uninterrupted run makes and computes exactly the same numbers."""

from __future__ import annotations

from typing import Any

import torch

from ..cache import Cache
from ..errors import GenerationError
from ..protocol import last_logits


def whole_blocks(length: int, block: int) -> int:
    """Tokens of a `length`-token prompt that lie in whole blocks, leaving at least the last token
    (it is fed as the first decoding step)."""
    return max(length - 1, 0) // block * block


def prefill_blocks(model: Any, input_ids: torch.Tensor, cache: Cache, *, block: int, end: int,
                   progress: Any = None) -> Cache:  # fmt: skip
    """Feed `input_ids[:, cache length : end]` to `model` in forward calls of `block` tokens, each
    starting at a multiple of `block` (the cache must end on one, and so must `end`). Blocks of a
    few hundred tokens cost what one whole-prompt forward costs; `progress.update(n)` is called
    after each block where given."""
    if isinstance(block, bool) or not isinstance(block, int) or block < 1:
        raise GenerationError(f"block must be a positive int, got {block!r}", param="block")
    start = cache.get_seq_length()
    if start % block or end % block or not start <= end <= input_ids.shape[1]:
        raise GenerationError(
            f"end ({end}) and the cache's length ({start}) must be multiples of block ({block}), with "
            f"the cache's length <= end <= the prompt's {input_ids.shape[1]} tokens", param="end"
        )
    keep = last_logits(model)  # the logits are not used: the head runs on one position
    with torch.no_grad():
        for at in range(start, end, block):
            model(input_ids[:, at : at + block], cache=cache, **keep)
            if progress is not None:
                progress.update(block)
    return cache
