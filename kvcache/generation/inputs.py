"""Checks on `generate`'s arguments, all made before any model call (errors name what is wrong)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..cache import Cache
from ..encoder_decoder import EncoderDecoderCache
from ..errors import CacheInputError, GenerationError, KVCacheError
from ..layers.dynamic import DynamicLayer
from ..layers.hybrid import HybridLayer
from ..layers.quantized import QuantizedLayer
from ..layers.quantized_rows import QuantizedRows
from ..layers.quantized_sliding import QuantizedSlidingWindowLayer
from ..layers.recurrent import RecurrentLayer
from ..layers.sliding import SlidingWindowLayer
from ..layers.static import StaticLayer
from ..layers.static_recurrent import StaticRecurrentLayer
from ..layers.static_sliding import StaticSlidingWindowLayer
from .stop import self_attention_layers

#: meta_state entries that are parameters of a layer (not bookkeeping that changes with tokens).
LAYER_PARAMETERS = ("sliding_window", "max_cache_len", "num_states", "conv_kernel_size")


def check_int(name: str, value: Any, *, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise GenerationError(f"{name} must be an int >= {minimum}, got {value!r}", param=name)
    return value


def check_model(model: Any) -> bool:
    """Raise unless `model` speaks `kvcache.protocol`; return whether it is an encoder-decoder."""
    vocab = getattr(model, "vocab_size", None)
    if not callable(model) or not callable(getattr(model, "new_cache", None)):
        if type(model).__module__.startswith("transformers."):
            raise GenerationError(
                f"{type(model).__name__} is a transformers model: pass "
                "kvcache.integrations.transformers.wrap_model(model), which adapts it to kvcache.protocol"
            )
        raise GenerationError(
            f"model must be callable and have new_cache() (kvcache.protocol), got {type(model).__name__}"
        )
    if isinstance(vocab, bool) or not isinstance(vocab, int) or vocab < 1:
        raise GenerationError(f"model.vocab_size must be a positive int, got {vocab!r}")
    encoder_decoder = bool(getattr(model, "is_encoder_decoder", False))
    if encoder_decoder and not callable(getattr(model, "encode", None)):
        raise GenerationError("an encoder-decoder model must have encode(input_ids, attention_mask)")
    return encoder_decoder


def check_ids(name: str, ids: Any, vocab_size: int) -> torch.Tensor:
    """A non-empty `[batch, seq]` integer tensor of ids in `[0, vocab_size)`."""
    if not isinstance(ids, torch.Tensor):
        raise GenerationError(f"{name} must be a torch.Tensor [batch, seq], got {type(ids).__name__}")
    if ids.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8, torch.int8):
        raise GenerationError(f"{name} must hold integer token ids, got dtype {ids.dtype}")
    if ids.dim() != 2:
        raise GenerationError(f"{name} must be 2-D [batch, seq], got shape {tuple(ids.shape)}")
    if ids.shape[0] == 0 or ids.shape[1] == 0:
        raise GenerationError(f"{name} is empty (shape {tuple(ids.shape)}): a prompt needs at least one token")
    low, high = int(ids.min()), int(ids.max())
    if low < 0 or high >= vocab_size:
        raise GenerationError(f"{name} holds ids outside [0, {vocab_size}) (min {low}, max {high})")
    return ids.long()


def check_mask(mask: Any, input_ids: torch.Tensor) -> torch.Tensor | None:
    """A 0/1 left-padding mask of `input_ids`' shape (every row ends in real tokens), as long."""
    if mask is None:
        return None
    if not isinstance(mask, torch.Tensor):
        raise GenerationError(f"attention_mask must be a torch.Tensor, got {type(mask).__name__}")
    if tuple(mask.shape) != tuple(input_ids.shape):
        raise GenerationError(
            f"attention_mask has shape {tuple(mask.shape)} but input_ids has {tuple(input_ids.shape)}; "
            "it must cover every input token (cached ones included)"
        )
    if mask.is_floating_point() or mask.is_complex():
        raise GenerationError(f"attention_mask must be integer or bool, got {mask.dtype}")
    if mask.device != input_ids.device:
        raise GenerationError(f"attention_mask is on {mask.device} but input_ids on {input_ids.device}")
    mask = mask.long()
    if bool(((mask != 0) & (mask != 1)).any()):
        raise GenerationError("attention_mask must hold only 0 (padding) and 1 (token)")
    if bool((mask[:, 1:] < mask[:, :-1]).any()):
        raise GenerationError("attention_mask must be left padding: no 0 after a 1 in a row")
    if bool((mask[:, -1] == 0).any()):
        raise GenerationError("attention_mask has a row without any real token")
    return mask


