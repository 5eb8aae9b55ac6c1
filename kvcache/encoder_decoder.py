"""Encoder-decoder caches: a grown, recorded and cropped self-attention part and a write-once cross part."""

from __future__ import annotations

from typing import Any

import torch
from typing_extensions import Self

from .cache import Cache
from .errors import CacheInputError, KVCacheError
from .layers.base import CacheLayer, index_layers_batch
from .validation import check_move, check_repeats


class EncoderDecoderCache:
    """`self_attention_cache` grows with the decoded tokens; `cross_attention_cache` holds the
    encoder's keys/values, written once per layer and never cropped (docs/contract.md).

    Mirrors transformers' `EncoderDecoderCache`: model code reads `is_updated.get(layer_idx)` to
    know whether layer `layer_idx`'s cross keys/values are already there, reads them from
    `cross_attention_cache.layers[layer_idx].keys`, and sets `is_updated[layer_idx] = True` after
    writing them. Length, mask and rollback calls go to the self-attention part; batch operations,
    `reset` and `copy` act on both parts, checked on both before either changes.
    """

    def __init__(self, self_attention_cache: Cache, cross_attention_cache: Cache) -> None:
        if not isinstance(self_attention_cache, Cache) or not isinstance(cross_attention_cache, Cache):
            raise CacheInputError(
                "EncoderDecoderCache takes two kvcache Cache objects, got "
                f"{type(self_attention_cache).__name__} and {type(cross_attention_cache).__name__}"
            )
        if self_attention_cache is cross_attention_cache:
            raise CacheInputError("EncoderDecoderCache: the self- and cross-attention caches must be distinct objects")
        self.self_attention_cache = self_attention_cache
        self.cross_attention_cache = cross_attention_cache
        self.is_updated: dict[int, bool] = {
            i: layer.get_seq_length() > 0 for i, layer in enumerate(cross_attention_cache.layers)
        }

    def __repr__(self) -> str:
        return (
            f"EncoderDecoderCache(self_attention_cache={self.self_attention_cache!r}, "
            f"cross_attention_cache={self.cross_attention_cache!r})"
        )

    def __len__(self) -> int:
        return len(self.self_attention_cache)

    # ------------------------------------------------------------------- self-attention part
    def update(
        self,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        layer_idx: int,
        cache_kwargs: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append decoder self-attention keys/values (cross keys/values go to `cross_attention_cache`).

        transformers' encoder-decoder attention (Bart, T5, ...) calls this with `kwargs=` for self- and
        cross-attention alike, since it routes cross-attention only for its own `EncoderDecoderCache`
        type: the cross keys would land in the self-attention layers and the logits would be wrong.
        Such a call is refused; `as_transformers_cache(cache)` is what those models take."""
        if "kwargs" in kwargs:
            raise CacheInputError(
                "a transformers encoder-decoder model cannot use a kvcache EncoderDecoderCache directly (it "
                "would append cross-attention keys to the self-attention layers): pass "
                "kvcache.integrations.transformers.as_transformers_cache(cache) as cache= / past_key_values="
            )
        return self.self_attention_cache.update(key_states, value_states, layer_idx)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.self_attention_cache.get_seq_length(layer_idx)

    def get_seq_lengths(self, layer_idx: int = 0) -> torch.Tensor:
        """Decoder tokens each batch row holds (see `Cache.get_seq_lengths`)."""
        return self.self_attention_cache.get_seq_lengths(layer_idx)

    @property
    def is_ragged(self) -> bool:
        return self.self_attention_cache.is_ragged

    def get_query_offset(self, layer_idx: int = 0) -> int:
        return self.self_attention_cache.get_query_offset(layer_idx)

    def get_mask_sizes(self, query_length: int | torch.Tensor, layer_idx: int) -> tuple[int, int]:
        return self.self_attention_cache.get_mask_sizes(query_length, layer_idx)

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return self.self_attention_cache.get_max_length(layer_idx)

    @property
    def is_sliding(self) -> list[bool]:
        return self.self_attention_cache.is_sliding

    @property
    def is_linear(self) -> list[bool]:
        return self.self_attention_cache.is_linear

    @property
    def is_compileable(self) -> bool:
        return self.self_attention_cache.is_compileable

    # ------------------------------------------------------------------------------ rollback
    @property
    def is_croppable(self) -> bool:
        return self.self_attention_cache.is_croppable

    @property
    def max_rollback(self) -> int:
        return self.self_attention_cache.max_rollback

    def check_crop(self, tokens_to_remove: Any) -> None:
        self.self_attention_cache.check_crop(tokens_to_remove)

    def crop(self, tokens_to_remove: Any) -> None:
        """Crop (or commit, with 0) the decoder's self-attention part, per row too; the encoder's
        part stays."""
        self.self_attention_cache.crop(tokens_to_remove)

    def activate_past_recording(self) -> None:
        self.self_attention_cache.activate_past_recording()

    def stop_past_recording(self) -> None:
        self.self_attention_cache.stop_past_recording()

    def is_recording_past(self, layer_idx: int) -> bool:
        return self.self_attention_cache.is_recording_past(layer_idx)

    # --------------------------------------------------------------------------------- batch
    @property
    def batch_size(self) -> int | None:
        sizes = {self.self_attention_cache.batch_size, self.cross_attention_cache.batch_size} - {None}
        if len(sizes) > 1:
            raise KVCacheError(f"self- and cross-attention caches disagree on batch size: {sorted(sizes)}")  # type: ignore[type-var]
        return next(iter(sizes), None)

    def _layers(self) -> list[CacheLayer]:
        return [*self.self_attention_cache.layers, *self.cross_attention_cache.layers]

    def reorder_cache(self, beam_idx: torch.Tensor) -> None:
        """Reorder the batch of both parts for beam search."""
        index_layers_batch(self._layers(), beam_idx, "beam_idx")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep only batch rows `indices` in both parts."""
        index_layers_batch(self._layers(), indices, "indices")

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Repeat every batch row `repeats` times in both parts."""
        check_repeats(repeats)
        self.self_attention_cache.batch_repeat_interleave(repeats)
        self.cross_attention_cache.batch_repeat_interleave(repeats)

    def reset(self) -> None:
        """Forget decoded tokens and encoder keys/values; the next forward rewrites the cross part."""
        self.self_attention_cache.reset()
        self.cross_attention_cache.reset()
        self.is_updated = dict.fromkeys(self.is_updated, False)

    # -------------------------------------------------------------------------------- copies
    def copy(self) -> Self:
        """An independent copy of both parts (and of `is_updated`)."""
        clone = object.__new__(type(self))
        clone.__dict__.update(self.__dict__)
        clone.self_attention_cache = self.self_attention_cache.copy()
        clone.cross_attention_cache = self.cross_attention_cache.copy()
        clone.is_updated = dict(self.is_updated)
        return clone

    def __deepcopy__(self, memo: dict[int, Any]) -> Self:
        return self.copy()

    def to(self, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> Self:
        """Move both parts to `device` and/or cast them to a floating `dtype`, in place; returns the cache."""
        check_move(device, dtype)
        self.self_attention_cache.to(device, dtype)
        self.cross_attention_cache.to(device, dtype)
        return self
