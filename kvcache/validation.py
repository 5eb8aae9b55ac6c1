"""One validation path per kind of argument, shared by every layer and composite.

Each function takes what a caller passed and returns it in the form the caches use, or raises the
package's own error naming the argument and what was wrong. Layers and composites call these
before changing anything, in every state (empty, lazy, recording, committed).
"""

from __future__ import annotations

from typing import Any

import torch

from .errors import CacheInputError, RollbackError

#: A lazy cache builds the layers up to an index it is given; it refuses to build more than this
#: many at once (transformers' largest models have ~100 layers; a huge index is a caller's bug).
MAX_NEW_LAYERS = 4096
#: Integer dtypes accepted as batch indices (bool and uint8 index tensors mean masks to torch).
INDEX_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_layer_idx(layer_idx: Any) -> int:
    """A layer index: a non-negative int (not a bool)."""
    if not _is_int(layer_idx) or layer_idx < 0:
        raise CacheInputError(f"layer_idx must be a non-negative int, got {layer_idx!r}")
    return layer_idx


def check_query_length(query_length: Any) -> int:
    """`get_mask_sizes`' query length: a non-negative int, or a 1-D tensor of positions (its length)."""
    if isinstance(query_length, torch.Tensor):
        if query_length.dim() != 1:
            shape = tuple(query_length.shape)
            raise CacheInputError(f"query_length as a tensor must be 1-D positions, got shape {shape}")
        return query_length.shape[0]
    if not _is_int(query_length) or query_length < 0:
        raise CacheInputError(f"query_length must be a non-negative int, got {query_length!r}")
    return query_length


def crop_amount(tokens_to_remove: Any) -> int:
    """A `crop` argument: -n removes n tokens, 0 commits; returns n."""
    if not _is_int(tokens_to_remove):
        raise RollbackError(f"crop takes a non-positive int, got {tokens_to_remove!r}")
    if tokens_to_remove > 0:
        raise RollbackError(
            f"crop({tokens_to_remove}): a positive argument is not supported; "
            "pass -n to remove the last n tokens, or 0 to commit"
        )
    return -tokens_to_remove


def row_crop_amounts(tokens_to_remove: Any, batch_size: int | None) -> list[int] | None:
    """A per-row `crop` argument: a 1-D integer tensor (or list) of one non-positive count per batch
    row, `-n_b` removing the last `n_b` tokens of row b. Returns the `n_b` (host ints), or None when
    `tokens_to_remove` is a plain int (see `crop_amount`). A layer that holds nothing has no rows:
    there the counts must all be 0 (a commit)."""
    if _is_int(tokens_to_remove):
        return None
    if isinstance(tokens_to_remove, torch.Tensor):
        tensor = tokens_to_remove
        if tensor.dtype not in INDEX_DTYPES or tensor.dim() != 1 or tensor.device.type == "meta":
            raise RollbackError(
                f"a per-row crop takes a 1-D integer tensor, got {tensor.dtype} of shape {tuple(tensor.shape)}"
            )
        values = tensor.tolist()
    elif isinstance(tokens_to_remove, (list, tuple)) and all(_is_int(v) for v in tokens_to_remove):
        values = list(tokens_to_remove)
    else:
        raise RollbackError(
            f"crop takes a non-positive int or one non-positive int per batch row, got {tokens_to_remove!r}"
        )
    if any(v > 0 for v in values):
        raise RollbackError(f"crop({values}): per-row counts must be <= 0 (-n removes the last n tokens of a row)")
    if batch_size is None:
        if any(values):
            raise RollbackError(f"crop({values}): the cache holds no rows yet, so only zeros (a commit) apply")
    elif len(values) != batch_size:
        raise RollbackError(f"crop takes one count per batch row: got {len(values)} for a batch of {batch_size}")
    return [-v for v in values]


def check_row_lengths(lengths: Any, batch_size: int | None, longest: int, who: str) -> list[int] | None:
    """Saved per-row lengths of a ragged layer (`meta_state["row_lengths"]`): None (every row holds
    `longest`), or one int in `[0, longest]` per batch row, the longest exactly `longest`."""
    if lengths is None:
        return None
    if (
        not isinstance(lengths, list) or batch_size is None or len(lengths) != batch_size
        or any(not _is_int(n) or not 0 <= n <= longest for n in lengths) or max(lengths) != longest
    ):  # fmt: skip
        raise CacheInputError(
            f"{who}: 'row_lengths' must be one int in [0, {longest}] per batch row, the longest {longest}, "
            f"got {lengths!r}"
        )
    return lengths


def check_flag(value: Any, name: str) -> bool:
    """A bool (a string such as "false" would otherwise read as true)."""
    if not isinstance(value, bool):
        raise CacheInputError(f"{name} must be True or False, got {value!r}"[:200])
    return value


def check_positive_int(value: Any, name: str) -> int:
    """`value` as an int >= 1 (not a bool), else `CacheInputError` naming it `name`."""
    if not _is_int(value) or value < 1:
        raise CacheInputError(f"{name} must be a positive int, got {value!r}"[:200])
    return int(value)


def check_repeats(repeats: Any) -> int:
    """A `batch_repeat_interleave` argument: a positive int."""
    return check_positive_int(repeats, "repeats")


def check_batch_index(index: Any, name: str, batch_size: int | None) -> torch.Tensor:
    """A batch index (`reorder_cache`, `batch_select_indices`): a 1-D integer tensor (or list) of rows
    in `[0, batch_size)`, returned as int64. Bool and uint8 tensors are refused: torch would read
    them as masks."""
    if isinstance(index, torch.Tensor):
        tensor = index
    else:
        if isinstance(index, (str, bytes)) or index is None:
            raise CacheInputError(f"{name} must be a 1-D integer tensor, got {type(index).__name__}")
        try:
            tensor = torch.as_tensor(index)
        except (TypeError, ValueError, RuntimeError, OverflowError) as exc:
            raise CacheInputError(f"{name} must be a 1-D integer tensor, got {type(index).__name__}") from exc
        if tensor.numel() == 0:
            tensor = tensor.long()
    if tensor.dtype not in INDEX_DTYPES or tensor.dim() != 1:
        hint = " (a mask? pass the row numbers, e.g. mask.nonzero().squeeze(1))" if tensor.dtype in (
            torch.bool, torch.uint8) else ""  # fmt: skip
        raise CacheInputError(
            f"{name} must be a 1-D integer tensor, got {tensor.dtype} of shape {tuple(tensor.shape)}{hint}"
        )
    if tensor.device.type == "meta":
        raise CacheInputError(f"{name} is on the meta device: it holds no row numbers")
    tensor = tensor.to(torch.long)
    if batch_size is not None and tensor.numel():
        low, high = int(tensor.min()), int(tensor.max())
        if low < 0 or high >= batch_size:
            raise CacheInputError(f"{name} holds values outside [0, {batch_size}) (batch size of the cache)")
    return tensor


def check_move(device: Any, dtype: Any) -> tuple[torch.device | None, torch.dtype | None]:
    """Arguments of `to(device=, dtype=)`: a device torch knows (and can allocate on) and a
    floating-point dtype, each or both None."""
    target = None
    if device is not None:
        try:
            target = torch.device(device)
            torch.empty(0, device=target)
        except (RuntimeError, TypeError, ValueError, AssertionError) as err:
            raise CacheInputError(f"cannot move a cache to device {device!r}: {err}") from None
    if dtype is not None and (not isinstance(dtype, torch.dtype) or not dtype.is_floating_point):
        raise CacheInputError(f"dtype must be a floating-point torch.dtype, got {dtype!r}")
    return target, dtype
