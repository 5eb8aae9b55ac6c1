"""A growable keys/values store: amortized appends, O(1) crops, views handed out."""

from __future__ import annotations

import torch

from ..errors import CacheInputError

#: Storage capacity is allocated in multiples of this many tokens.
CAPACITY_BLOCK = 256


def _round_up(n: int, block: int = CAPACITY_BLOCK) -> int:
    return max(block, -(-n // block) * block)


def check_kv_pair(key_states: torch.Tensor, value_states: torch.Tensor, who: str) -> None:
    """Reject keys/values that are not a matching `[batch, heads, seq, dim]` pair."""
    if not isinstance(key_states, torch.Tensor) or not isinstance(value_states, torch.Tensor):
        raise CacheInputError(
            f"{who}.update takes tensors, got {type(key_states).__name__}/{type(value_states).__name__}"
        )
    if key_states.dim() != 4 or value_states.dim() != 4:
        raise CacheInputError(
            f"{who}.update expects [batch, kv_heads, seq, head_dim] keys and values, got shapes "
            f"{tuple(key_states.shape)} and {tuple(value_states.shape)}"
        )
    if key_states.shape[:3] != value_states.shape[:3]:
        raise CacheInputError(
            f"{who}.update: keys {tuple(key_states.shape)} and values {tuple(value_states.shape)} "
            "disagree in batch, heads or sequence length"
        )
    if key_states.dtype != value_states.dtype or key_states.device != value_states.device:
        raise CacheInputError(
            f"{who}.update: keys ({key_states.dtype}, {key_states.device}) and values "
            f"({value_states.dtype}, {value_states.device}) differ in dtype or device"
        )


def check_matches(held: torch.Tensor, new: torch.Tensor, name: str, who: str) -> None:
    """Reject `new` unless it fits next to `held` along the sequence axis (all but dim 2 equal)."""
    problems = []
    for dim, label in ((0, "batch"), (1, "kv_heads"), (3, "head_dim")):
        if held.shape[dim] != new.shape[dim]:
            problems.append(f"{label} {new.shape[dim]} != {held.shape[dim]}")
    if held.dtype != new.dtype:
        problems.append(f"dtype {new.dtype} != {held.dtype}")
    if held.device != new.device:
        problems.append(f"device {new.device} != {held.device}")
    if problems:
        raise CacheInputError(f"{who}.update: new {name} do not match the cached ones: " + ", ".join(problems))


class KVBuffer:
    """Keys and values with a live window `[start, end)` inside larger storage along the sequence axis.

    Appends write into spare capacity and only reallocate (geometrically) when it runs out, so a
    decode step costs the size of the new tokens, not of the cache. Dropping tokens at either end
    only moves an index. Views into the storage are handed out; they stay valid until the next
    mutating call.
    """

    __slots__ = ("end", "keys", "start", "values")

    def __init__(self) -> None:
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None
        self.start = 0
        self.end = 0

    @classmethod
    def from_tensors(cls, keys: torch.Tensor, values: torch.Tensor) -> KVBuffer:
        """A buffer holding exactly `keys`/`values` (taken over, not copied)."""
        buf = cls()
        buf.keys, buf.values, buf.end = keys, values, keys.shape[2]
        return buf

    def __len__(self) -> int:
        return self.end - self.start

    @property
    def capacity(self) -> int:
        return 0 if self.keys is None else self.keys.shape[2]

    def tail(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of the last `n` live tokens."""
        assert self.keys is not None and self.values is not None
        lo = self.end - n
        return self.keys[:, :, lo : self.end], self.values[:, :, lo : self.end]

    def live(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of all live tokens, oldest first."""
        return self.tail(len(self))

    def check(self, key_states: torch.Tensor, value_states: torch.Tensor, who: str) -> None:
        """Raise `CacheInputError` unless the pair can be appended."""
        check_kv_pair(key_states, value_states, who)
        if self.keys is not None and self.values is not None:
            check_matches(self.keys, key_states, "keys", who)
            check_matches(self.values, value_states, "values", who)

    def append(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Write new tokens after the live window (call `check` first)."""
        n = key_states.shape[2]
        self._reserve(n, key_states, value_states)
        assert self.keys is not None and self.values is not None
        self.keys[:, :, self.end : self.end + n].copy_(key_states)
        self.values[:, :, self.end : self.end + n].copy_(value_states)
        self.end += n

    def _reserve(self, n: int, key_like: torch.Tensor, value_like: torch.Tensor) -> None:
        if self.keys is None or self.values is None:
            cap = _round_up(n)
            self.keys = key_like.new_empty(*key_like.shape[:2], cap, key_like.shape[3])
            self.values = value_like.new_empty(*value_like.shape[:2], cap, value_like.shape[3])
            return
        if self.end + n <= self.capacity:
            return
        live = len(self)
        if live + n <= self.capacity and self.start >= live:
            # Room at the front and no overlap: slide the live window down instead of allocating.
            self.keys[:, :, :live].copy_(self.keys[:, :, self.start : self.end])
            self.values[:, :, :live].copy_(self.values[:, :, self.start : self.end])
        else:
            self._reallocate(_round_up(2 * (live + n)))
            return
        self.start, self.end = 0, live

    def _reallocate(self, capacity: int) -> None:
        assert self.keys is not None and self.values is not None
        live = len(self)
        keys = self.keys.new_empty(*self.keys.shape[:2], capacity, self.keys.shape[3])
        values = self.values.new_empty(*self.values.shape[:2], capacity, self.values.shape[3])
        keys[:, :, :live].copy_(self.keys[:, :, self.start : self.end])
        values[:, :, :live].copy_(self.values[:, :, self.start : self.end])
        self.keys, self.values, self.start, self.end = keys, values, 0, live

    def drop_last(self, n: int) -> None:
        self.end -= n

    def keep_last(self, n: int) -> None:
        """Drop all but the last `n` live tokens from the front."""
        self.start = max(self.start, self.end - n)

    def shrink(self) -> None:
        """Give back storage when far more is held than the live tokens need (after a big crop or
        a long prefill into a window). Keeps 2x headroom so it never alternates with a regrowth."""
        if self.keys is not None and self.capacity > 4 * _round_up(len(self)):
            self._reallocate(_round_up(2 * len(self)))

    def index_batch(self, index: torch.Tensor) -> None:
        """Replace the batch dimension by `live[index]` (fresh storage)."""
        if self.keys is None or self.values is None:
            return
        keys, values = self.live()
        index = index.to(keys.device)
        self.keys, self.values = keys.index_select(0, index), values.index_select(0, index)
        self.start, self.end = 0, self.keys.shape[2]

    def nbytes(self) -> int:
        """Bytes of storage held (capacity, not just live tokens)."""
        if self.keys is None or self.values is None:
            return 0
        return self.keys.nbytes + self.values.nbytes