def check_token_list(name: str, value: Any, vocab_size: int) -> list[int]:
    """One id or a sequence of ids, each in `[0, vocab_size)`; None (or an empty list) gives []."""
    if value is None:
        return []
    items = [value] if isinstance(value, int) else value
    if isinstance(items, torch.Tensor):
        items = items.reshape(-1).tolist()
    if not isinstance(items, Sequence) or isinstance(items, (str, bytes)):
        raise GenerationError(f"{name} must be an int or a list of ints, got {value!r}")
    for item in items:
        if isinstance(item, bool) or not isinstance(item, int) or not 0 <= item < vocab_size:
            raise GenerationError(f"{name} must hold ints in [0, {vocab_size}), got {value!r}")
    return list(items)


def model_default(model: Any, name: str, given: Any) -> Any:
    """`given`, else the model's own default for `name` (`eos_token_id`, `pad_token_id`: a wrapped
    transformers model reads its `generation_config`, as transformers' `generate` does)."""
    return getattr(model, name, None) if given is None else given


def check_generator(generator: Any, device: torch.device) -> None:
    if generator is None:
        return
    if not isinstance(generator, torch.Generator):
        raise GenerationError(f"generator must be a torch.Generator, got {type(generator).__name__}")
    if generator.device.type != device.type:
        raise GenerationError(f"generator is on {generator.device} but the inputs on {device}")


def check_streamer(streamer: Any) -> None:
    if streamer is None:
        return
    if not (callable(getattr(streamer, "put", None)) and callable(getattr(streamer, "end", None))):
        raise GenerationError(f"streamer must have put(token_ids) and end(), got {type(streamer).__name__}")


def cache_length(cache: Cache) -> int:
    """Tokens the cache holds (its self-attention part for an encoder-decoder cache)."""
    return getattr(cache, "self_attention_cache", cache).get_seq_length()


def check_cache(cache: Any, *, batch_size: int, encoder_decoder: bool, source_length: int) -> None:
    """The cache's type, batch size and (encoder-decoder) source length; the shape check against
    the model is `check_cache_shapes`."""
    if not isinstance(cache, (Cache, EncoderDecoderCache)):
        raise GenerationError(f"cache must be a kvcache Cache or EncoderDecoderCache, got {type(cache).__name__}")
    if encoder_decoder != isinstance(cache, EncoderDecoderCache):
        want = "an EncoderDecoderCache" if encoder_decoder else "a decoder cache, not an EncoderDecoderCache"
        raise GenerationError(f"the model needs {want}")
    try:
        held = cache.batch_size
    except KVCacheError as err:
        raise GenerationError(f"cache is inconsistent: {err}") from err
    if held is not None and held != batch_size:
        raise CacheInputError(f"cache holds a batch of {held} but input_ids has {batch_size} row(s)")
    if cache.is_ragged:
        lengths = cache.get_seq_lengths().tolist()
        raise GenerationError(
            f"the cache's rows hold different numbers of tokens ({lengths}, after a per-row crop): generation "
            "continues caches whose rows are alike; crop them to one length (or decode the batch with "
            "speculative_generate)"
        )
    if encoder_decoder:
        lengths = {layer.get_seq_length() for layer in cache.cross_attention_cache.layers} - {0}
        if lengths and lengths != {source_length}:
            raise CacheInputError(
                f"the cache's cross-attention part holds a source of {sorted(lengths)} token(s) but input_ids has "
                f"{source_length}: pass the same source as the call that built the cache"
            )


def _fingerprint(tensor: torch.Tensor) -> tuple[Any, ...]:
    """What must agree between a model's fresh cache and a cache it continues (not batch or length)."""
    return tensor.dtype, tensor.device, tensor.dim(), tensor.shape[1] if tensor.dim() > 1 else None, tensor.shape[-1]


