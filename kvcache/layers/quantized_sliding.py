"""A quantized sliding window: the last `sliding_window - 1` keys/values (plus what recording
needs), quantized as `QuantizedLayer` quantizes them (see there). Quantized tokens leave the
front as the window moves (by whole blocks when keys are quantized per channel: a block straddling
the window's start is kept whole); a block that leaves every window before it is quantized is
never quantized at all."""

from __future__ import annotations

from typing import Any

import torch
from typing_extensions import Self

from ..errors import CacheInputError
from ..validation import check_query_length
from .base import register_layer
from .dynamic import nonneg_int
from .quantized import DEFAULT_RESIDUAL, QuantizedLayer


@register_layer
class QuantizedSlidingWindowLayer(QuantizedLayer):
    """The last `sliding_window - 1` keys/values (plus what recording needs), quantized as
    `QuantizedLayer` quantizes them. `get_seq_length()` counts every token seen."""

    is_sliding = True

    def __init__(self, sliding_window: int, bits: int = 8, group_size: int = 64,
                 residual: int = DEFAULT_RESIDUAL, key_groups: str = "channel",
                 value_groups: str = "channel") -> None:  # fmt: skip
        if isinstance(sliding_window, bool) or not isinstance(sliding_window, int) or sliding_window < 1:
            raise CacheInputError(f"sliding_window must be a positive int, got {sliding_window!r}")
        self.sliding_window = sliding_window
        super().__init__(bits, group_size, residual, key_groups, value_groups)

    def _reset(self) -> None:
        super()._reset()
        self._seen_at_commit = 0

    def _first_visible(self) -> int:
        return max(self._shortest() - (self.sliding_window - 1), 0)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        query_length = check_query_length(query_length)
        offset = self._first_visible()
        return self._longest() - offset + query_length, offset

    def get_max_length(self) -> int:
        return self.sliding_window

    def _evict(self) -> None:
        """Tokens before the window of the shortest row go (before the window at the commit point
        while recording); full-precision copies of quantized tokens too, while not recording."""
        floor = self._seen_at_commit if self._recording else self._shortest()
        window = self._block_floor(max(floor - (self.sliding_window - 1), 0))  # whole key blocks per channel
        fp_from = max(window, self._fp_start) if self._recording else max(window, self._quantized)
        self._drop_front(min(fp_from, self._longest()), min(window, self._quantized))

    def _min_kept(self) -> int:
        held = self._q_start if self._quantized > self._q_start else self._fp_start
        window = held + self.sliding_window - 1 if held else 0  # the window must still be held
        if not self._fp_start:
            return window
        by_quantization = -(-self._fp_start // self.residual) * self.residual
        by_window = self._fp_start + self.sliding_window - 1  # tokens returned to precision are out of the window
        return max(window, min(by_quantization, by_window))

    def _unquantize(self) -> None:
        super()._unquantize()
        self._seen_at_commit = min(self._seen_at_commit, self._shortest())

    def _commit(self) -> None:
        self._seen_at_commit = self._shortest()
        super()._commit()

    def _index_batch(self, index: torch.Tensor) -> None:
        super()._index_batch(index)
        self._seen_at_commit = min(self._seen_at_commit, self._shortest())

    @property
    def meta_state(self) -> dict[str, Any]:
        return {**super().meta_state, "sliding_window": self.sliding_window,
                "seq_length_at_commit": self._seen_at_commit}  # fmt: skip

    @classmethod
    def _params(cls, meta_state: dict[str, Any]) -> dict[str, Any]:
        return {"sliding_window": meta_state.get("sliding_window"), **super()._params(meta_state)}

    @classmethod
    def from_state(cls, meta_state: dict[str, Any], state: dict[str, torch.Tensor]) -> Self:
        layer = super().from_state(meta_state, state)
        at_commit = nonneg_int(meta_state, "seq_length_at_commit", cls.__name__)
        if at_commit > max(layer._shortest(), 0):
            raise CacheInputError(f"{cls.__name__}: seq_length_at_commit {at_commit} exceeds the shortest row")
        layer._seen_at_commit = at_commit
        return layer
