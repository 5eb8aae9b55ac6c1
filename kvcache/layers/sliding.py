"""Sliding-window attention: the last `sliding_window - 1` tokens, plus what rollback needs."""

from __future__ import annotations

from typing import Any

import torch
from typing_extensions import Self

from ..errors import CacheInputError
from ..validation import check_query_length
from .base import register_layer
from .dynamic import DynamicLayer, nonneg_int, record_past_flag
from .kv_buffer import Headroom


@register_layer
class SlidingWindowLayer(DynamicLayer):
    """Keys/values of a sliding-window attention layer.

    A query attends to itself and the `sliding_window - 1` tokens before it, so that many are kept.
    While recording, the tokens added since the commit point are kept too (`W - 1 + r` in all), so
    `crop(-n)` can bring evicted tokens back. `get_seq_length()` counts every token seen.
    """

    is_sliding = True

    def __init__(self, sliding_window: int) -> None:
        if isinstance(sliding_window, bool) or not isinstance(sliding_window, int) or sliding_window < 1:
            raise CacheInputError(f"sliding_window must be a positive int, got {sliding_window!r}")
        self.sliding_window = sliding_window
        super().__init__()
        self._seen = 0  # tokens seen and not rolled back
        self._seen_at_commit = 0

    def headroom(self) -> Headroom:
        return Headroom.for_window(self.sliding_window)

    @property
    def _working_size(self) -> int:
        return self.sliding_window - 1

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self._kv.check(key_states, value_states, type(self).__name__)
        visible = self._seen - self._first_visible() + key_states.shape[2]
        self._kv.append(key_states, value_states)
        self._seen += key_states.shape[2]
        returned = self._kv.tail(visible)
        self._evict()
        return returned

    def _kept_from(self) -> int:
        """Absolute position of the oldest token held."""
        return self._seen - len(self._kv)

    def row_lengths(self) -> list[int]:
        """Tokens each row has seen (rows differ after a per-row crop)."""
        start = self._kept_from()
        return [start + n for n in self._kv.row_lengths()]

    def _shortest(self) -> int:
        return min(self.row_lengths(), default=self._seen) if self.is_ragged else self._seen

    def _first_visible(self) -> int:
        """Absolute position of the first key the next update returns: the window of the row
        that has seen the fewest tokens starts there."""
        return max(self._shortest() - self._working_size, 0)

    def _evict(self) -> None:
        floor = self._seen_at_commit if self._recording else self._shortest()
        self._kv.keep_last(self._seen - max(floor - self._working_size, 0))
        if not self._recording:
            self._kv.shrink()  # a long prefill chunk must not leave its storage behind

    def get_seq_length(self) -> int:
        return self._seen

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        query_length = check_query_length(query_length)
        offset = self._first_visible()
        return self._seen - offset + query_length, offset

    def get_max_length(self) -> int:
        return self.sliding_window

    def row_rollback(self) -> list[int]:
        start = self._kept_from()
        if start == 0:  # nothing evicted yet
            return self.row_lengths()
        return [max(seen - self._working_size - start, 0) for seen in self.row_lengths()]

    @property
    def max_rollback(self) -> int:
        if self.is_ragged:
            return min(self.row_rollback())
        kept = len(self._kv)
        return self._seen if kept == self._seen else kept - self._working_size

    @property
    def is_croppable(self) -> bool:
        return self._recording

    def _rollback_hint(self) -> str:
        if self._recording:
            return f"recording since token {self._seen_at_commit}"
        return "not recording: call activate_past_recording() before the steps to undo"

    def _remove_last(self, n: int) -> None:
        self._kv.drop_last(n)
        self._seen -= n
        self._seen_at_commit = min(self._seen_at_commit, self._shortest())

    def _remove_rows(self, counts: list[int]) -> None:
        start = self._kept_from()
        self._kv.drop_rows(counts)
        self._seen = start + len(self._kv)
        self._seen_at_commit = min(self._seen_at_commit, self._shortest())

    def _index_batch(self, index: torch.Tensor) -> None:
        start = self._kept_from()
        self._kv.index_batch(index)
        self._seen = start + len(self._kv)  # the longest kept row's count
        self._seen_at_commit = min(self._seen_at_commit, self._shortest())

    def _commit(self) -> None:
        self._seen_at_commit = self._shortest()
        self._kv.keep_last(self._seen - max(self._seen_at_commit - self._working_size, 0))
        self._kv.shrink()

    def reset(self) -> None:
        super().reset()
        self._seen = self._seen_at_commit = 0

    @property
    def meta_state(self) -> dict[str, Any]:
        return {
            "sliding_window": self.sliding_window,
            "seq_length": self._seen,
            "kept_length": len(self._kv),
            "seq_length_at_commit": self._seen_at_commit,
            "record_past": self._recording,
            **({"row_lengths": self.row_lengths()} if self.is_ragged else {}),
        }

    @classmethod
    def headroom_of(cls, meta_state: dict[str, Any]) -> Headroom:
        window = meta_state.get("sliding_window")
        if isinstance(window, int) and not isinstance(window, bool) and window >= 1:
            return Headroom.for_window(window)
        return Headroom()  # a bad window is refused by `_rebuild`

    @classmethod
    def _rebuild(cls, meta_state: dict[str, Any], state: dict[str, torch.Tensor], adopt: bool) -> Self:
        name = cls.__name__
        layer = cls(meta_state.get("sliding_window"))  # type: ignore[arg-type]
        seen = nonneg_int(meta_state, "seq_length", name)
        kept = nonneg_int(meta_state, "kept_length", name)
        at_commit = nonneg_int(meta_state, "seq_length_at_commit", name)
        recording = record_past_flag(meta_state, name)
        lengths = meta_state.get("row_lengths")  # tokens seen per row, checked as held ones below
        start = seen - kept
        held = [n - start if isinstance(n, int) else n for n in lengths] if isinstance(lengths, list) else lengths
        ints = isinstance(lengths, list) and lengths and all(isinstance(n, int) for n in lengths)
        shortest = min(lengths) if ints else seen  # malformed ones are refused by `_load_row_lengths`
        floor = at_commit if recording else shortest
        if at_commit > shortest or kept != min(seen, seen - floor + layer._working_size):
            raise CacheInputError(
                f"{name}: inconsistent lengths (seen {seen}, kept {kept}, at commit {at_commit}, "
                f"window {layer.sliding_window}, recording {recording})"
            )
        layer._load_kv(state, kept, adopt)
        layer._load_row_lengths({"row_lengths": held}, kept)
        layer._seen, layer._seen_at_commit, layer._recording = seen, at_commit, recording
        return layer