def _same_kind(mine: Any, ref: Any) -> bool:
    """A layer of the model's kind (or a subclass); full attention held dynamically, statically or
    quantized, a sliding window held as is, statically or quantized, recurrent states dynamically
    or statically (every static cache transformers' `generate` accepts for the model)."""
    full = (DynamicLayer, StaticLayer, QuantizedLayer)
    mine = mine.like if isinstance(mine, QuantizedRows) else mine  # rows quantized alone: of that kind
    if type(ref) is DynamicLayer and isinstance(mine, full) and not mine.is_sliding:
        return True
    if type(ref) is SlidingWindowLayer and isinstance(mine, (QuantizedSlidingWindowLayer, StaticSlidingWindowLayer)):
        return True
    if type(ref) is RecurrentLayer and isinstance(mine, StaticRecurrentLayer):
        return True
    if type(ref) is HybridLayer and isinstance(mine, HybridLayer):
        return _same_kind(mine.attention, ref.attention) and _same_kind(mine.recurrent, ref.recurrent)
    return isinstance(mine, type(ref))


def check_cache_shapes(cache: Cache, probe: Cache) -> None:
    """Raise `CacheInputError` unless `cache` has the layers, parameters, dtypes, devices, heads and
    head sizes of `probe` (a fresh cache the model has just written one token into)."""
    given, fresh = self_attention_layers(cache), self_attention_layers(probe)
    if not given and getattr(getattr(cache, "self_attention_cache", cache), "layer_factory", None) is not None:
        return  # a lazy cache that has not built a layer yet: the model's updates build and check them
    if len(given) != len(fresh):
        raise CacheInputError(
            f"cache has {len(given)} layer(s) but the model writes {len(fresh)}: another model's cache?"
        )
    for i, (held, ref) in enumerate(zip(given, fresh, strict=True)):
        mine = held.like if isinstance(held, QuantizedRows) else held
        if not _same_kind(mine, ref):
            raise CacheInputError(f"cache layer {i} is a {type(mine).__name__}, the model needs a {type(ref).__name__}")
        mine_meta, ref_meta = mine.meta_state, ref.meta_state
        for key in LAYER_PARAMETERS:
            if key in ref_meta and mine_meta.get(key) != ref_meta.get(key):
                raise CacheInputError(
                    f"cache layer {i}: {key} is {mine_meta.get(key)!r}, the model uses {ref_meta.get(key)!r}"
                )
        if mine.has_recurrent and mine.record_past:
            continue  # recorded history may add dimensions; the layer's own update checks shapes
        mine_state, ref_state = mine.state, ref.state
        for name in mine_state.keys() & ref_state.keys():
            if _fingerprint(mine_state[name]) != _fingerprint(ref_state[name]):
                raise CacheInputError(
                    f"cache layer {i} '{name}': {tuple(mine_state[name].shape)} {mine_state[name].dtype} on "
                    f"{mine_state[name].device} does not fit the model's {tuple(ref_state[name].shape)} "
                    f"{ref_state[name].dtype} on {ref_state[name].device} (another model's cache?)"
                )


def probe_cache(
    model: Any, cache: Cache, input_ids: torch.Tensor, tokens: torch.Tensor, encoder_decoder: bool, need_rollback: bool
) -> None:
    """Let the model write one token into a fresh cache and compare `cache` with it (layers,
    parameters, heads, dtypes); with `need_rollback`, check that recording makes it croppable."""
    probe = model.new_cache()
    with torch.no_grad():
        if encoder_decoder:
            encoded = model.encode(input_ids[:1, :1])
            model(tokens[:1, :1], cache=probe, encoder_hidden_states=encoded)
        else:
            model(tokens[:1, :1], cache=probe)
    check_cache_shapes(cache, probe)
    if need_rollback:
        for layer in self_attention_layers(probe):
            layer.activate_past_recording()
        with torch.no_grad():  # a recorded decode step: a model that overwrites states in place shows here
            if encoder_decoder:
                model(tokens[:1, :1], cache=probe, encoder_hidden_states=encoded)
            else:
                model(tokens[:1, :1], cache=probe)
        blockers = [type(layer).__name__ for layer in self_attention_layers(probe) if not layer.is_croppable]
        given = self_attention_layers(cache)
        blockers += [type(layer).__name__ for layer in given if not _croppable_when_recording(layer)]
        if blockers:
            raise GenerationError(
                f"defer_stop=True needs a cache that can undo a step exactly, but {sorted(set(blockers))} cannot; "
                "use defer_stop=None or False"
            )


def _croppable_when_recording(layer: Any) -> bool:
    """Whether `layer` can undo a step once recording (asked of the layer itself, left as it was)."""
    if layer.record_past:
        return layer.is_croppable
    layer.activate_past_recording()
    try:
        return layer.is_croppable
    finally:
        layer.record_past = False
