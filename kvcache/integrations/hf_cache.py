"""A kvcache cache as transformers model code sees it: a thin `transformers.Cache` subclass that forwards.

Why a subclass and not duck typing: transformers 5.x model code branches on `isinstance` in places
that decide correctness, not style. `masking_utils.find_first_full_attention_index` sizes the
full-attention mask from layer 0 unless the cache `isinstance(cache, transformers.Cache)` (so Gemma3,
whose layer 0 is a sliding layer, would get a sliding-sized mask for its global layers), and Bart/T5
attention only routes keys/values to the cross-attention cache when `isinstance(cache,
transformers.EncoderDecoderCache)`. A duck-typed kvcache cache cannot pass those checks, and core
kvcache must not import transformers, so the integration builds these adapters: they hold no
tokens, only a reference to the kvcache cache, and answer every call the model code makes by
forwarding it. Everything (contents, recording, rollback, saving) stays in the kvcache cache;
an adapter is built per forward call in O(1) and can be thrown away.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import Cache as HFCache
from transformers.cache_utils import EncoderDecoderCache as HFEncoderDecoderCache

from ..cache import Cache
from ..encoder_decoder import EncoderDecoderCache
from ..errors import CacheInputError
from ..layers.hybrid import HybridLayer

#: What `get_recurrent_states_to_keep` answers for a stepwise layer: more than any forward's tokens.
STEPWISE_STATES = 1 << 30


class TransformersCache(HFCache):
    """A kvcache `Cache` behind transformers' `Cache` interface (attention, sliding, conv/recurrent calls).

    `self.cache` is the kvcache cache; every call is forwarded to it with transformers' argument order.
    """

    def __init__(self, cache: Cache) -> None:  # transformers' __init__ would build its own layers: not called
        if not isinstance(cache, Cache):
            raise CacheInputError(f"TransformersCache wraps a kvcache Cache, got {type(cache).__name__}")
        self.cache = cache
        self.layer_class_to_replicate = None
        self.offloading = False
        self.one_forward_history = False  # set when transformers itself starts recording (see below)
        self.states_to_keep = 0  # the most tokens transformers will crop from one forward (>= 5.25)
        #: layers whose mixer scans a chunk from a zero state unless asked for every token's state
        #: (transformers' Mamba1 mixers, `hf_recurrence.stepwise_layers`): set by the model wrapper
        self.stepwise_layers: frozenset[int] = frozenset()

    def activate_past_recording(self, recurrent_states_to_keep: int | None = None, **kwargs: Any) -> None:
        """transformers' generation loops call this when they will undo part of the *next* forward
        only (assisted and prompt-lookup decoding, their deferred stop check), and expect layers to
        stay at working size otherwise. So, started through the adapter, recording keeps one forward
        of history: each layer commits before its next update, and `crop` commits too. Recording
        started on the kvcache cache itself keeps kvcache's semantics (history since the commit point).
        `recurrent_states_to_keep` (transformers >= 5.25) is how many tokens of one forward it may crop."""
        self.cache.activate_past_recording()
        self.one_forward_history = True
        self.states_to_keep = max(self.states_to_keep, recurrent_states_to_keep or 0)

    def get_recurrent_states_to_keep(self, layer_idx: int | None = None) -> int:
        """How many per-token states layer `layer_idx`'s multi-token forward should hand over.

        transformers >= 5.25 computes the states after a forward's last N tokens token by token when
        asked, so that its loops can crop inside that forward. To land a crop of up to
        `recurrent_states_to_keep` tokens on a known state, a kvcache step needs one more than that
        (the state the crop returns to); 0 while transformers is not recording, so kvcache's own
        forwards keep the model's fast path. `layer_idx=None`: the crop depth asked for.

        A `stepwise_layers` layer that holds a state is asked for every token's state (transformers
        keeps at most as many as the forward has tokens): its mixer then runs the chunk from that
        state, token by token, instead of from zero."""
        if layer_idx is None:
            return self.states_to_keep
        if layer_idx in self.stepwise_layers and self.cache.has_previous_state(layer_idx):
            return STEPWISE_STATES
        if not self.one_forward_history or not self.states_to_keep:
            return 0
        return self.states_to_keep + 1

    def _commit_before_update(self, layer_idx: int) -> None:
        """Commit layer `layer_idx` at its first update of a forward (one forward of history). A
        parallel hybrid (Falcon-H1) is updated twice per forward, by its mixer and its attention:
        the second update finds one part ahead of the other and must not commit the first's step."""
        if self.one_forward_history and layer_idx < len(self.cache.layers):
            layer = self.cache.layers[layer_idx]
            mid_forward = isinstance(layer, HybridLayer) and (
                layer.attention.get_seq_length() != layer.recurrent.get_seq_length()
            )
            if layer.record_past and not mid_forward:
                layer.crop(0)

    @property
    def layers(self) -> list[Any]:  # type: ignore[override]
        """The kvcache layers (model code reads `cache.layers[i].keys` for cross-attention)."""
        return self.cache.layers

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.cache!r})"

    # ----------------------------------------------------------------------------- attention
    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # transformers passes `kwargs=` / `cache_kwargs` (rope sin/cos, cache positions): kvcache layers need none.
        self._commit_before_update(layer_idx)
        return self.cache.update(key_states, value_states, layer_idx)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.cache.get_seq_length(layer_idx)

    def get_query_offset(self, layer_idx: int = 0) -> int:
        return self.cache.get_query_offset(layer_idx)

    def get_mask_sizes(self, query_length: int, layer_idx: int) -> tuple[int, int]:
        if self.cache.is_ragged:
            # transformers builds its masks from these sizes with one query position for every
            # row, which is wrong once rows differ in length: refuse rather than mask wrongly
            # (`TransformersCausalLM` passes per-row 4-D masks, so this is never asked then)
            raise CacheInputError(
                "the cache's rows hold different numbers of tokens (after a per-row crop); transformers' "
                "masks would place every row's queries at one position. Call the model through "
                "kvcache.integrations.transformers.wrap_model, which builds per-row masks"
            )
        return self.cache.get_mask_sizes(query_length, layer_idx)

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return self.cache.get_max_length(layer_idx)

    def early_initialization(self, *args: Any, **kwargs: Any) -> None:
        """kvcache layers allocate on their first update; nothing to do ahead of time."""

    # ----------------------------------------------------------------------------- recurrent
    def get_conv_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        return self.cache.get_conv_state(layer_idx, state_idx)

    def update_conv_state(
        self, conv_states: torch.Tensor, layer_idx: int, state_idx: int = 0, **kwargs: Any
    ) -> torch.Tensor:
        if state_idx == 0:  # a forward's first state of this layer: its step opens here
            self._commit_before_update(layer_idx)
        return self.cache.update_conv_state(conv_states, layer_idx, state_idx, **kwargs)

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0) -> torch.Tensor | None:
        return self.cache.get_recurrent_state(layer_idx, state_idx)

    def increase_count(self, layer_idx: int, state_idx: int = 0) -> None:
        self.cache.increase_count(layer_idx, state_idx)

    def update_recurrent_state(
        self, recurrent_states: torch.Tensor | list[torch.Tensor], layer_idx: int, state_idx: int = 0, **kwargs: Any
    ) -> torch.Tensor:
        """transformers >= 5.25 hands a list where `get_recurrent_states_to_keep` asked for states: the
        states after the forward's last tokens, the final one last. They become the step's
        `intermediate_states` (the states after its last tokens) when a conv update opened the step
        with at least that many tokens; otherwise only the final state is kept."""
        if isinstance(recurrent_states, (list, tuple)):
            states = list(recurrent_states)
            if not states:
                raise CacheInputError(f"update_recurrent_state: layer {layer_idx} got an empty list of states")
            layer = self.cache.layers[layer_idx] if layer_idx < len(self.cache.layers) else None
            open_tokens = getattr(layer, "open_step_tokens", None)
            tokens = open_tokens(state_idx) if open_tokens is not None else None
            recording = self.cache.is_recording_past(layer_idx)  # else the states inside the step are not kept
            if len(states) > 1 and tokens is not None and tokens >= len(states) and recording:
                kwargs["intermediate_states"] = torch.stack(states, dim=1)
            recurrent_states = states[-1]
        return self.cache.update_recurrent_state(recurrent_states, layer_idx, state_idx, **kwargs)

    def has_previous_state(self, layer_idx: int | None = None, state_idx: int | None = None) -> bool:
        return self.cache.has_previous_state(layer_idx, state_idx)

    def is_recording_past(self, layer_idx: int) -> bool:
        """True for every layer with conv/recurrent states, else the layer's recording flag.

        transformers 5.x model code asks this only to choose its single-token decode path: on False
        it updates the held conv window in place and never tells the cache, so a kvcache layer could
        not count that token (a Mamba model's cache would not know its length, and a saved cache
        could not be continued). On True it hands the token to `update_conv_state`, which returns the
        same window and keeps the count exact; rollback needs this path anyway while recording.
        """
        layer = self.cache.layers[layer_idx] if layer_idx < len(self.cache.layers) else None
        return bool(layer is not None and layer.has_recurrent) or self.cache.is_recording_past(layer_idx)

    # --------------------------------------------------------------------------------- flags
    @property
    def batch_size(self) -> int:
        size = self.cache.batch_size
        return -1 if size is None else size  # transformers' "not initialized yet"

    @property
    def is_compileable(self) -> bool:
        return self.cache.is_compileable

    @property
    def is_initialized(self) -> bool:
        return bool(self.cache.layers) and self.cache.batch_size is not None

    @property
    def is_sliding(self) -> list[bool]:
        return self.cache.is_sliding

    @property
    def is_linear(self) -> list[bool]:
        return self.cache.is_linear

    @property
    def is_dummy(self) -> list[bool]:
        return [not layer.holds_tokens for layer in self.cache.layers]


