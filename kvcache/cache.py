"""Composite caches: one layer per model layer, speaking transformers' cache protocol."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from typing_extensions import Self

from .errors import CacheInputError, KVCacheError, RollbackError
from .layers.base import CacheLayer, index_layers_batch
from .layers.kv_buffer import check_kv_pair
from .validation import (
    MAX_NEW_LAYERS,
    check_layer_idx,
    check_move,
    check_query_length,
    check_repeats,
    crop_amount,
    row_crop_amounts,
)


class Cache:
    """A list of `CacheLayer`s indexed by `layer_idx`.

    Layer-level calls are forwarded with `layer_idx`; `crop`, recording and batch operations go to
    every layer, and are checked on every layer before any layer changes, so a failing call leaves
    the whole cache as it was. With `layer_factory`, layers are created as indices first appear.
    """

    def __init__(
        self,
        layers: Sequence[CacheLayer] | None = None,
        *,
        layer_factory: Callable[[], CacheLayer] | None = None,
    ) -> None:
        if layers is not None and (
            not isinstance(layers, (list, tuple)) or not all(isinstance(layer, CacheLayer) for layer in layers)
        ):
            raise CacheInputError(f"Cache(layers=...) takes a list of CacheLayer instances, got {layers!r}"[:200])
        if layer_factory is not None and not callable(layer_factory):
            raise CacheInputError(f"layer_factory must be callable, got {layer_factory!r}"[:200])
        self.layers: list[CacheLayer] = list(layers) if layers is not None else []
        self.layer_factory = layer_factory
        self._record_new_layers = False  # set by activate_past_recording: lazily created layers record too

    # ------------------------------------------------------------------------------ indexing
    def __len__(self) -> int:
        return len(self.layers)

    def __iter__(self) -> Iterator[CacheLayer]:
        return iter(self.layers)

    def __getitem__(self, layer_idx: int) -> CacheLayer:
        return self.layers[layer_idx]

    def __repr__(self) -> str:
        return f"{type(self).__name__}(layers={self.layers})"

    def _layer(self, layer_idx: int, *, create: bool = False) -> CacheLayer:
        check_layer_idx(layer_idx)
        if create and self.layer_factory is not None:
            if layer_idx - len(self.layers) >= MAX_NEW_LAYERS:
                raise CacheInputError(
                    f"layer_idx {layer_idx}: a lazy cache of {len(self.layers)} layer(s) builds at most "
                    f"{MAX_NEW_LAYERS} new layers at once"
                )
            while len(self.layers) <= layer_idx:
                layer = self.layer_factory()
                if self._record_new_layers:
                    layer.activate_past_recording()
                self.layers.append(layer)
        if layer_idx >= len(self.layers):
            raise CacheInputError(f"layer_idx {layer_idx} out of range: the cache has {len(self.layers)} layer(s)")
        return self.layers[layer_idx]

    def _attention_layer(self, layer_idx: int, what: str) -> CacheLayer:
        layer = self._layer(layer_idx)
        if not layer.has_attention:
            raise CacheInputError(f"{what}: layer {layer_idx} ({type(layer).__name__}) holds no keys/values")
        return layer

    def _recurrent_layer(self, layer_idx: int, what: str) -> Any:
        layer = self._layer(layer_idx)
        if not layer.has_recurrent:
            raise CacheInputError(f"{what}: layer {layer_idx} ({type(layer).__name__}) holds no conv/recurrent states")
        return layer

    # -------------------------------------------------------------------------- attention
    def update(
        self,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        layer_idx: int,
        cache_kwargs: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append keys/values to layer `layer_idx`; return what its attention must see.

        Extra keyword arguments (transformers' BART/T5 pass `kwargs=`) are accepted and ignored."""
        check_layer_idx(layer_idx)
        if self.layer_factory is not None and layer_idx >= len(self.layers):
            check_kv_pair(key_states, value_states, "Cache")  # before building layers for it
        layers_before = len(self.layers)
        layer = self._layer(layer_idx, create=True)
        try:
            if not layer.has_attention:
                raise CacheInputError(f"update: layer {layer_idx} ({type(layer).__name__}) holds no keys/values")
            return layer.update(key_states, value_states)
        except Exception:
            del self.layers[layers_before:]  # a failing update must not leave lazily created layers behind
            raise

    def update_blocks(self, key_states: torch.Tensor, value_states: torch.Tensor,
                      layer_idx: int) -> tuple[torch.Tensor, torch.Tensor, tuple[int, int, int]]:  # fmt: skip
        """A quantized layer's `update_blocks`, for a forward whose queries span several of its
        blocks at once (`in_one_forward`): keys, values and their geometry for `blocks_bias`."""
        layer = self._layer(layer_idx)
        if not hasattr(layer, "update_blocks"):
            raise CacheInputError(f"update_blocks: layer {layer_idx} ({type(layer).__name__}) is not quantized")
        return layer.update_blocks(key_states, value_states)

    def in_one_forward(self, batch: int, attention_mask: torch.Tensor | None) -> bool:
        """Whether a forward whose pieces (`forward_segments`) are several may be computed at once,
        each quantized layer answering `update_blocks`: one unpadded row, every blocked layer
        built and able to."""
        if batch != 1 or attention_mask is not None or self.is_ragged or not self.layers:
            return False
        blocked = [layer for layer in self.layers if layer.forward_block]
        return bool(blocked) and all(hasattr(layer, "update_blocks") for layer in blocked)

    def _first_attention_idx(self, layer_idx: int) -> int:
        """transformers' rule: layer 0 stands for the first layer that has a sequence length."""
        if layer_idx == 0 and self.layers and not self.layers[0].has_attention:
            return next((i for i, layer in enumerate(self.layers) if layer.has_attention), 0)
        return layer_idx

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Tokens seen by layer `layer_idx` (0 for a layer not created yet)."""
        if check_layer_idx(layer_idx) >= len(self.layers):
            return 0
        return self._layer(self._first_attention_idx(layer_idx)).get_seq_length()

    def get_seq_lengths(self, layer_idx: int = 0) -> torch.Tensor:
        """Tokens each batch row holds in layer `layer_idx` (int64 `[batch]`, on the host; pads
        counted, as `get_seq_length` counts them). Rows differ after a per-row crop; the longest
        is `get_seq_length()`. Empty before the first update."""
        if check_layer_idx(layer_idx) >= len(self.layers):
            return torch.zeros(0, dtype=torch.long)
        return torch.tensor(self._layer(self._first_attention_idx(layer_idx)).row_lengths(), dtype=torch.long)

    @property
    def is_ragged(self) -> bool:
        """Whether batch rows hold different numbers of tokens (after a per-row crop)."""
        return any(layer.is_ragged for layer in self.layers)

    def forward_segments(self, length: int) -> list[int]:
        """The pieces a forward of `length` new tokens is computed in (models call this): pieces that
        never cross a quantized layer's block boundary, so that every query sees quantized exactly
        the tokens a one-token step at its position would see, and a quantized cache's outputs do
        not depend on how tokens were grouped into forwards (prompt blocks, verify forwards, store
        hits, the batch a server puts a request in); rows of different lengths are cut at every
        row's boundaries. One piece for caches without quantized layers."""
        length = check_query_length(length)
        layers = list(self.layers)
        if not layers and self.layer_factory is not None:
            layers = [self.layer_factory()]  # not built yet: as the first update will build them
        blocked = [layer for layer in layers if layer.forward_block]  # (no walrus: torch.compile traces this)
        if not blocked or length <= 1:
            return [length]
        # every row's boundaries: a row of a ragged batch must not cross its own either
        cuts = sorted(set().union(*(layer.forward_cuts(length) for layer in blocked)))
        return [end - start for start, end in zip([0, *cuts], [*cuts, length], strict=True)]

    def get_query_offset(self, layer_idx: int = 0) -> int:
        """Position of the next query token: the number of tokens seen."""
        return self.get_seq_length(layer_idx)

    def get_mask_sizes(self, query_length: int | torch.Tensor, layer_idx: int) -> tuple[int, int]:
        """`(kv_length, kv_offset)` for the attention mask of layer `layer_idx`."""
        query_length = check_query_length(query_length)  # older callers pass cache_position (a tensor)
        if check_layer_idx(layer_idx) >= len(self.layers):
            # not built yet: answer as the layer the first update will build (a static one: max_cache_len)
            fresh = self.layer_factory() if self.layer_factory is not None else None
            if fresh is None or not fresh.has_attention:
                return query_length, 0
            return fresh.get_mask_sizes(query_length)
        return self._attention_layer(self._first_attention_idx(layer_idx), "get_mask_sizes").get_mask_sizes(
            query_length
        )

    def get_max_length(self, layer_idx: int | None = None) -> int:
        """Most tokens layer `layer_idx` (or any layer) can hold; -1 when unbounded."""
        if layer_idx is None:
            return max((layer.get_max_length() for layer in self.layers), default=-1)
        if check_layer_idx(layer_idx) >= len(self.layers):
            return -1 if self.layer_factory is None else self.layer_factory().get_max_length()
        return self._layer(layer_idx).get_max_length()

    # -------------------------------------------------------------------------- recurrent
    def update_conv_state(
        self,
        conv_states: torch.Tensor,
        layer_idx: int,
        state_idx: int = 0,
        conv_kernel_size: int | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        """Feed a conv layer's new inputs `[batch, channels, time]`; return the window the conv reads."""
        layer = self._recurrent_layer(layer_idx, "update_conv_state")
        return layer.update_conv_state(conv_states, state_idx=state_idx, conv_kernel_size=conv_kernel_size, **kwargs)

    def update_recurrent_state(
        self, recurrent_states: torch.Tensor, layer_idx: int, state_idx: int = 0, **kwargs: Any
    ) -> torch.Tensor:
        """Store a layer's new recurrent state (optionally with per-token `intermediate_states=`)."""
        layer = self._recurrent_layer(layer_idx, "update_recurrent_state")
        return layer.update_recurrent_state(recurrent_states, state_idx=state_idx, **kwargs)

    def increase_count(self, layer_idx: int, state_idx: int = 0) -> None:
        """Count one token the model fed into layer `layer_idx`'s conv window in place (transformers
        >= 5.25 reports its single-token fast path so; before, such tokens went uncounted)."""
        self._recurrent_layer(layer_idx, "increase_count").increase_count(state_idx)

    def get_recurrent_states_to_keep(self, layer_idx: int | None = None) -> int:
        """How many per-token states a recurrent mixer's multi-token forward should hand over
        (transformers >= 5.25 asks; it computes them token by token): none. kvcache's own loops get
        them from their verify forwards as `intermediate_states=`; adapters for transformers'
        loops answer otherwise (`TransformersCache`)."""
        return 0

    def get_conv_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        """The conv window of layer `layer_idx`, None before its first update."""
        return self._recurrent_layer(layer_idx, "get_conv_state").get_conv_state(state_idx)

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        """The recurrent state of layer `layer_idx`, None before its first update."""
        return self._recurrent_layer(layer_idx, "get_recurrent_state").get_recurrent_state(state_idx)

    def has_previous_state(self, layer_idx: int | None = None, state_idx: int | None = None) -> bool:
        """Whether a recurrent layer (by default the last one) has been fed before."""
        if layer_idx is None:
            recurrent = [i for i, layer in enumerate(self.layers) if layer.has_recurrent]
            if not recurrent:
                return False
            layer_idx = recurrent[-1]
        elif check_layer_idx(layer_idx) >= len(self.layers):
            return False
        return self._recurrent_layer(layer_idx, "has_previous_state").has_previous_state(state_idx)

    # ---------------------------------------------------------------------------- rollback
    @property
    def is_croppable(self) -> bool:
        """Every layer can undo the steps taken since the commit point."""
        return all(layer.is_croppable for layer in self.layers if layer.holds_tokens)

    @property
    def max_rollback(self) -> int:
        """How many of the most recent tokens every layer can remove exactly now."""
        return min((layer.max_rollback for layer in self.layers if layer.holds_tokens), default=0)

    def check_crop(self, tokens_to_remove: int | torch.Tensor | list[int]) -> None:
        """Raise `RollbackError` unless every layer can `crop(tokens_to_remove)` exactly."""
        if row_crop_amounts(tokens_to_remove, self.batch_size) is None:  # also on a cache with no layers yet
            n = crop_amount(tokens_to_remove)
            if n and not any(layer.holds_tokens for layer in self.layers):
                raise RollbackError(
                    f"{type(self).__name__} cannot remove {n} token(s): it holds none (no layer holds tokens yet)"
                )
        for layer in self.layers:
            layer.check_crop(tokens_to_remove)

    def crop(self, tokens_to_remove: int | torch.Tensor | list[int]) -> None:
        """`crop(-n)`: remove the last n tokens from every layer exactly; `crop(0)`: commit. With one
        `-n_b` per batch row (a 1-D integer tensor or list), row b loses its last `n_b` tokens
        (docs/contract.md, "Per-row rollback"); rows then hold different numbers of tokens
        (`get_seq_lengths`)."""
        if type(tokens_to_remove) is int and tokens_to_remove == 0:  # a commit: nothing to check
            for layer in self.layers:
                layer.crop(0)
            return
        counts = row_crop_amounts(tokens_to_remove, self.batch_size)
        if counts is not None:  # read once (a tensor on an accelerator syncs once), then host ints
            tokens_to_remove = [-n for n in counts]
        self.check_crop(tokens_to_remove)
        for layer in self.layers:
            layer.crop(tokens_to_remove)

    def activate_past_recording(self) -> None:
        """Every layer, including those created lazily later, keeps what rollback needs from now on."""
        for layer in self.layers:
            layer.activate_past_recording()
        self._record_new_layers = True

    def stop_past_recording(self) -> None:
        """Commit every layer and stop recording (layers created lazily later do not record either):
        steps from now on cost no history, and cannot be rolled back."""
        for layer in self.layers:
            layer.record_past = False
        self._record_new_layers = False

    def is_recording_past(self, layer_idx: int) -> bool:
        """Whether layer `layer_idx` is recording (False for a layer not created yet)."""
        return check_layer_idx(layer_idx) < len(self.layers) and self._layer(layer_idx).record_past

    # ------------------------------------------------------------------------------- batch
    @property
    def batch_size(self) -> int | None:
        """Batch size held, None before any update."""
        sizes = {layer.batch_size for layer in self.layers} - {None}
        if len(sizes) > 1:
            raise KVCacheError(f"layers disagree on batch size: {sorted(sizes)}")  # type: ignore[type-var]
        return next(iter(sizes), None)

    def reorder_cache(self, beam_idx: torch.Tensor) -> None:
        """Reorder the batch of every layer for beam search."""
        index_layers_batch(self.layers, beam_idx, "beam_idx")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep only batch rows `indices` in every layer."""
        index_layers_batch(self.layers, indices, "indices")

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Repeat every batch row `repeats` times in every layer."""
        check_repeats(repeats)
        for layer in self.layers:
            layer.batch_repeat_interleave(repeats)

    def reset(self) -> None:
        """Forget every token in every layer; keep the layers and their parameters."""
        for layer in self.layers:
            layer.reset()

    # ------------------------------------------------------------------------------ flags
    @property
    def is_compileable(self) -> bool:
        return bool(self.layers) and all(layer.is_compileable for layer in self.layers)

    @property
    def is_sliding(self) -> list[bool]:
        return [layer.is_sliding for layer in self.layers]

    @property
    def is_linear(self) -> list[bool]:
        """Per layer: holds recurrent states only (no keys/values)."""
        return [layer.has_recurrent and not layer.has_attention for layer in self.layers]

    # ------------------------------------------------------------------------------- copies
    def copy(self) -> Self:
        """An independent copy (a fork for beams or branches) sharing no mutable tensor."""
        clone = object.__new__(type(self))
        clone.__dict__.update(self.__dict__)
        clone.layers = [layer.copy() for layer in self.layers]
        return clone

    def __deepcopy__(self, memo: dict[int, Any]) -> Self:
        return self.copy()

    def to(self, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> Self:
        """Move every layer to `device` and/or cast it to a floating `dtype`, in place; returns the cache."""
        check_move(device, dtype)  # before any layer moves
        for layer in self.layers:
            layer.to(device, dtype)
        return self
