"""A layer that holds nothing: model layers without a cache (MoE/MLP-only layers, KV-shared layers
that read another layer's keys), transformers' "dummy" layer type."""

from __future__ import annotations

from typing import Any

import torch
from typing_extensions import Self

from ..errors import CacheInputError
from ..validation import crop_amount, row_crop_amounts
from .base import CacheLayer, register_layer


@register_layer
class EmptyLayer(CacheLayer):
    """Keeps a composite's indices aligned with the model's layers; holds no tokens and no state.

    Every rollback is trivially exact, so it never limits the composite's `max_rollback`
    (`holds_tokens` is False) and any valid `crop` succeeds. An `update` is refused: model code
    that calls one has a real layer here.
    """

    has_attention = False
    is_compileable = True
    #: Composites leave layers without tokens out of `max_rollback` and `is_croppable`.
    holds_tokens = False

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        raise CacheInputError("EmptyLayer holds no keys/values: this model layer has no cache (a 'dummy' layer type)")

    def get_seq_length(self) -> int:
        return 0

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        raise CacheInputError("EmptyLayer holds no keys/values, so it has no attention mask sizes")

    @property
    def max_rollback(self) -> int:
        return 0

    @property
    def is_croppable(self) -> bool:
        return True

    def check_crop(self, tokens_to_remove: Any) -> None:
        """Any well-formed amount, per row or not: there is nothing to remove."""
        if isinstance(tokens_to_remove, int):
            crop_amount(tokens_to_remove)
        else:
            rows = tokens_to_remove.numel() if isinstance(tokens_to_remove, torch.Tensor) else None
            if rows is None and isinstance(tokens_to_remove, (list, tuple)):
                rows = len(tokens_to_remove)
            row_crop_amounts(tokens_to_remove, rows)

    def crop(self, tokens_to_remove: Any) -> None:
        self.check_crop(tokens_to_remove)

    def _remove_last(self, n: int) -> None:
        pass

    def _commit(self) -> None:
        pass

    def reset(self) -> None:
        pass

    @property
    def batch_size(self) -> int | None:
        return None

    def _index_batch(self, index: torch.Tensor) -> None:
        pass

    @property
    def state(self) -> dict[str, torch.Tensor]:
        return {}

    @property
    def meta_state(self) -> dict[str, Any]:
        return {"record_past": self._recording}

    @classmethod
    def from_state(cls, meta_state: dict[str, Any], state: dict[str, torch.Tensor]) -> Self:
        if state or set(meta_state) != {"record_past"} or not isinstance(meta_state["record_past"], bool):
            raise CacheInputError(f"EmptyLayer: holds no tensors and only 'record_past', got {sorted(meta_state)}")
        layer = cls()
        layer._recording = meta_state["record_past"]
        return layer
