"""A server batch's quantized attention layer: one batch-1 quantized layer per request.

A quantized layer quantizes by blocks at fixed positions, and a batch's rows share its quantized
part (`layers.quantized`); in a server's right-aligned batch, rows start at different physical
slots, so a shared layer would cut each request's blocks where its padding puts them, and a
request's answer would depend on who it was batched with. Here each row keeps its own layer of
its real tokens, quantized exactly as when the request runs alone, and the batch sees them laid
out as its other layers are: row b's tokens after its `pads[b]` padding slots (zeros, masked).
A decode step costs one small update per row; joins and leaves move whole row layers, no copy.
"""

from __future__ import annotations

from typing import Any

import torch
from typing_extensions import Self

from ..errors import CacheInputError
from ..layers.base import LAYER_REGISTRY, CacheLayer
from ..layers.quantized import QuantizedLayer


class QuantizedRows(CacheLayer):
    """Rows of a batch, each a batch-1 `QuantizedLayer` (or quantized window) of its real tokens,
    placed after `pads[b]` padding slots."""

    crops_rows = True

    def __init__(self, rows: list[QuantizedLayer], pads: list[int]) -> None:
        super().__init__()
        if len(rows) != len(pads) or any(row.batch_size not in (None, 1) for row in rows):
            raise CacheInputError("QuantizedRows takes batch-1 quantized layers and one padding count per row")
        self.rows, self.pads = rows, list(pads)
        self.is_sliding = any(getattr(row, "is_sliding", False) for row in rows)

    # ------------------------------------------------------------------------- lengths
    def row_lengths(self) -> list[int]:
        return [pad + row.get_seq_length() for row, pad in zip(self.rows, self.pads, strict=True)]

    def get_seq_length(self) -> int:
        return max(self.row_lengths(), default=0)

    @property
    def is_ragged(self) -> bool:
        return len(set(self.row_lengths())) > 1

    @property
    def batch_size(self) -> int | None:
        return len(self.rows) or None

    def _layout(self, query_length: int) -> tuple[list[int], int, int]:
        """Where each row's returned keys start (physical slots), the first slot returned, and
        how many slots are returned, for an update of `query_length` tokens."""
        starts = [pad + row.get_mask_sizes(query_length)[1] for row, pad in zip(self.rows, self.pads, strict=True)]
        offset = min(starts, default=0) if self.is_sliding else 0
        return starts, offset, self.get_seq_length() + query_length - offset

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        _, offset, length = self._layout(query_length)
        return length, offset

    def get_max_length(self) -> int:
        return -1

    # -------------------------------------------------------------------------- update
    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if key_states.shape[0] != len(self.rows) or value_states.shape[0] != len(self.rows):
            raise CacheInputError(f"QuantizedRows.update: {key_states.shape[0]} rows of keys for a batch of "
                                  f"{len(self.rows)}")  # fmt: skip
        starts, offset, length = self._layout(key_states.shape[2])
        batch, heads = key_states.shape[:2]
        keys = key_states.new_zeros(batch, heads, length, key_states.shape[3])
        values = value_states.new_zeros(batch, heads, length, value_states.shape[3])
        for b, row in enumerate(self.rows):
            row_keys, row_values = row.update(key_states[b : b + 1], value_states[b : b + 1])
            first = starts[b] - offset
            keys[b, :, first : first + row_keys.shape[2]] = row_keys[0]
            values[b, :, first : first + row_values.shape[2]] = row_values[0]
        return keys, values

    # ------------------------------------------------------------------------ rollback
    @property
    def max_rollback(self) -> int:
        return min(self.row_rollback(), default=0)

    def row_rollback(self) -> list[int]:
        return [row.max_rollback for row in self.rows]

    @property
    def is_croppable(self) -> bool:
        return all(row.is_croppable for row in self.rows)

    def activate_past_recording(self) -> None:
        for row in self.rows:
            row.activate_past_recording()
        self._recording = True

    @property
    def record_past(self) -> bool:
        return self._recording

    @record_past.setter
    def record_past(self, value: bool) -> None:
        for row in self.rows:
            row.record_past = value
        self._recording = bool(value)

    def _remove_last(self, n: int) -> None:
        for row in self.rows:
            row.crop(-n)

    def _remove_rows(self, counts: list[int]) -> None:
        for row, n in zip(self.rows, counts, strict=True):
            if n:
                row.crop(-n)

    def _commit(self) -> None:
        for row in self.rows:
            row.crop(0)

    def reset(self) -> None:
        self.rows, self.pads = [], []

    def _index_batch(self, index: torch.Tensor) -> None:
        picked = [int(i) for i in index.tolist()]
        self.rows = [self.rows[i] if picked.count(i) == 1 else self.rows[i].copy() for i in picked]
        self.pads = [self.pads[i] for i in picked]

    def nbytes(self) -> int:
        return sum(row.nbytes() for row in self.rows)

    # ---------------------------------------------------------------------- persistence
    @property
    def state(self) -> dict[str, torch.Tensor]:
        return {f"{b}.{name}": t for b, row in enumerate(self.rows) for name, t in row.state.items()}

    @property
    def meta_state(self) -> dict[str, Any]:
        return {"pads": self.pads, "record_past": self._recording,
                "rows": [{"class": type(row).__name__, "meta_state": row.meta_state} for row in self.rows]}  # fmt: skip

    @classmethod
    def from_state(cls, meta_state: dict[str, Any], state: dict[str, torch.Tensor]) -> Self:
        rows = []
        for b, about in enumerate(meta_state.get("rows", [])):
            prefix = f"{b}."
            own = {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}
            rows.append(LAYER_REGISTRY[about["class"]].from_state(about["meta_state"], own))
        layer = cls(rows, meta_state.get("pads", []))  # type: ignore[arg-type]
        layer._recording = bool(meta_state.get("record_past", False))
        return layer
