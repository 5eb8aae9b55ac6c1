"""The contract every cache layer implements, and the registry persistence builds layers from."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from typing import Any, ClassVar

import torch
from typing_extensions import Self

from ..errors import CacheInputError, RollbackError
from ..validation import check_batch_index, check_flag, check_move, check_repeats, crop_amount, row_crop_amounts

#: Every concrete layer class by its name. Loading a file builds only classes found here.
LAYER_REGISTRY: dict[str, type[CacheLayer]] = {}


def register_layer(cls: type[CacheLayer]) -> type[CacheLayer]:
    """Class decorator: make `cls` constructible by name from a saved file."""
    LAYER_REGISTRY[cls.__name__] = cls
    return cls


class CacheLayer(ABC):
    """What one model layer's past tokens left behind, with exact rollback (docs/contract.md).

    Subclasses keep their content in tensors named by `state` and their parameters and bookkeeping
    in the JSON-able `meta_state`; `from_state` rebuilds an identical layer from the two. That one
    idea serves saving, loading and copying.
    """

    #: The layer drops old tokens (sliding window attention).
    is_sliding: ClassVar[bool] = False
    #: Fixed shapes and addresses: safe to capture in `torch.compile` / CUDA graphs.
    is_compileable: ClassVar[bool] = False
    #: The layer holds keys/values (answers `update`, `get_mask_sizes`).
    has_attention: ClassVar[bool] = True
    #: The layer holds conv/recurrent states (answers `update_conv_state` ...).
    has_recurrent: ClassVar[bool] = False
    #: The layer holds tokens at all (an `EmptyLayer` does not, and never limits rollback).
    holds_tokens: ClassVar[bool] = True
    #: `crop` takes different counts per batch row (`_remove_rows`, `row_rollback`).
    crops_rows: ClassVar[bool] = False
    #: Forwards must not cross multiples of this many tokens (quantized layers' blocks: see
    #: `Cache.forward_segments`); None: any forward.
    forward_block: int | None = None

    def __init__(self) -> None:
        self._recording = False

    # ----------------------------------------------------------------------------------- growth
    @abstractmethod
    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append `[batch, kv_heads, n, head_dim]` keys/values; return what attention must see."""

    @abstractmethod
    def get_seq_length(self) -> int:
        """Number of tokens this layer has seen (and not rolled back)."""

    @abstractmethod
    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        """`(kv_length, kv_offset)` of the keys the next `update` of `query_length` tokens returns."""

    def get_max_length(self) -> int:
        """Most tokens the layer can hold; -1 when unbounded."""
        return -1

    def forward_cuts(self, length: int) -> set[int]:
        """Where a forward of `length` new tokens must be cut (offsets into it) so that no row
        crosses a boundary of its `forward_block`s inside one piece (`Cache.forward_segments`)."""
        block = self.forward_block
        if not block:
            return set()
        pasts = self.row_lengths() if self.is_ragged else [self.get_seq_length()]
        return {end - past for past in pasts for end in range((past // block + 1) * block, past + length, block)}

    # --------------------------------------------------------------------------------- rollback
    @property
    def record_past(self) -> bool:
        """Whether the layer keeps what rollback needs. Setting it False commits and stops recording."""
        return self._recording

    @record_past.setter
    def record_past(self, value: bool) -> None:
        if check_flag(value, "record_past"):
            self.activate_past_recording()
        elif self._recording:
            self._commit()
            self._recording = False

    def activate_past_recording(self) -> None:
        """Keep what rollback needs from now on; now becomes the commit point."""
        if not self._recording:
            self._commit()
            self._recording = True

    @property
    @abstractmethod
    def max_rollback(self) -> int:
        """How many of the most recent tokens `crop` can remove exactly right now."""

    @property
    def is_croppable(self) -> bool:
        """True when every step taken since the commit point can be undone exactly.

        Layers that keep all their tokens anyway are always croppable; the others while recording.
        """
        return self._recording

    def check_crop(self, tokens_to_remove: int | torch.Tensor | list[int]) -> None:
        """Raise `RollbackError` unless `crop(tokens_to_remove)` would succeed exactly."""
        counts = row_crop_amounts(tokens_to_remove, self.batch_size)
        if counts is not None:
            self._check_rows(counts)
            return
        n = crop_amount(tokens_to_remove)
        if n > self.max_rollback:
            rows = f"; rows hold {self.row_lengths()}, a uniform crop takes n from each" if self.is_ragged else ""
            raise RollbackError(
                f"{type(self).__name__} cannot remove {n} token(s): at most {self.max_rollback} "
                f"can be rolled back now ({self._rollback_hint()}{rows})"
            )

    def crop(self, tokens_to_remove: int | torch.Tensor | list[int]) -> None:
        """`crop(-n)` removes the last n tokens exactly; `crop(0)` commits. A 1-D tensor (or list) of
        one `-n_b` per batch row removes the last `n_b` tokens of each row b (docs/contract.md,
        "Per-row rollback"). Failing crops change nothing."""
        if type(tokens_to_remove) is int and tokens_to_remove == 0:  # a commit: always possible, once per step
            self._commit()
            return
        counts = row_crop_amounts(tokens_to_remove, self.batch_size)
        if counts is None:
            self.check_crop(tokens_to_remove)
            if tokens_to_remove == 0:
                self._commit()
            else:
                self._remove_last(-tokens_to_remove)  # type: ignore[operator]
            return
        self._check_rows(counts)
        if len(set(counts)) <= 1:
            self.crop(-counts[0] if counts else 0)
        else:
            self._remove_rows(counts)

    def _check_rows(self, counts: list[int]) -> None:
        """Raise `RollbackError` unless row b can lose its last `counts[b]` tokens exactly."""
        if len(set(counts)) <= 1:
            self.check_crop(-counts[0] if counts else 0)
            return
        if not self.crops_rows:
            raise RollbackError(
                f"{type(self).__name__} cannot crop batch rows by different counts (got {counts}); "
                "its fixed-shape storage is shared by all rows"
            )
        lengths = self.row_lengths()
        reach = self.row_rollback()
        for row, (n, length, most) in enumerate(zip(counts, lengths, reach, strict=True)):
            if n > most:
                raise RollbackError(
                    f"{type(self).__name__} cannot remove {n} token(s) from row {row} (of {length}): at most "
                    f"{most} can be rolled back there now ({self._rollback_hint()})"
                )

    def row_lengths(self) -> list[int]:
        """Tokens each batch row holds (as `get_seq_length` counts them; rows differ after a per-row
        crop). Empty before the first update."""
        return [self.get_seq_length()] * (self.batch_size or 0)

    def row_rollback(self) -> list[int]:
        """Per row, how many of its most recent tokens a per-row crop can remove."""
        return [self.max_rollback] * (self.batch_size or 0)

    @property
    def is_ragged(self) -> bool:
        """Whether batch rows hold different numbers of tokens (after a per-row crop)."""
        return False

    def _remove_rows(self, counts: list[int]) -> None:
        """Drop the last `counts[b]` tokens of each row b (checked; at least two counts differ)."""
        raise RollbackError(f"{type(self).__name__} cannot crop batch rows by different counts")

    def _rollback_hint(self) -> str:
        return "recording" if self._recording else "not recording"

    @abstractmethod
    def _remove_last(self, n: int) -> None:
        """Drop the last `n` tokens (already checked to be possible)."""

    @abstractmethod
    def _commit(self) -> None:
        """Forget rollback history and shrink to the minimal working size."""

    # ----------------------------------------------------------------------------- batch / misc
    @abstractmethod
    def reset(self) -> None:
        """Forget every token; keep parameters (window, max length, recording flag)."""

    @property
    @abstractmethod
    def batch_size(self) -> int | None:
        """Batch size of what the layer holds, or None before the first update."""

    @abstractmethod
    def _index_batch(self, index: torch.Tensor) -> None:
        """Replace the batch dimension of every held tensor by `tensor[index]`."""

    def reorder_cache(self, beam_idx: torch.Tensor) -> None:
        """Reorder the batch for beam search: row i becomes old row `beam_idx[i]`."""
        self._index_batch(self.check_batch_index(beam_idx, "beam_idx"))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep only the batch rows `indices`."""
        self._index_batch(self.check_batch_index(indices, "indices"))

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Repeat every batch row `repeats` times in place (row order 0,0,1,1,...)."""
        check_repeats(repeats)
        if self.batch_size is not None:
            self._index_batch(torch.arange(self.batch_size).repeat_interleave(repeats))

    def check_batch_index(self, index: Any, name: str) -> torch.Tensor:
        """Validate a 1-D integer batch index against the held batch size; return it as int64."""
        return check_batch_index(index, name, self.batch_size)

    # ------------------------------------------------------------------------------ persistence
    @property
    @abstractmethod
    def state(self) -> dict[str, torch.Tensor]:
        """The tensors that hold the layer's content (views; clone before mutating)."""

    @property
    @abstractmethod
    def meta_state(self) -> dict[str, Any]:
        """JSON-able parameters and bookkeeping; with `state`, enough to rebuild the layer."""

    @classmethod
    @abstractmethod
    def from_state(cls, meta_state: dict[str, Any], state: dict[str, torch.Tensor]) -> Self:
        """Rebuild a layer from `meta_state` and `state`; raise `CacheInputError` when they disagree."""

    @classmethod
    def adopt_state(cls, meta_state: dict[str, Any], state: dict[str, torch.Tensor]) -> Self:
        """`from_state` for a caller that gives `state`'s tensors up (`load_cache`): the layer may keep
        them, and the storage they view, instead of copying them."""
        return cls.from_state(meta_state, state)

    @classmethod
    def load_target(cls, meta_state: dict[str, Any], name: str, shape: list[int], dtype: torch.dtype) -> torch.Tensor:
        """Uninitialised CPU memory of `shape` and `dtype` for a loader to read tensor `name` into before
        `adopt_state`: a layer that adopts may hand out a view of the storage it will keep (with room
        to grow), so a loaded tensor is copied once, by the read itself."""
        return torch.empty(check_target(shape, dtype, cls.__name__), dtype=dtype)

    @classmethod
    def planned_nbytes(cls, meta_state: dict[str, Any], state: dict[str, torch.Tensor]) -> int:
        """Bytes `from_state(meta_state, state)` will allocate beyond copies of `state` (a loader
        bounds this before building, so a small file cannot ask for huge buffers)."""
        return 0

    def copy(self) -> Self:
        """An independent copy that shares no mutable tensor with this layer."""
        return type(self).from_state(self.meta_state, {k: v.clone() for k, v in self.state.items()})

    def __deepcopy__(self, memo: dict[int, Any]) -> Self:
        return self.copy()

    def to(self, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> Self:
        """Move the layer's tensors to `device` and/or cast its floating-point tensors to `dtype`, in
        place (rollback history included); returns the layer. Later updates must match."""
        device, dtype = check_move(device, dtype)
        moved = {
            name: t.to(device=device, dtype=dtype if t.is_floating_point() else None) for name, t in self.state.items()
        }
        self.__dict__.update(type(self).from_state(self.meta_state, moved).__dict__)
        return self

    def __repr__(self) -> str:
        params = ", ".join(f"{k}={v}" for k, v in self.meta_state.items())
        return f"{type(self).__name__}({params})"


def check_target(shape: Any, dtype: Any, who: str) -> list[int]:
    """`load_target`'s arguments: a list of non-negative ints and a torch dtype (`CacheInputError` else)."""
    if not isinstance(shape, (list, tuple)) or not all(type(n) is int and n >= 0 for n in shape):
        raise CacheInputError(f"{who}.load_target: shape must be a list of non-negative ints, got {shape!r}"[:300])
    if not isinstance(dtype, torch.dtype):
        raise CacheInputError(f"{who}.load_target: dtype must be a torch.dtype, got {dtype!r}")
    return list(shape)


def index_layers_batch(layers: Iterable[CacheLayer], index: Any, name: str) -> None:
    """Apply a batch index to every layer, after checking it against all of them (so a bad index
    changes nothing anywhere; an empty composite checks its form all the same)."""
    layers = list(layers)
    check_batch_index(index, name, None)
    checked = [layer.check_batch_index(index, name) for layer in layers]
    for layer, idx in zip(layers, checked, strict=True):
        layer._index_batch(idx)
