"""One model layer with both attention and conv/recurrent states (parallel hybrids, e.g. Falcon-H1)."""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from typing_extensions import Self

from ..errors import CacheInputError
from ..validation import check_flag
from .base import LAYER_REGISTRY, CacheLayer, register_layer


@register_layer
class HybridLayer(CacheLayer):
    """An attention layer and a recurrent layer under one layer index, by composition.

    Attention calls (`update`, `get_mask_sizes`, ...) go to `attention`, conv/recurrent calls to
    `recurrent`. Rollback and batch operations act on both and are checked on both before either
    changes, so any attention layer kind pairs with a recurrent layer without a class per pairing.
    """

    has_attention = True
    has_recurrent = True

    def __init__(self, attention: CacheLayer, recurrent: CacheLayer) -> None:
        if not isinstance(attention, CacheLayer) or not attention.has_attention or attention.has_recurrent:
            raise CacheInputError(f"HybridLayer: attention must be an attention-only CacheLayer, got {attention!r}")
        if not isinstance(recurrent, CacheLayer) or recurrent.has_attention or not recurrent.has_recurrent:
            raise CacheInputError(
                f"HybridLayer: recurrent must be a RecurrentLayer or StaticRecurrentLayer, got {recurrent!r}"
            )
        super().__init__()
        self.attention = attention
        self.recurrent = recurrent
        self._recording = attention.record_past and recurrent.record_past
        if attention.record_past != recurrent.record_past:
            raise CacheInputError("HybridLayer: the attention and recurrent parts disagree on recording")

    @property
    def is_sliding(self) -> bool:  # type: ignore[override]
        return self.attention.is_sliding

    @property
    def is_compileable(self) -> bool:  # type: ignore[override]
        return self.attention.is_compileable and self.recurrent.is_compileable

    # ------------------------------------------------------------------------------ attention
    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.attention.update(key_states, value_states, *args, **kwargs)

    @property
    def keys(self) -> torch.Tensor | None:
        return getattr(self.attention, "keys", None)

    @property
    def values(self) -> torch.Tensor | None:
        return getattr(self.attention, "values", None)

    def get_seq_length(self) -> int:
        return self.attention.get_seq_length()

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.attention.get_mask_sizes(query_length)

    def get_max_length(self) -> int:
        return self.attention.get_max_length()

    # ------------------------------------------------------------------------------ recurrent
    def update_conv_state(self, conv_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self.recurrent.update_conv_state(conv_states, *args, **kwargs)

    def update_recurrent_state(self, recurrent_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self.recurrent.update_recurrent_state(recurrent_states, *args, **kwargs)

    def get_conv_state(self, state_idx: int = 0) -> torch.Tensor | None:
        return self.recurrent.get_conv_state(state_idx)

    def get_recurrent_state(self, state_idx: int = 0) -> torch.Tensor | None:
        return self.recurrent.get_recurrent_state(state_idx)

    def increase_count(self, state_idx: int = 0) -> None:
        self.recurrent.increase_count(state_idx)

    def open_step_tokens(self, state_idx: int = 0) -> int | None:
        return self.recurrent.open_step_tokens(state_idx)  # type: ignore[no-any-return]

    def has_previous_state(self, state_idx: int | None = None) -> bool:
        return self.recurrent.has_previous_state(state_idx)

    # ------------------------------------------------------------------------------ rollback
    @property
    def record_past(self) -> bool:
        return self._recording

    @record_past.setter
    def record_past(self, value: bool) -> None:
        check_flag(value, "record_past")
        self.attention.record_past = value
        self.recurrent.record_past = value
        self._recording = bool(value)

    def activate_past_recording(self) -> None:
        self.attention.activate_past_recording()
        self.recurrent.activate_past_recording()
        self._recording = True

    @property
    def max_rollback(self) -> int:
        return min(self.attention.max_rollback, self.recurrent.max_rollback)

    @property
    def is_croppable(self) -> bool:
        return self.attention.is_croppable and self.recurrent.is_croppable

    @property
    def forward_block(self) -> int | None:  # type: ignore[override]
        return self.attention.forward_block

    def forward_cuts(self, length: int) -> set[int]:
        return self.attention.forward_cuts(length)

    def check_crop(self, tokens_to_remove: Any) -> None:
        self.attention.check_crop(tokens_to_remove)
        self.recurrent.check_crop(tokens_to_remove)

    def row_lengths(self) -> list[int]:
        return self.attention.row_lengths()

    def row_rollback(self) -> list[int]:
        return [min(a, r) for a, r in zip(self.attention.row_rollback(), self.recurrent.row_rollback(), strict=True)]

    @property
    def is_ragged(self) -> bool:
        return self.attention.is_ragged

    def crop(self, tokens_to_remove: Any) -> None:
        if type(tokens_to_remove) is int and tokens_to_remove == 0:
            self._commit()
            return
        self.check_crop(tokens_to_remove)
        self.attention.crop(tokens_to_remove)
        self.recurrent.crop(tokens_to_remove)

    def _remove_last(self, n: int) -> None:
        self.crop(-n)

    def _commit(self) -> None:
        self.attention.crop(0)
        self.recurrent.crop(0)

    # ------------------------------------------------------------------------- batch / misc
    def reset(self) -> None:
        self.attention.reset()
        self.recurrent.reset()

    @property
    def batch_size(self) -> int | None:
        sizes = {self.attention.batch_size, self.recurrent.batch_size} - {None}
        if len(sizes) > 1:
            raise CacheInputError(f"HybridLayer: attention and recurrent parts disagree on batch size {sorted(sizes)}")
        return next(iter(sizes), None)

    def _index_batch(self, index: torch.Tensor) -> None:
        self.attention._index_batch(index)
        self.recurrent._index_batch(index)

    def nbytes(self) -> int:
        return sum(getattr(part, "nbytes", lambda: 0)() for part in (self.attention, self.recurrent))

    # --------------------------------------------------------------------------- persistence
    @property
    def state(self) -> dict[str, torch.Tensor]:
        out = {f"attention.{k}": v for k, v in self.attention.state.items()}
        out.update({f"recurrent.{k}": v for k, v in self.recurrent.state.items()})
        return out

    @property
    def meta_state(self) -> dict[str, Any]:
        return {
            "attention": {"class": type(self.attention).__name__, "meta_state": self.attention.meta_state},
            "recurrent": {"class": type(self.recurrent).__name__, "meta_state": self.recurrent.meta_state},
        }

    @classmethod
    def from_state(cls, meta_state: dict[str, Any], state: dict[str, torch.Tensor]) -> Self:
        return cls._rebuild(meta_state, state, adopt=False)

    @classmethod
    def adopt_state(cls, meta_state: dict[str, Any], state: dict[str, torch.Tensor]) -> Self:
        return cls._rebuild(meta_state, state, adopt=True)

    @classmethod
    def load_target(cls, meta_state: dict[str, Any], name: str, shape: list[int], dtype: torch.dtype) -> torch.Tensor:
        part, _, rest = name.partition(".")
        if part in ("attention", "recurrent"):
            with contextlib.suppress(CacheInputError):
                layer_cls, meta = cls._part(meta_state, part)
                return layer_cls.load_target(meta, rest, shape, dtype)
        return super().load_target(meta_state, name, shape, dtype)

    @classmethod
    def _part(cls, meta_state: dict[str, Any], part: str) -> tuple[type[CacheLayer], dict[str, Any]]:
        """The class and meta_state of one part, as `meta_state` describes it."""
        entry = meta_state.get(part) if isinstance(meta_state, dict) else None
        if not isinstance(entry, dict) or not isinstance(entry.get("meta_state"), dict):
            raise CacheInputError(f"HybridLayer.from_state: meta_state[{part!r}] must hold 'class' and 'meta_state'")
        layer_cls = LAYER_REGISTRY.get(entry.get("class"))  # type: ignore[arg-type]
        if layer_cls is None or layer_cls is cls:
            raise CacheInputError(f"HybridLayer.from_state: {part} class {entry.get('class')!r} is not allowed")
        return layer_cls, entry["meta_state"]

    @classmethod
    def _rebuild(cls, meta_state: dict[str, Any], state: dict[str, torch.Tensor], adopt: bool) -> Self:
        parts: dict[str, CacheLayer] = {}
        for part in ("attention", "recurrent"):
            layer_cls, meta = cls._part(meta_state, part)
            prefix = f"{part}."
            part_state = {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}
            build = layer_cls.adopt_state if adopt else layer_cls.from_state
            parts[part] = build(meta, part_state)
        unknown = [k for k in state if not k.startswith(("attention.", "recurrent."))]
        if unknown:
            raise CacheInputError(f"HybridLayer.from_state: unexpected tensors {sorted(unknown)}")
        return cls(parts["attention"], parts["recurrent"])  # type: ignore[arg-type]

    def __repr__(self) -> str:
        return f"HybridLayer({self.attention!r}, {self.recurrent!r})"