class TransformersEncoderDecoderCache(HFEncoderDecoderCache):
    """A kvcache `EncoderDecoderCache` behind transformers' `EncoderDecoderCache` interface.

    Bart/T5 attention reads `self_attention_cache`, `cross_attention_cache` and the per-layer
    `is_updated` flags; the flags are the kvcache cache's own, so they persist across forward calls.
    """

    def __init__(self, cache: EncoderDecoderCache) -> None:
        if not isinstance(cache, EncoderDecoderCache):
            raise CacheInputError(
                f"TransformersEncoderDecoderCache wraps a kvcache EncoderDecoderCache, got {type(cache).__name__}"
            )
        self.cache = cache
        self.self_attention_cache = TransformersCache(cache.self_attention_cache)
        self.cross_attention_cache = TransformersCache(cache.cross_attention_cache)
        self.layer_class_to_replicate = None
        self.offloading = False

    @property
    def is_updated(self) -> dict[int, bool]:  # type: ignore[override]
        return self.cache.is_updated

    def activate_past_recording(self, recurrent_states_to_keep: int | None = None, **kwargs: Any) -> None:
        """As `TransformersCache.activate_past_recording`, for the decoder's self-attention part."""
        self.self_attention_cache.activate_past_recording(recurrent_states_to_keep)
        self.cache.activate_past_recording()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.cache!r})"

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.cache.get_seq_length(layer_idx)


