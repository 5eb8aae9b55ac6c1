"""Quantized full-attention keys/values with exact rollback (int8, int4 or int2; keys per channel
in blocks of tokens, as KIVI quantizes them, or per token as values are: see `quant`).

Tokens are quantized in blocks of `residual` tokens at fixed absolute positions, each block once
it is whole: with `N` tokens held by the shortest row, the first `Q(N) = N // residual * residual`
are quantized and the rest, the block being filled (0 to `residual - 1` tokens), stay in full
precision (KIVI's residual). A token's quantized form depends on its block alone (`quant`), so the
layer's content is a function of the tokens it holds: how they arrived (one per step, a chunk at
once, across a crop) does not matter, and `crop(-n)` is exactly "as if never added": the
quantized part is cut to `Q(N - n)` and the tokens it gives back come from their full-precision
copies. And since a store boundary at a multiple of `residual` holds no full-precision token, a
prefix store entry is quantized data alone.

Those copies are what rollback needs: while recording, the full-precision copies of tokens
quantized since the commit point are kept (`residual - 1 + r` full-precision tokens at most for `r`
recorded ones, as a sliding window keeps `W - 1 + r`); while not recording only the residual is. A
crop may reach back as long as every token it returns to full precision has its copy. Rows of a
batch share the quantized part (set by the shortest row) and hold their own full-precision tails,
so per-row crops move only each row's end; a longer row still sees its own whole blocks quantized
(from their copies), so what a row sees does not depend on how far the others got.

Attention gets full-precision keys/values: what was quantized before the update dequantized, then
everything after it, the update's own tokens included, in full precision (as KIVI attends a
prefill in full precision), so a verify forward of several tokens sees its first token's past as
a single decode step would. A forward of one row across several blocks may take them all at once
(`update_blocks`): the blocks before the first query's dequantized, then everything from it in full
precision, for a mask that shows each query what its block's one-token steps would see.
"""

from __future__ import annotations

from typing import Any

import torch
from typing_extensions import Self

from ..errors import CacheInputError
from ..validation import check_move, check_positive_int, check_query_length
from .base import CacheLayer, register_layer
from .kv_buffer import KVBuffer
from .quant import (
    check_groups,
    check_quant,
    dequantize,
    dequantize_channels,
    groups_of,
    quantize,
    quantize_channels,
)
from .quantized_state import quantize_due, restore, saved_meta, saved_tensors
from .quantized_view import rows_ahead, seen_as_alone

#: Tokens per block (keys per channel share scales within one): 16 measured better than 32 on the bundled
#: model at int4 and int2 (benchmarks/quantized.py), and makes the prefix store's 16-token chunks whole blocks.
DEFAULT_RESIDUAL = 16


