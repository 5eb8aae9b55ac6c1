"""A growable keys/values store: amortized appends, O(1) crops, views handed out.

Storage is head-major, `[batch, kv_heads, capacity, head_dim]`, and what the layer hands out is
the view `[batch, kv_heads, seq, head_dim]` of its live positions. Each (batch, head) block of that
view is `[seq, head_dim]` with strides `(head_dim, 1)`, laid out as in a contiguous tensor, and
starts 64-byte aligned (capacities are whole blocks of rows), whatever the capacity: spare capacity
only moves where each block starts (the batch and head strides). Attention kernels read each
(batch, head) block on its own, so a cache that was grown, loaded, copied, batch-indexed or
committed gives them the same computation. Why head-major: attention reads each head's keys as
one contiguous run; sequence-major storage (each token's heads together) made CPU attention read
`head_dim`-sized pieces far apart, 1.3-3x slower at head_dim 32-128.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import CacheInputError

#: Storage capacity is allocated in multiples of this many tokens.
CAPACITY_BLOCK = 64
#: A (re)allocation for `n` live tokens reserves room for `n * GROWTH` (rounded up to a block), so
#: appends are amortized O(new tokens) while storage stays within 1.25x of the live tokens plus a block.
GROWTH = 1.25
#: The headroom of a sliding window's buffer: its live size is bounded, so the headroom only sets
#: how often it slides in place (a copy of the window every `W / 8` appended tokens) and what it holds
#: beyond `W - 1 + r` (1.125x, plus a block of `window_block(W)` tokens: 1.25x at most).
WINDOW_GROWTH = 1.125
#: A window whose dropped front holds at least 1/MAX_SLIDE_CHUNKS of its live rows slides down in
#: place (that many non-overlapping copies) rather than reallocating.
MAX_SLIDE_CHUNKS = 8


def capacity_for(n: int, growth: float = GROWTH, block: int = CAPACITY_BLOCK) -> int:
    """Storage rows to allocate for `n` live tokens: headroom for appends, rounded to a block."""
    want = int(n * growth) + 1
    return -(-want // block) * block


@dataclass(frozen=True)
class Headroom:
    """How a buffer sizes its storage: `growth` times the live tokens, in blocks of `block` rows.

    A buffer whose live size settles at `limit` tokens (a sliding window's `W - 1`) doubles while it
    is still below it, up to the storage that limit needs, so filling the window takes a few
    reallocations rather than one per block, and the settled storage is still `growth` x `limit`.
    """

    growth: float = GROWTH
    block: int = CAPACITY_BLOCK
    limit: int | None = None

    @classmethod
    def for_window(cls, window: int) -> Headroom:
        """A window's: blocks of an eighth of it (at least 8 rows), so a window of 64 is not held in
        64-row blocks (2x of its size); a little headroom, since its size is bounded."""
        return cls(WINDOW_GROWTH, max(8, -(-window // 8)), window - 1)

    def capacity(self, n: int) -> int:
        """Storage rows to allocate for `n` live tokens."""
        cap = capacity_for(n, self.growth, self.block)
        if self.limit is not None:
            # at least a block to spare, so a window slides once per block, not once per token (a
            # window of 8 held 8 rows for its 7 tokens and copied them at every step)
            cap = max(cap, -(-(n + self.block) // self.block) * self.block)
            if n < self.limit:
                cap = max(cap, min(capacity_for(n, 2.0, self.block), capacity_for(self.limit, self.growth, self.block)))
        return cap


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


def check_matches(held: tuple[int, int, int], dtype: torch.dtype, device: torch.device, new: torch.Tensor,
                  name: str, who: str) -> None:  # fmt: skip
    """Reject `new` unless its batch, heads, head_dim, dtype and device are `held`'s."""
    problems = []
    for dim, label, size in zip((0, 1, 3), ("batch", "kv_heads", "head_dim"), held, strict=True):
        if new.shape[dim] != size:
            problems.append(f"{label} {new.shape[dim]} != {size}")
    if new.dtype != dtype:
        problems.append(f"dtype {new.dtype} != {dtype}")
    if new.device != device:
        problems.append(f"device {new.device} != {device}")
    if problems:
        raise CacheInputError(f"{who}.update: new {name} do not match the cached ones: " + ", ".join(problems))


def _storage_behind(t: torch.Tensor) -> torch.Tensor | None:
    """The head-major storage `[batch, heads, rows, dim]` whose leading rows the `[batch, heads,
    seq, dim]` view `t` is (what `landing` hands out), or None when `t` is not such a view."""
    if t.dim() != 4 or t.storage_offset() != 0 or 0 in t.shape:
        return None
    batch, heads, seq, dim = t.shape
    if t.stride(3) != 1 or t.stride(2) != dim or t.stride(1) % dim:
        return None
    rows = t.stride(1) // dim
    if rows < seq or t.stride(0) != heads * rows * dim:
        return None
    if t.untyped_storage().nbytes() < batch * heads * rows * dim * t.element_size():
        return None
    return t.as_strided((batch, heads, rows, dim), (heads * rows * dim, rows * dim, dim, 1), 0)


def _rows(t: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """Positions `[lo, hi)` of `[batch, heads, positions, dim]` storage (a view)."""
    return t.narrow(2, lo, hi - lo)


class KVBuffer:
    """Keys and values with a live window `[start, end)` of positions inside larger head-major storage.

    Appends write into spare capacity and only reallocate (geometrically) when it runs out, so a
    decode step costs the size of the new tokens, not of the cache. Dropping tokens at either end
    only moves an index. Views into the storage are handed out; they stay valid until the next
    mutating call.
    """

    __slots__ = ("_signature", "end", "headroom", "keys", "row_ends", "start", "values")

    def __init__(self, headroom: Headroom = Headroom()) -> None:
        self.keys: torch.Tensor | None = None  # [batch, kv_heads, capacity, head_dim]
        self.values: torch.Tensor | None = None
        self._signature: tuple = ()  # (batch, kv_heads, key dim, value dim, dtype, device) that updates must match
        self.start = 0
        self.end = 0
        self.headroom = headroom
        # After a per-row crop: where each batch row's tokens end (storage rows; `end` is their max).
        # Rows stay contiguous from `start`; a shorter row's slots past its end hold stale finite
        # values its causal mask hides. None: every row ends at `end`.
        self.row_ends: list[int] | None = None

    def _set_storage(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Adopt head-major storage."""
        self.keys, self.values = keys, values
        self._signature = (keys.shape[0], keys.shape[1], keys.shape[3], values.shape[3], keys.dtype, keys.device)

    @classmethod
    def from_tensors(cls, keys: torch.Tensor, values: torch.Tensor, headroom: Headroom = Headroom()) -> KVBuffer:
        """A buffer holding a copy of `[batch, heads, seq, dim]` `keys`/`values`, with the headroom a
        grown buffer has (so the next append costs what a steady append costs)."""
        buf = cls(headroom)
        buf._adopt(keys, values)
        return buf

    @staticmethod
    def landing(shape: list[int], dtype: torch.dtype, headroom: Headroom = Headroom()) -> torch.Tensor:
        """Fresh storage for a loaded `[batch, heads, seq, dim]` tensor, with the headroom a grown
        buffer has, seen as that tensor (uninitialised): `adopt` keeps it without a copy."""
        batch, heads, seq, dim = shape
        storage = torch.empty(batch, heads, headroom.capacity(seq), dim, dtype=dtype)
        return storage.narrow(2, 0, seq)

    @classmethod
    def adopt(cls, keys: torch.Tensor, values: torch.Tensor, headroom: Headroom = Headroom()) -> KVBuffer:
        """A buffer over the storage `keys`/`values` view when they are the leading rows of
        head-major storage (what `landing` hands out), else over copies (`from_tensors`). The
        caller gives the tensors up."""
        keys_storage, values_storage = _storage_behind(keys), _storage_behind(values)
        shared = keys.untyped_storage().data_ptr() == values.untyped_storage().data_ptr()
        if keys_storage is None or values_storage is None or shared or keys_storage.shape[2] != values_storage.shape[2]:
            return cls.from_tensors(keys, values, headroom)
        buf = cls(headroom)
        buf._set_storage(keys_storage, values_storage)
        buf.end = keys.shape[2]
        return buf

    @classmethod
    def from_chunks(cls, chunks: list[tuple[torch.Tensor, torch.Tensor]], headroom: Headroom = Headroom()) -> KVBuffer:
        """A buffer holding copies of `[batch, heads, n_i, dim]` key/value chunks, in order, with
        headroom: one concatenation per tensor, straight into the storage (no temporary)."""
        buf = cls(headroom)
        total = sum(k.shape[2] for k, _ in chunks)
        first_k, first_v = chunks[0]
        cap = headroom.capacity(total)
        buf._set_storage(
            first_k.new_empty(*first_k.shape[:2], cap, first_k.shape[3]),
            first_v.new_empty(*first_v.shape[:2], cap, first_v.shape[3]),
        )
        torch.cat([k for k, _ in chunks], dim=2, out=buf.keys.narrow(2, 0, total))  # type: ignore[union-attr]
        torch.cat([v for _, v in chunks], dim=2, out=buf.values.narrow(2, 0, total))  # type: ignore[union-attr]
        buf.end = total
        return buf

    def __len__(self) -> int:
        return self.end - self.start

    @property
    def capacity(self) -> int:
        return 0 if self.keys is None else self.keys.shape[2]

    @property
    def batch_size(self) -> int | None:
        return None if self.keys is None else self.keys.shape[0]

    def tail(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views `[batch, heads, n, dim]` of the last `n` live tokens."""
        assert self.keys is not None and self.values is not None
        lo = self.end - n
        return self.keys.narrow(2, lo, n), self.values.narrow(2, lo, n)

    def span(self, i: int, back: int, n: int) -> torch.Tensor:
        """A view of keys (`i` 0) or values (1): `n` tokens from `back` tokens before the end."""
        held = self.keys if i == 0 else self.values
        assert held is not None
        return held.narrow(2, self.end - back, n)

    def live(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of all live tokens, oldest first."""
        return self.tail(len(self))

    def check(self, key_states: torch.Tensor, value_states: torch.Tensor, who: str) -> None:
        """Raise `CacheInputError` unless the pair can be appended. The common case (the shapes, dtype
        and device of the held tensors) is one comparison; anything else takes the full checks, which
        name what is wrong."""
        if self._signature and isinstance(key_states, torch.Tensor) and isinstance(value_states, torch.Tensor):
            ks, vs = key_states.shape, value_states.shape
            if (
                len(ks) == 4 and len(vs) == 4 and ks[2] == vs[2]
                and (ks[0], ks[1], ks[3], vs[3], key_states.dtype, key_states.device) == self._signature
                and vs[0] == ks[0] and vs[1] == ks[1] and value_states.dtype == key_states.dtype
                and value_states.device == key_states.device
            ):  # fmt: skip
                return
        check_kv_pair(key_states, value_states, who)
        if self.keys is not None and self.values is not None:
            keys, values = self.keys, self.values
            for name, held, new in (("keys", keys, key_states), ("values", values, value_states)):
                check_matches((held.shape[0], held.shape[1], held.shape[3]), held.dtype, held.device, new, name, who)

    def push(self, key_states: torch.Tensor, value_states: torch.Tensor, who: str) -> tuple[torch.Tensor, torch.Tensor]:
        """`check`, `append` and `live` in one call: a decode step's whole cost is two writes and two views."""
        self.check(key_states, value_states, who)
        self.append(key_states, value_states)
        keys, values, start, n = self.keys, self.values, self.start, self.end - self.start
        return keys.narrow(2, start, n), values.narrow(2, start, n)  # type: ignore[union-attr]

    def append(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Write new tokens after the live window (call `check` first)."""
        n, end = key_states.shape[2], self.end
        if self.keys is None or end + n > self.keys.shape[2]:
            self._reserve(n, key_states, value_states)
            end = self.end
        if self.row_ends is not None:
            self._append_rows(key_states, value_states)
            return
        self.keys.narrow(2, end, n).copy_(key_states)  # type: ignore[union-attr]
        self.values.narrow(2, end, n).copy_(value_states)  # type: ignore[union-attr]
        self.end = end + n

    def _append_rows(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Write each row's new tokens after its own end: one scatter of the new tokens per tensor
        (nothing already held moves)."""
        assert self.keys is not None and self.values is not None and self.row_ends is not None
        batch, n = key_states.shape[0], key_states.shape[2]
        device = self.keys.device
        positions = torch.tensor(self.row_ends, device=device)[:, None] + torch.arange(n, device=device)
        rows = torch.arange(batch, device=device)[:, None].expand(batch, n)
        # The view handed out now reaches `end + n`; a row ending short of that has slots there it
        # never wrote (fresh storage, uninitialized). They sit behind its causal mask, but a mask
        # hides only finite values (NaN * 0 is NaN), so they are zeroed first.
        _rows(self.keys, self.end, self.end + n).zero_()
        _rows(self.values, self.end, self.end + n).zero_()
        self.keys.transpose(1, 2).index_put_((rows, positions), key_states.transpose(1, 2))
        self.values.transpose(1, 2).index_put_((rows, positions), value_states.transpose(1, 2))
        self.row_ends = [e + n for e in self.row_ends]
        self.end += n

    def _reserve(self, n: int, key_like: torch.Tensor, value_like: torch.Tensor) -> None:
        if self.keys is None or self.values is None:
            cap = self.headroom.capacity(n)
            self._set_storage(
                key_like.new_empty(*key_like.shape[:2], cap, key_like.shape[3]),
                value_like.new_empty(*value_like.shape[:2], cap, value_like.shape[3]),
            )
            self.start = self.end = 0
            return
        if self.end + n <= self.capacity:
            return
        live = len(self)
        if live + n <= self.capacity and self.start * MAX_SLIDE_CHUNKS >= live:
            self._slide_to_front()
        else:
            self._adopt(*self.live(), extra=n)

    def _slide_to_front(self) -> None:
        """Move the live rows to row 0 in place (a sliding window that reached the end of its storage).
        Chunks of `start` rows never overlap their destination, so each is one plain copy."""
        assert self.keys is not None and self.values is not None
        live, step = len(self), self.start
        for lo in range(0, live, step):
            hi = min(lo + step, live)
            _rows(self.keys, lo, hi).copy_(_rows(self.keys, self.start + lo, self.start + hi))
            _rows(self.values, lo, hi).copy_(_rows(self.values, self.start + lo, self.start + hi))
        self._shift_rows(self.start)
        self.start, self.end = 0, live

    def _shift_rows(self, by: int) -> None:
        if self.row_ends is not None:
            self.row_ends = [e - by for e in self.row_ends]

    def _adopt(self, keys: torch.Tensor, values: torch.Tensor, extra: int = 0) -> None:
        """Fresh storage holding copies of `[batch, heads, seq, dim]` `keys`/`values`, sized for `extra` more."""
        live = keys.shape[2]
        cap = self.headroom.capacity(live + extra)
        new_keys = keys.new_empty(*keys.shape[:2], cap, keys.shape[3])
        new_values = values.new_empty(*values.shape[:2], cap, values.shape[3])
        _rows(new_keys, 0, live).copy_(keys)
        _rows(new_values, 0, live).copy_(values)
        self._set_storage(new_keys, new_values)
        self._shift_rows(self.start)
        self.start, self.end = 0, live

    def drop_last(self, n: int) -> None:
        self.end -= n
        if self.row_ends is not None:
            self.row_ends = [e - n for e in self.row_ends]

    def row_lengths(self) -> list[int]:
        """Live tokens of each batch row."""
        if self.keys is None:
            return []
        if self.row_ends is None:
            return [len(self)] * self.keys.shape[0]
        return [e - self.start for e in self.row_ends]

    def drop_rows(self, counts: list[int]) -> None:
        """Drop the last `counts[b]` tokens of each row b (O(batch): only the ends move)."""
        ends = [e - c for e, c in zip(self.row_ends or [self.end] * len(counts), counts, strict=True)]
        self.end = max(ends)
        self.row_ends = None if len(set(ends)) == 1 else ends

    def set_row_lengths(self, lengths: list[int] | None) -> None:
        """Adopt per-row live lengths (a loaded or copied ragged buffer); their max is `len(self)`."""
        if lengths is None or len(set(lengths)) <= 1:
            self.row_ends = None
        else:
            self.row_ends = [self.start + n for n in lengths]

    def keep_last(self, n: int) -> None:
        """Drop all but the last `n` live tokens from the front."""
        self.start = max(self.start, self.end - n)

    def shrink(self) -> None:
        """Give back storage when far more is held than the live tokens need (after a big crop or
        a long prefill into a window). The threshold (2x of a fresh allocation) leaves room so it
        never alternates with a regrowth."""
        if self.keys is None or self.values is None:
            return
        if self.capacity > 2 * self.headroom.capacity(len(self)):
            self._adopt(*self.live())

    def index_batch(self, index: torch.Tensor) -> None:
        """Replace the batch dimension by `live[index]` (fresh storage, with headroom)."""
        if self.keys is None or self.values is None:
            return
        if self.row_ends is not None:
            ends = [self.row_ends[i] for i in index.tolist()]
            self.row_ends = None if len(set(ends)) <= 1 else ends
            if ends and self.row_ends is None:
                self.end = ends[0]  # the kept rows all end here: what lies past it is stale
        index = index.to(self.keys.device)
        live_keys, live_values = self.live()
        self._adopt(live_keys.index_select(0, index), live_values.index_select(0, index))

    def nbytes(self) -> int:
        """Bytes of storage held (capacity, not just live tokens)."""
        if self.keys is None or self.values is None:
            return 0
        return self.keys.nbytes + self.values.nbytes
