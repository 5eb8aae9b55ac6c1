"""Sliding-window attention in storage of fixed shape and address, with exact rollback, for `torch.compile`."""

from __future__ import annotations

from typing import Any

import torch
from typing_extensions import Self

from ..errors import CacheInputError, CacheOverflowError
from ..validation import check_query_length
from .base import register_layer
from .dynamic import check_loaded_pair, nonneg_int, record_past_flag
from .static import FixedKVLayer

#: Default of `rollback_tokens`: room for a speculative step of 7 drafts plus the token before them.
DEFAULT_ROLLBACK_TOKENS = 8


def positive_int(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise CacheInputError(f"{name} must be a positive int, got {value!r}")
    return value


@register_layer
class StaticSlidingWindowLayer(FixedKVLayer):
    """Keys/values of a sliding-window layer in a ring of `capacity = min(max_cache_len,
    sliding_window - 1 + rollback_tokens)` positions allocated once.

    Position `p` lives in ring slot `p % capacity`. An update of `q <= rollback_tokens` tokens (a
    decode or verify step) writes its tokens in place and returns the last `capacity` positions in
    order (one gather of the ring, like the roll transformers' static sliding layer does), so every
    such step has the same shape, and `get_mask_sizes` gives their first position as the offset.
    The ring keeps `rollback_tokens` positions beyond the window, which is what `crop` brings back:
    a crop only moves the length, O(1). Two runs that reach the same length return the same
    positions in the same order, so a crop-and-regrow is bitwise a straight run (positions outside
    the window are masked; see `StaticLayer` on stale values). A longer update (a prefill) is
    served eagerly like `SlidingWindowLayer` serves it, then its last `capacity` tokens are kept.
    """

    is_sliding = True

    def __init__(self, sliding_window: int, max_cache_len: int, rollback_tokens: int = DEFAULT_ROLLBACK_TOKENS) -> None:
        super().__init__()
        self.sliding_window = positive_int(sliding_window, "sliding_window")
        self.max_cache_len = positive_int(max_cache_len, "max_cache_len")
        self.rollback_tokens = positive_int(rollback_tokens, "rollback_tokens")
        self.capacity = min(max_cache_len, sliding_window - 1 + rollback_tokens)  # position p at slot p % capacity
        self._seen = 0  # tokens seen and not rolled back
        self._kept = 0  # the last `_kept` of them are in the ring
        self._seen_at_commit = 0

    @property
    def _working_size(self) -> int:
        return self.sliding_window - 1

    def _fixed_shape(self, q: int) -> bool:
        """Whether a `q`-token update is served from the ring (fixed shape) rather than eagerly."""
        return self._seen + q <= self.capacity or q <= self.capacity - self._working_size

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        q = check_query_length(query_length)
        if self._fixed_shape(q):
            return self.capacity, max(self._seen + q - self.capacity, 0)
        visible = min(self._seen, self._working_size)
        return visible + q, self._seen - visible

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self._check_update(key_states, value_states)
        who, q = type(self).__name__, key_states.shape[2]
        if self._fixed_shape(q):
            return self._update_ring(key_states, value_states)
        if self.capacity < self._working_size:
            raise CacheOverflowError(
                f"{who}: {self._seen} + {q} token(s) exceed max_cache_len={self.max_cache_len}, and the "
                f"ring is too small for a window of {self.sliding_window}"
            )
        if torch.compiler.is_compiling():
            raise CacheInputError(f"{who}: a {q}-token update is a prefill; run it eagerly, not compiled")
        return self._update_eager(key_states, value_states)

    def _slots(self, first: int, n: int, device: torch.device) -> torch.Tensor:
        return (torch.arange(n, device=device) + first) % self.capacity

    def _update_ring(self, key_states: torch.Tensor, value_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.keys is None:
            self._allocate(key_states, value_states, self.capacity)
        assert self.keys is not None and self.values is not None
        q = key_states.shape[2]
        slots = self._slots(self._seen, q, self.keys.device)
        self.keys.index_copy_(2, slots, key_states)
        self.values.index_copy_(2, slots, value_states)
        self._seen += q
        self._kept = min(self._kept + q, self.capacity)
        order = self._slots(max(self._seen - self.capacity, 0), self.capacity, self.keys.device)
        return self.keys.index_select(2, order), self.values.index_select(2, order)

    def _update_eager(self, key_states: torch.Tensor, value_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A long update: the window before it, then the new tokens (as `SlidingWindowLayer` returns)."""
        visible = min(self._seen, self._working_size)
        if self.keys is None:
            self._allocate(key_states, value_states, self.capacity)
        assert self.keys is not None and self.values is not None
        old_keys, old_values = self._positions(self._seen - visible, visible)
        keys = torch.cat([old_keys, key_states], dim=2)
        values = torch.cat([old_values, value_states], dim=2)
        self._seen += key_states.shape[2]
        slots = self._slots(self._seen - self.capacity, self.capacity, self.keys.device)
        self.keys.index_copy_(2, slots, keys[:, :, -self.capacity :])
        self.values.index_copy_(2, slots, values[:, :, -self.capacity :])
        self._kept = self.capacity
        return keys, values

    def _positions(self, first: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of the keys/values at positions `[first, first + n)` (held), in order."""
        assert self.keys is not None and self.values is not None
        order = self._slots(first, n, self.keys.device)
        return self.keys.index_select(2, order), self.values.index_select(2, order)

    def get_seq_length(self) -> int:
        return self._seen

    def get_max_length(self) -> int:
        return self.sliding_window

    # ------------------------------------------------------------------------------ rollback
    @property
    def max_rollback(self) -> int:
        return self._seen if self._kept == self._seen else self._kept - self._working_size

    @property
    def is_croppable(self) -> bool:
        return self._recording and self._seen - self._seen_at_commit <= self.max_rollback

    def _rollback_hint(self) -> str:
        return f"the ring keeps {self.rollback_tokens} token(s) beyond the window of {self.sliding_window}"

    def _remove_last(self, n: int) -> None:
        self._seen -= n
        self._kept -= n
        self._seen_at_commit = min(self._seen_at_commit, self._seen)

    def _commit(self) -> None:
        self._seen_at_commit = self._seen  # nothing to free: the ring is the working size

    def reset(self) -> None:
        self._zero()
        self._seen = self._kept = self._seen_at_commit = 0

    # --------------------------------------------------------------------------- persistence
    @property
    def state(self) -> dict[str, torch.Tensor]:
        if self.keys is None:
            return {}
        keys, values = self._positions(self._seen - self._kept, self._kept)
        return {"keys": keys, "values": values}

    @property
    def meta_state(self) -> dict[str, Any]:
        return {
            "sliding_window": self.sliding_window,
            "max_cache_len": self.max_cache_len,
            "rollback_tokens": self.rollback_tokens,
            "seq_length": self._seen,
            "kept_length": self._kept,
            "seq_length_at_commit": self._seen_at_commit,
            "record_past": self._recording,
        }

    @classmethod
    def planned_nbytes(cls, meta_state: dict[str, Any], state: dict[str, torch.Tensor]) -> int:
        keys, values = state.get("keys"), state.get("values")
        params = [meta_state.get(k) for k in ("sliding_window", "max_cache_len", "rollback_tokens")]
        if keys is None or values is None or keys.dim() != 4 or values.dim() != 4:
            return 0
        if any(type(p) is not int or p < 1 for p in params):
            return 0  # from_state refuses these
        row = sum(t.shape[0] * t.shape[1] * t.shape[3] * t.element_size() for t in (keys, values))
        return min(params[1], params[0] - 1 + params[2]) * row

    @classmethod
    def from_state(cls, meta_state: dict[str, Any], state: dict[str, torch.Tensor]) -> Self:
        name = cls.__name__
        layer = cls(
            meta_state.get("sliding_window"),  # type: ignore[arg-type]
            meta_state.get("max_cache_len"),  # type: ignore[arg-type]
            meta_state.get("rollback_tokens"),  # type: ignore[arg-type]
        )
        seen, kept = nonneg_int(meta_state, "seq_length", name), nonneg_int(meta_state, "kept_length", name)
        at_commit = nonneg_int(meta_state, "seq_length_at_commit", name)
        recording = record_past_flag(meta_state, name)
        if kept > min(seen, layer.capacity) or kept < min(seen, layer._working_size) or at_commit > seen:
            raise CacheInputError(
                f"{name}: inconsistent lengths (seen {seen}, kept {kept}, at commit {at_commit}, "
                f"capacity {layer.capacity}, window {layer.sliding_window})"
            )
        if state:
            if set(state) != {"keys", "values"}:
                raise CacheInputError(f"{name}: expected tensors 'keys' and 'values', got {sorted(state)}")
            check_loaded_pair(state["keys"], state["values"], kept, name)
            layer._allocate(state["keys"], state["values"], layer.capacity)
            assert layer.keys is not None and layer.values is not None
            slots = layer._slots(seen - kept, kept, layer.keys.device)
            layer.keys.index_copy_(2, slots, state["keys"].to(layer.keys.device))
            layer.values.index_copy_(2, slots, state["values"].to(layer.values.device))
        elif kept:
            raise CacheInputError(f"{name}: {kept} token(s) announced but no keys/values given")
        layer._seen, layer._kept, layer._seen_at_commit, layer._recording = seen, kept, at_commit, recording
        return layer
