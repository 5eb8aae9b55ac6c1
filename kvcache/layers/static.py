"""Preallocated attention keys/values of a fixed maximum length, for `torch.compile`."""

from __future__ import annotations

from typing import Any

import torch
from typing_extensions import Self

from ..errors import CacheInputError, CacheOverflowError
from ..validation import check_query_length, check_row_lengths
from .base import CacheLayer, register_layer
from .dynamic import check_loaded_pair, nonneg_int, record_past_flag
from .kv_buffer import check_kv_pair, check_matches


class FixedKVLayer(CacheLayer):
    """What the fixed-shape attention layers share: keys/values `[batch, kv_heads, slots, head_dim]`
    allocated once (zeroed) at the first update, the update checks, and batch operations."""

    is_compileable = True

    def __init__(self) -> None:
        super().__init__()
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None

    @property
    def is_initialized(self) -> bool:
        return self.keys is not None

    def _allocate(self, key_states: torch.Tensor, value_states: torch.Tensor, slots: int) -> None:
        batch, heads = key_states.shape[:2]
        self.keys = key_states.new_zeros(batch, heads, slots, key_states.shape[3])
        self.values = value_states.new_zeros(batch, heads, slots, value_states.shape[3])

    def _check_update(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Raise `CacheInputError` unless the pair matches the held tensors: the common case is one
        comparison, anything else takes the full checks, which name what is wrong."""
        keys, values = self.keys, self.values
        if keys is not None and values is not None and isinstance(key_states, torch.Tensor):
            ks, vs = key_states.shape, getattr(value_states, "shape", ())
            if (
                len(ks) == 4 and len(vs) == 4 and ks[2] == vs[2]
                and ks[0] == vs[0] == keys.shape[0] and ks[1] == vs[1] == keys.shape[1]
                and ks[3] == keys.shape[3] and vs[3] == values.shape[3]
                and key_states.dtype == value_states.dtype == keys.dtype  # type: ignore[union-attr]
                and key_states.device == value_states.device == keys.device  # type: ignore[union-attr]
            ):  # fmt: skip
                return
        who = type(self).__name__
        check_kv_pair(key_states, value_states, who)
        if self.keys is not None and self.values is not None:
            for held, new, name in ((self.keys, key_states, "keys"), (self.values, value_states, "values")):
                check_matches((held.shape[0], held.shape[1], held.shape[3]), held.dtype, held.device, new, name, who)

    @property
    def batch_size(self) -> int | None:
        return None if self.keys is None else self.keys.shape[0]

    def _index_batch(self, index: torch.Tensor) -> None:
        if self.keys is not None and self.values is not None:
            index = index.to(self.keys.device)
            self.keys, self.values = self.keys.index_select(0, index), self.values.index_select(0, index)

    def nbytes(self) -> int:
        return 0 if self.keys is None or self.values is None else self.keys.nbytes + self.values.nbytes

    def _zero(self) -> None:
        """Forget the contents, keep storage and addresses (a reset layer holds nothing of its past)."""
        if self.keys is not None and self.values is not None:
            self.keys.zero_()
            self.values.zero_()


@register_layer
class StaticLayer(FixedKVLayer):
    """Keys/values in tensors of fixed shape `[batch, kv_heads, max_cache_len, head_dim]`.

    `update` writes in place and returns the whole preallocated tensors (positions past the length
    are masked out: `get_mask_sizes` reports `max_cache_len`), so shapes and addresses never change.
    Rollback only moves the length (O(1) whatever the count): the removed positions keep their old
    values until overwritten, behind the causal mask. A masked key gets softmax weight exactly 0, so
    a crop-and-regrow computes bit for bit what a straight run computes, provided those stale
    values are finite (they are keys/values an earlier forward produced; `state` never includes them).

    The length lives twice: as a host int (bookkeeping, checks) and as a 0-dim device tensor
    advanced in place, which is what an `update` traced by `torch.compile` writes at. A compiled
    update therefore reads no Python int (no recompilation per token, no host sync); it cannot
    check for overflow, and it leaves the host copy to be re-read once from the device when next
    needed.
    """

    def __init__(self, max_cache_len: int) -> None:
        if isinstance(max_cache_len, bool) or not isinstance(max_cache_len, int) or max_cache_len < 1:
            raise CacheInputError(f"max_cache_len must be a positive int, got {max_cache_len!r}")
        super().__init__()
        self.max_cache_len = max_cache_len
        self._host_length: int | None = 0  # None after compiled updates, until read back
        self._position = torch.zeros((), dtype=torch.long)  # the length, on the keys' device
        # After a per-row crop: each row's length (the longest is the length). Eager updates only.
        self._rows: list[int] | None = None

    crops_rows = True

    @property
    def _length(self) -> int:
        if self._host_length is None:
            self._host_length = int(self._position)
        return self._host_length

    def _set_length(self, length: int) -> None:
        self._host_length = length
        self._position.fill_(length)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Allocate zeroed storage shaped after `key_states`/`value_states` (batch, heads, dims)."""
        self._allocate(key_states, value_states, self.max_cache_len)
        self._position = self._position.to(key_states.device)

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self._check_update(key_states, value_states)
        n = key_states.shape[2]
        if torch.compiler.is_compiling():
            return self._update_compiled(key_states, value_states)
        if self._length + n > self.max_cache_len:
            raise CacheOverflowError(
                f"{type(self).__name__}: {self._length} + {n} token(s) exceed max_cache_len={self.max_cache_len}"
            )
        if self.keys is None:
            self.lazy_initialization(key_states, value_states)
        if self._rows is not None:
            return self._update_rows(key_states, value_states)
        length = self._length
        self.keys.narrow(2, length, n).copy_(key_states)  # type: ignore[union-attr]
        self.values.narrow(2, length, n).copy_(value_states)  # type: ignore[union-attr]
        self._set_length(length + n)
        return self.keys, self.values  # type: ignore[return-value]

    def _update_rows(self, key_states: torch.Tensor, value_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's new tokens after its own length (a ragged layer): one scatter per tensor."""
        assert self.keys is not None and self.values is not None and self._rows is not None
        batch, n, device = key_states.shape[0], key_states.shape[2], self.keys.device
        if max(self._rows) + n > self.max_cache_len:
            raise CacheOverflowError(
                f"{type(self).__name__}: a row of {max(self._rows)} + {n} token(s) exceeds "
                f"max_cache_len={self.max_cache_len}"
            )
        positions = torch.tensor(self._rows, device=device)[:, None] + torch.arange(n, device=device)
        rows = torch.arange(batch, device=device)[:, None].expand(batch, n)
        self.keys[rows, :, positions] = key_states.transpose(1, 2)
        self.values[rows, :, positions] = value_states.transpose(1, 2)
        self._rows = [r + n for r in self._rows]
        self._set_length(max(self._rows))
        return self.keys, self.values

    def row_lengths(self) -> list[int]:
        return list(self._rows) if self._rows is not None else super().row_lengths()

    def row_rollback(self) -> list[int]:
        return self.row_lengths()

    @property
    def is_ragged(self) -> bool:
        return self._rows is not None

    def _remove_rows(self, counts: list[int]) -> None:
        rows = [r - c for r, c in zip(self.row_lengths(), counts, strict=True)]
        self._rows = None if len(set(rows)) <= 1 else rows
        self._set_length(max(rows))

    def _update_compiled(
        self, key_states: torch.Tensor, value_states: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The traced write: positions from the device-side length, nothing read from the host."""
        if self._rows is not None:
            raise CacheInputError(f"{type(self).__name__}: ragged rows (after a per-row crop) take eager updates only")
        if self.keys is None:
            self.lazy_initialization(key_states, value_states)
        assert self.keys is not None and self.values is not None
        positions = self._position + torch.arange(key_states.shape[2], device=self._position.device)
        self.keys.index_copy_(2, positions, key_states)
        self.values.index_copy_(2, positions, value_states)
        self._position.add_(key_states.shape[2])
        self._host_length = None
        return self.keys, self.values

    def get_seq_length(self) -> int:
        if torch.compiler.is_compiling():
            # traced code gets the device-side length (as transformers' StaticLayer returns): reading the
            # host int would guard on it and recompile whenever it changes. A copy: the length tensor
            # itself advances at the next update, and callers hold on to what they were told.
            return self._position.clone()  # type: ignore[return-value]
        return self._length

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        query_length = check_query_length(query_length)
        return self.max_cache_len, 0

    def get_max_length(self) -> int:
        return self.max_cache_len

    @property
    def max_rollback(self) -> int:
        """Every token, of the shortest row when rows differ (a uniform crop removes n from each)."""
        return min(self._rows) if self._rows is not None else self._length

    @property
    def is_croppable(self) -> bool:
        return True

    def _remove_last(self, n: int) -> None:
        self._set_length(self._length - n)
        if self._rows is not None:
            self._rows = [r - n for r in self._rows]

    def _index_batch(self, index: torch.Tensor) -> None:
        super()._index_batch(index)
        if self._rows is not None:
            rows = [self._rows[i] for i in index.tolist()]
            self._rows = None if len(set(rows)) <= 1 else rows
            if rows and self._rows is None:
                self._set_length(rows[0])

    def _commit(self) -> None:
        pass  # nothing beyond the working set is ever kept

    def reset(self) -> None:
        self._zero()
        self._set_length(0)
        self._rows = None

    @property
    def state(self) -> dict[str, torch.Tensor]:
        if self.keys is None or self.values is None:
            return {}
        return {"keys": self.keys[:, :, : self._length], "values": self.values[:, :, : self._length]}

    @property
    def meta_state(self) -> dict[str, Any]:
        meta = {"max_cache_len": self.max_cache_len, "seq_length": self._length, "record_past": self._recording}
        if self._rows is not None:
            meta["row_lengths"] = list(self._rows)
        return meta

    @classmethod
    def planned_nbytes(cls, meta_state: dict[str, Any], state: dict[str, torch.Tensor]) -> int:
        keys, values, max_len = state.get("keys"), state.get("values"), meta_state.get("max_cache_len")
        if keys is None or values is None or keys.dim() != 4 or values.dim() != 4 or type(max_len) is not int:
            return 0  # from_state refuses these
        row = sum(t.shape[0] * t.shape[1] * t.shape[3] * t.element_size() for t in (keys, values))
        return max(max_len, 0) * row

    @classmethod
    def from_state(cls, meta_state: dict[str, Any], state: dict[str, torch.Tensor]) -> Self:
        name = cls.__name__
        layer = cls(meta_state.get("max_cache_len"))  # type: ignore[arg-type]
        length = nonneg_int(meta_state, "seq_length", name)
        if length > layer.max_cache_len:
            raise CacheInputError(f"{name}: seq_length {length} exceeds max_cache_len {layer.max_cache_len}")
        if state:
            if set(state) != {"keys", "values"}:
                raise CacheInputError(f"{name}: expected tensors 'keys' and 'values', got {sorted(state)}")
            check_loaded_pair(state["keys"], state["values"], length, name)
            layer.lazy_initialization(state["keys"], state["values"])
            assert layer.keys is not None and layer.values is not None
            layer.keys[:, :, :length].copy_(state["keys"])
            layer.values[:, :, :length].copy_(state["values"])
        elif length:
            raise CacheInputError(f"{name}: {length} token(s) announced but no keys/values given")
        layer._set_length(length)
        lengths = check_row_lengths(meta_state.get("row_lengths"), layer.batch_size, length, name)
        if lengths is not None:
            layer._rows = None if len(set(lengths)) <= 1 else list(lengths)
        layer._recording = record_past_flag(meta_state, cls.__name__)
        return layer