def _copy_adapter(self: Any) -> Any:
    """`copy.copy`: another adapter over the same kvcache cache (shares its contents, as a shallow copy does)."""
    return _with_mode(type(self)(self.cache), self)


def _deepcopy_adapter(self: Any, memo: dict[int, Any]) -> Any:
    """`copy.deepcopy`: an adapter over one independent copy of the kvcache cache, so both halves of an
    encoder-decoder adapter point into the same fork (transformers' way to reuse a prompt cache)."""
    return _with_mode(type(self)(self.cache.copy()), self)


def _with_mode(new: Any, old: Any) -> Any:
    """Carry the recording mode transformers set on `old` over to its copy `new`."""
    part = getattr(old, "self_attention_cache", old)
    if getattr(part, "one_forward_history", False):
        target = getattr(new, "self_attention_cache", new)
        target.one_forward_history, target.states_to_keep = True, part.states_to_keep
    return new


for _adapter in (TransformersCache, TransformersEncoderDecoderCache):
    _adapter.__copy__ = _copy_adapter  # type: ignore[method-assign]
    _adapter.__deepcopy__ = _deepcopy_adapter  # type: ignore[method-assign]

def _crop_as_transformers_does(self: Any, tokens_to_remove: int) -> None:
    """transformers' `crop(-n)`: remove the last n tokens and shrink back to working size. Its loops
    (assisted and prompt-lookup decoding, its deferred stop check) never roll back past a crop, so
    after cropping the kvcache cache the adapter commits it (`crop(0)`; recording stays on). Without
    that, sliding windows and conv histories would keep growing with every generated token. Crop
    the kvcache cache itself (`adapter.cache`) for kvcache's semantics."""
    self.cache.crop(tokens_to_remove)
    if tokens_to_remove:
        self.cache.crop(0)


for _adapter in (TransformersCache, TransformersEncoderDecoderCache):
    _adapter.crop = _crop_as_transformers_does  # type: ignore[method-assign]

#: Whole-cache operations both adapters hand to the kvcache cache unchanged.
_FORWARDED_METHODS = ("reset", "reorder_cache", "batch_repeat_interleave", "batch_select_indices")
_FORWARDED_PROPERTIES = ("max_rollback", "is_croppable")


def _forward_to_cache(cls: type) -> None:
    """Give `cls` methods/properties that call the same name on `self.cache` (replacing
    transformers' own, which would act on layers the adapter does not have)."""
    for name in _FORWARDED_METHODS:
        def method(self: Any, *args: Any, _name: str = name, **kwargs: Any) -> Any:
            return getattr(self.cache, _name)(*args, **kwargs)

        method.__name__, method.__doc__ = name, f"`cache.{name}(...)` of the wrapped kvcache cache."
        setattr(cls, name, method)
    for name in _FORWARDED_PROPERTIES:
        setattr(cls, name, property(lambda self, _name=name: getattr(self.cache, _name)))


_forward_to_cache(TransformersCache)
_forward_to_cache(TransformersEncoderDecoderCache)


def as_transformers_cache(cache: Any) -> HFCache:
    """The adapter transformers model code accepts as `cache=` / `past_key_values=` for a kvcache cache.

    An adapter (or any transformers cache) is returned as is.
    """
    if isinstance(cache, HFCache):
        return cache
    if isinstance(cache, EncoderDecoderCache):
        return TransformersEncoderDecoderCache(cache)
    if isinstance(cache, Cache):
        return TransformersCache(cache)
    raise CacheInputError(f"expected a kvcache cache, got {type(cache).__name__}")


def unwrap_cache(cache: Any) -> Any:
    """The kvcache cache behind an adapter (anything else is returned as is)."""
    return cache.cache if isinstance(cache, (TransformersCache, TransformersEncoderDecoderCache)) else cache