@register_layer
class QuantizedLayer(CacheLayer):
    """Every key/value seen, quantized to `bits` (8, 4 or 2) by blocks of `residual` tokens, except
    the block being filled (module docstring). Keys and values are each quantized per channel,
    one scale and zero point per channel and block (`key_groups`/`value_groups="channel"`, the
    defaults: KIVI's scheme for keys; for values too, measured better than per token at every
    width on the bundled model and the random ones in `benchmarks/quantized.py`, at 0.19 more
    bytes per value than groups of 64) or per token in groups of `group_size` along head_dim
    (`"token"`: KIVI's scheme for values)."""

    crops_rows = True

    def __init__(self, bits: int = 8, group_size: int = 64, residual: int = DEFAULT_RESIDUAL,
                 key_groups: str = "channel", value_groups: str = "channel") -> None:  # fmt: skip
        super().__init__()
        self.bits, self.group_size = check_quant(bits, group_size)
        self.residual = check_positive_int(residual, "residual")
        self.key_groups = check_groups(key_groups, "key_groups")
        self.value_groups = check_groups(value_groups, "value_groups")
        self._reset()

    def _reset(self) -> None:
        self._fp = KVBuffer()  # full-precision tokens [fp_start, end of each row)
        self._q = KVBuffer()  # quantized data of tokens [q_start, quantized)
        self._p = KVBuffer()  # their scales and zero points
        self._fp_start = self._q_start = self._quantized = 0
        self._group = 0

    @property
    def _name(self) -> str:
        return type(self).__name__

    # ------------------------------------------------------------------------- lengths
    def row_lengths(self) -> list[int]:
        return [self._fp_start + n for n in self._fp.row_lengths()]

    def _longest(self) -> int:
        return self._fp_start + len(self._fp)

    def _shortest(self) -> int:
        return min(self.row_lengths(), default=0)

    def _target(self, shortest: int) -> int:
        """Tokens quantized when the shortest row holds `shortest`."""
        return shortest // self.residual * self.residual

    def get_seq_length(self) -> int:
        return self._longest()

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        query_length = check_query_length(query_length)
        return self._longest() + query_length, 0

    @property
    def is_ragged(self) -> bool:
        return self._fp.row_ends is not None

    @property
    def batch_size(self) -> int | None:
        return self._fp.batch_size

    # -------------------------------------------------------------------------- update
    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self._check_update(key_states, value_states)
        visible = self._first_visible()
        seen = self._quantized  # the update's tokens and the residual before them are seen in full precision
        ahead = rows_ahead(self) if self.is_ragged else {}
        self._fp.append(key_states, value_states)
        self._quantize()
        returned = self._assemble(visible, seen)
        if ahead:
            seen_as_alone(self, returned, visible, seen, ahead)
        self._evict()  # after: the queries of this update see the window before them
        return returned

    def update_blocks(
        self, key_states: torch.Tensor, value_states: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, tuple[int, int, int]]:
        """`update` for a forward whose queries span several blocks (one row): the layer ends as
        `update` leaves it; returned are the keys/values every query may need, the quantized ones
        dequantized (positions `[visible, quantized)`) then the full-precision ones (`[from, end)`,
        the update's own and the residual before them), and `(visible, quantized, from)`. Query `p`
        sees the dequantized ones before its block and the full-precision ones of its block up to
        itself (`blocks_bias`): what a one-token step at `p` sees, so the forward computes at once
        what one forward per block computes (`Cache.forward_segments`)."""
        if self.is_ragged or key_states.shape[0] != 1 or self.batch_size not in (None, 1):
            raise CacheInputError(f"{self._name}.update_blocks takes one row (a batch goes by blocks)")
        self._check_update(key_states, value_states)
        visible, seen = self._first_visible(), self._quantized
        fp_from = max(seen, visible)
        if fp_from < self._fp_start:
            raise CacheInputError(f"{self._name}.update_blocks: tokens from {fp_from} are not held in full precision")
        self._fp.append(key_states, value_states)
        self._quantize()
        end, dequantized = self._longest(), max(self._quantized, visible)
        out = []
        for i, fp in enumerate(self._fp.tail(len(self._fp))):
            whole = fp.new_empty(1, fp.shape[1], dequantized - visible + end - fp_from, fp.shape[3])
            if dequantized > visible:
                self._dequantize(i, visible, dequantized, whole.narrow(2, 0, dequantized - visible))
            whole.narrow(2, dequantized - visible, end - fp_from).copy_(fp.narrow(2, fp_from - self._fp_start,
                                                                                  end - fp_from))  # fmt: skip
            out.append(whole)
        self._evict()
        return out[0], out[1], (visible, dequantized, fp_from)

    def _check_update(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Raise `CacheInputError` unless the pair can be appended (the first fixes the groups)."""
        self._fp.check(key_states, value_states, self._name)
        if not key_states.is_floating_point():
            raise CacheInputError(f"{self._name}.update takes floating-point keys/values, got {key_states.dtype}")
        if self._fp.keys is None:
            group = groups_of(key_states.shape[3], self.group_size)
            groups_of(value_states.shape[3], self.group_size)
            self._group = group

    def _first_visible(self) -> int:
        return 0

    def _settle(self) -> None:
        """Quantize what the lengths say must be, and drop what is no longer needed."""
        self._quantize()
        self._evict()

    def _quantize(self) -> None:
        due = self._due()
        if due is not None:
            self._take(*quantize_due(self, [due])[0])

    def _due(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The full-precision keys and values the lengths say must be quantized now (views), or
        None; with nothing to quantize, the count moves on at once (a window passed the tokens)."""
        target = self._target(self._shortest())
        if target <= self._quantized:
            return None
        begin = max(self._quantized, self._fp_start)
        if begin > max(self._quantized, self._q_start):  # tokens before `begin` left every window unquantized
            self._q, self._p = KVBuffer(), KVBuffer()
            self._q_start = begin
        if target <= begin:
            self._quantized = target
            return None
        lo, hi = begin - self._fp_start, target - self._fp_start
        keys, values = (t.narrow(2, lo, hi - lo) for t in self._fp.tail(len(self._fp)))
        return keys, values

    def _take(self, qk: torch.Tensor, pk: torch.Tensor, qv: torch.Tensor, pv: torch.Tensor) -> None:
        """Hold the quantized form of what `_due` gave (copied: the arguments may be views)."""
        self._q.append(qk, qv)
        self._p.append(pk, pv)
        self._quantized = max(self._quantized, self._fp_start) + qk.shape[2]  # (where `_due` began)

    @property
    def forward_block(self) -> int:  # type: ignore[override]
        """A forward's queries see the same tokens quantized only within one block."""
        return self.residual

    @property
    def _per_channel(self) -> tuple[bool, bool]:
        """Whether keys (0) and values (1) are quantized per channel in blocks of tokens."""
        return self.key_groups == "channel", self.value_groups == "channel"

    def _quantize_part(self, x: torch.Tensor, per_channel: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys or values of whole blocks (per channel) or of any tokens (per token), quantized."""
        if per_channel:
            return quantize_channels(x, self.bits, self.residual)
        return quantize(x, self.bits, self._group)

    def _read_back(self, x: torch.Tensor, per_channel: bool) -> torch.Tensor:
        """`x` quantized and dequantized (what the layer would hold of it)."""
        data, params = self._quantize_part(x, per_channel)
        if per_channel:
            return dequantize_channels(data, params, self.bits, self.residual, x.dtype)
        return dequantize(data, params, self.bits, self._group, x.dtype)

    def _block_floor(self, position: int) -> int:
        """The start of `position`'s block: tokens are dropped and kept by whole blocks when keys or
        values are quantized per channel (a block is quantized from all its tokens)."""
        return position // self.residual * self.residual if any(self._per_channel) else position

    def _held(self, i: int, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Views of the quantized data and parameters of keys (`i` 0) or values (1) that hold
        positions `[start, stop)`, and the position they start at: `start`, or its block's start when
        quantized per channel (a window may start inside a block: it is dequantized whole)."""
        first = self._block_floor(start) if self._per_channel[i] else start
        back = self._quantized - first
        return self._q.span(i, back, stop - first), self._p.span(i, back, stop - first), first

    def _dequantize_held(self, i: int, data: torch.Tensor, params: torch.Tensor, dtype: torch.dtype,
                         out: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
        """Quantized keys (`i` 0) or values (1) as `_held` gives them (whole blocks per channel),
        or several such concatenated along tokens, in `dtype` (into `out` when given)."""
        if self._per_channel[i]:
            return dequantize_channels(data, params, self.bits, self.residual, dtype, out=out)
        return dequantize(data, params, self.bits, self._group, dtype, out=out)

    def _dequantize(self, i: int, start: int, stop: int, out: torch.Tensor) -> None:
        """Quantized keys (`i` 0) or values (1) of positions `[start, stop)` into `out`."""
        bits, dtype, block = self.bits, out.dtype, self.residual
        data, params, first = self._held(i, start, stop)
        if not self._per_channel[i]:
            dequantize(data, params, bits, self._group, dtype, out=out)
            return
        if first < start:
            head = dequantize_channels(data[:, :, :block], params[:, :, :block], bits, block, dtype)
            out[:, :, : first + block - start].copy_(head[:, :, start - first :])
            data, params, out = data[:, :, block:], params[:, :, block:], out[:, :, first + block - start :]
        if data.shape[2]:
            dequantize_channels(data, params, bits, block, dtype, out=out)

    @property
    def _held_quantized(self) -> int:
        """Quantized tokens held: positions `[q_start, quantized)` (none when the window passed them)."""
        return max(self._quantized - self._q_start, 0)

    def _evict(self) -> None:
        """Drop what nothing can need any more: while not recording, the full-precision copies of
        quantized tokens."""
        if not self._recording:
            self._drop_front(self._quantized)

    def _drop_front(self, fp_from: int, q_from: int = 0) -> None:
        """Forget full-precision tokens before `fp_from` and quantized ones before `q_from`."""
        if fp_from > self._fp_start:
            self._fp.keep_last(self._longest() - fp_from)
            self._fp_start = fp_from
        if q_from > self._q_start:
            if self._q.keys is not None:
                keep = max(self._quantized - q_from, 0)
                self._q.keep_last(keep)
                self._p.keep_last(keep)
            self._q_start = q_from

    def _assemble(self, start: int, quantized: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys/values of absolute positions `[start, longest)` in full precision: the quantized
        part (up to `quantized`, all of it by default) dequantized, then the full-precision part."""
        fp_keys, fp_values = self._fp.tail(len(self._fp))
        batch, heads, _, _ = fp_keys.shape
        longest = self._longest()
        quantized = self._quantized if quantized is None else quantized
        split = max(quantized, start)
        out = []
        for i, fp in enumerate((fp_keys, fp_values)):
            whole = fp.new_empty(batch, heads, longest - start, fp.shape[3])
            if split > start:
                self._dequantize(i, start, split, whole.narrow(2, 0, split - start))
            whole.narrow(2, split - start, longest - split).copy_(fp.narrow(2, split - self._fp_start, longest - split))
            out.append(whole)
        return out[0], out[1]

    # ------------------------------------------------------------------------ rollback
    def row_rollback(self) -> list[int]:
        """A row may go back as long as every token returned to full precision has its copy:
        the shortest row must keep `fp_start` rounded up to a block (or anything while nothing
        before the full-precision part is quantized)."""
        keep = self._min_kept()
        return [max(n - keep, 0) for n in self.row_lengths()]

    def _min_kept(self) -> int:
        """The fewest tokens the shortest row may hold after a crop."""
        if not self._fp_start:
            return 0
        return -(-self._fp_start // self.residual) * self.residual  # then Q(N) >= fp_start

    @property
    def max_rollback(self) -> int:
        return min(self.row_rollback(), default=0)

    @property
    def is_croppable(self) -> bool:
        return self._recording

    def _rollback_hint(self) -> str:
        if self._recording:
            return "recording: tokens quantized before the commit point have no full-precision copy"
        return "not recording: quantized tokens keep no full-precision copy; call activate_past_recording()"

    def _remove_last(self, n: int) -> None:
        self._fp.drop_last(n)
        self._unquantize()

    def _remove_rows(self, counts: list[int]) -> None:
        self._fp.drop_rows(counts)
        self._unquantize()

    def _unquantize(self) -> None:
        """After a crop: the quantized part back to what the new lengths quantize (the tokens it
        returns are in full precision already), then whatever the new lengths quantize more."""
        target = self._target(self._shortest())
        if target < self._quantized:
            drop = self._held_quantized - max(target - self._q_start, 0)
            if drop:
                self._q.drop_last(drop)
                self._p.drop_last(drop)
            self._quantized = target
        self._settle()

    def _commit(self) -> None:
        self._recording, recording = False, self._recording
        self._evict()  # as a layer that is not recording holds it
        self._recording = recording
        for buffer in (self._fp, self._q, self._p):
            buffer.shrink()

    def reset(self) -> None:
        self._reset()

    # --------------------------------------------------------------------------- batch
    def _index_batch(self, index: torch.Tensor) -> None:
        for buffer in (self._fp, self._q, self._p):
            buffer.index_batch(index)
        self._settle()  # the shortest kept row may quantize more

    def nbytes(self) -> int:
        """Bytes of storage held (quantized data, scales and zero points, full-precision tokens)."""
        return self._fp.nbytes() + self._q.nbytes() + self._p.nbytes()

    def to(self, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> Self:
        """Move to `device` and cast the full-precision tokens to `dtype` (quantized data and its
        scales keep their types); in place, returns the layer."""
        device, dtype = check_move(device, dtype)
        moved = {name: t.to(device=device, dtype=dtype if name in ("keys", "values") else None)
                 for name, t in self.state.items()}  # fmt: skip
        self.__dict__.update(type(self).from_state(self.meta_state, moved).__dict__)
        return self

    def copy(self) -> Self:
        return type(self).from_state(self.meta_state, self.state)

    # ---------------------------------------------------------------------- persistence
    @property
    def state(self) -> dict[str, torch.Tensor]:
        return saved_tensors(self)

    @property
    def meta_state(self) -> dict[str, Any]:
        return saved_meta(self)

    @classmethod
    def _params(cls, meta_state: dict[str, Any]) -> dict[str, Any]:
        if "key_groups" not in meta_state:
            raise CacheInputError(f"{cls.__name__} saved by an earlier kvcache: quantized layers are laid out "
                                  "differently since per-channel keys; create the cache again")  # fmt: skip
        params = {k: meta_state.get(k) for k in ("bits", "group_size", "residual", "key_groups")}
        return {**params, "value_groups": meta_state.get("value_groups", "token")}  # saved before: per token

    @classmethod
    def from_state(cls, meta_state: dict[str, Any], state: dict[str, torch.Tensor]) -> Self:
        return restore(cls(**cls._params(meta_state)), meta_state, state)
