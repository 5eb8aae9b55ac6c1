"""Full attention: every key/value seen, in an amortized growth buffer."""

from __future__ import annotations

from typing import Any

import torch
from typing_extensions import Self

from ..errors import CacheInputError
from ..validation import check_query_length, check_row_lengths
from .base import CacheLayer, check_target, register_layer
from .kv_buffer import Headroom, KVBuffer


@register_layer
class DynamicLayer(CacheLayer):
    """All keys/values seen. An append costs the new tokens only; `crop(-n)` moves an index."""

    crops_rows = True

    def __init__(self) -> None:
        super().__init__()
        self._kv = self._new_buffer()

    def _new_buffer(self) -> KVBuffer:
        return KVBuffer(self.headroom())

    def headroom(self) -> Headroom:
        """How the layer's buffer sizes its storage (a window's depends on its width)."""
        return Headroom()

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self._kv.push(key_states, value_states, "DynamicLayer")

    @property
    def keys(self) -> torch.Tensor | None:
        """The held keys `[batch, kv_heads, seq, head_dim]` (a view), None before the first update."""
        return None if self._kv.keys is None else self._kv.live()[0]

    @property
    def values(self) -> torch.Tensor | None:
        """The held values (a view), None before the first update."""
        return None if self._kv.values is None else self._kv.live()[1]

    @property
    def is_initialized(self) -> bool:
        return self._kv.keys is not None

    def get_seq_length(self) -> int:
        return len(self._kv)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        query_length = check_query_length(query_length)
        return len(self._kv) + query_length, 0

    @property
    def max_rollback(self) -> int:
        """Every token, of the shortest row when rows differ (a uniform crop removes n from each)."""
        return min(self._kv.row_lengths()) if self.is_ragged else len(self._kv)

    @property
    def is_croppable(self) -> bool:
        return True

    def _remove_last(self, n: int) -> None:
        self._kv.drop_last(n)

    def row_lengths(self) -> list[int]:
        return self._kv.row_lengths()

    def row_rollback(self) -> list[int]:
        return self._kv.row_lengths()

    @property
    def is_ragged(self) -> bool:
        return self._kv.row_ends is not None

    def _remove_rows(self, counts: list[int]) -> None:
        self._kv.drop_rows(counts)

    def _commit(self) -> None:
        self._kv.shrink()

    def reset(self) -> None:
        self._kv = self._new_buffer()

    @property
    def batch_size(self) -> int | None:
        return self._kv.batch_size

    def _index_batch(self, index: torch.Tensor) -> None:
        self._kv.index_batch(index)

    def copy(self) -> Self:
        """An independent copy (`from_state` copies the tensors into fresh storage with headroom)."""
        return type(self).from_state(self.meta_state, self.state)

    def nbytes(self) -> int:
        """Bytes of storage held, spare capacity included."""
        return self._kv.nbytes()

    @property
    def state(self) -> dict[str, torch.Tensor]:
        if self._kv.keys is None:
            return {}
        keys, values = self._kv.live()
        return {"keys": keys, "values": values}

    @property
    def meta_state(self) -> dict[str, Any]:
        meta: dict[str, Any] = {"seq_length": self.get_seq_length(), "record_past": self._recording}
        if self.is_ragged:
            meta["row_lengths"] = self.row_lengths()
        return meta

    def _load_kv(self, state: dict[str, torch.Tensor], kept: int, adopt: bool = False) -> None:
        """Take over `state`'s keys/values, checking they hold `kept` tokens: copies, or with `adopt`
        the storage they view (`KVBuffer.adopt`)."""
        if not state:
            if kept:
                raise CacheInputError(f"{type(self).__name__}: {kept} token(s) announced but no keys/values given")
            return
        if set(state) != {"keys", "values"}:
            raise CacheInputError(f"{type(self).__name__}: expected tensors 'keys' and 'values', got {sorted(state)}")
        keys, values = state["keys"], state["values"]
        check_loaded_pair(keys, values, kept, type(self).__name__)
        if adopt:
            self._kv = KVBuffer.adopt(keys, values, self.headroom())
        else:
            self._kv = KVBuffer.from_tensors(keys, values, self.headroom())  # a copy: never aliases its input

    def _load_row_lengths(self, meta_state: dict[str, Any], kept: int) -> None:
        """Take over the per-row lengths of a ragged layer (absent: every row holds `kept`)."""
        lengths = check_row_lengths(meta_state.get("row_lengths"), self.batch_size, kept, type(self).__name__)
        self._kv.set_row_lengths(lengths)

    @classmethod
    def from_state(cls, meta_state: dict[str, Any], state: dict[str, torch.Tensor]) -> Self:
        return cls._rebuild(meta_state, state, adopt=False)

    @classmethod
    def adopt_state(cls, meta_state: dict[str, Any], state: dict[str, torch.Tensor]) -> Self:
        return cls._rebuild(meta_state, state, adopt=True)

    @classmethod
    def headroom_of(cls, meta_state: dict[str, Any]) -> Headroom:
        """The headroom a layer of `meta_state` sizes its storage with."""
        return Headroom()

    @classmethod
    def load_target(cls, meta_state: dict[str, Any], name: str, shape: list[int], dtype: torch.dtype) -> torch.Tensor:
        shape = check_target(shape, dtype, cls.__name__)
        if name in ("keys", "values") and len(shape) == 4:
            return KVBuffer.landing(shape, dtype, cls.headroom_of(meta_state))
        return super().load_target(meta_state, name, shape, dtype)

    @classmethod
    def _rebuild(cls, meta_state: dict[str, Any], state: dict[str, torch.Tensor], adopt: bool) -> Self:
        layer = cls()
        kept = nonneg_int(meta_state, "seq_length", cls.__name__)
        layer._load_kv(state, kept, adopt)
        layer._load_row_lengths(meta_state, kept)
        layer._recording = record_past_flag(meta_state, cls.__name__)
        return layer


def nonneg_int(meta_state: dict[str, Any], key: str, who: str) -> int:
    value = meta_state.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise CacheInputError(f"{who}: '{key}' must be a non-negative int, got {value!r}")
    return value


def record_past_flag(meta_state: dict[str, Any], who: str) -> bool:
    """A saved layer's `record_past` (absent: False); anything but a bool is refused, not coerced
    (a string "false" would read as True)."""
    value = meta_state.get("record_past", False)
    if not isinstance(value, bool):
        raise CacheInputError(f"{who}: 'record_past' must be a bool, got {value!r}")
    return value


def check_loaded_pair(keys: torch.Tensor, values: torch.Tensor, kept: int, who: str) -> None:
    if keys.dim() != 4 or values.dim() != 4 or keys.shape[:3] != values.shape[:3]:
        raise CacheInputError(
            f"{who}: keys {tuple(keys.shape)} and values {tuple(values.shape)} are not a [batch, heads, seq, dim] pair"
        )
    if keys.shape[2] != kept:
        raise CacheInputError(f"{who}: keys hold {keys.shape[2]} token(s) but the metadata says {kept}")
    if keys.dtype != values.dtype or keys.device != values.device:
        raise CacheInputError(f"{who}: keys and values differ in dtype or device")
