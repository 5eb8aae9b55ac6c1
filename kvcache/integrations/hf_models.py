"""transformers models behind kvcache's model protocol (`kvcache.protocol`)."""

from __future__ import annotations

import inspect
from typing import Any

import torch
from transformers import PreTrainedModel
from transformers.cache_utils import get_layer_types_and_kwargs

from ..cache import Cache
from ..errors import CacheInputError
from ..layers.recurrent import RecurrentLayer
from ..models.context_length import context_length
from ..models.modules import check_logits_to_keep, in_pieces
from .hf_cache import TransformersCache, as_transformers_cache
from .hf_config import cache_from_config
from .hf_recurrence import MIXER_CLASSES, PerTokenRecurrence, asked_layers, asks_for_states, stepwise_layers

#: Models whose past transformers keeps outside the cache it is given, by `model_type`: kvcache
#: could neither roll that back nor keep requests apart, so they are refused.
OWN_STATE = {"recurrent_gemma": "its recurrent blocks keep their states on the modules, not in the cache",
             "xlstm": "its forward takes only its own xLSTMCache",
             "minimax": "its forward takes only its own MiniMaxCache"}  # fmt: skip


def _named_params(function: Any) -> set[str]:
    variadic = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    return {name for name, p in inspect.signature(function).parameters.items() if p.kind not in variadic} - {"self"}


def _forward_params(model: PreTrainedModel) -> set[str]:
    """The arguments the model's forward names. A forward that names none (`*args, **kwargs`: a
    subclass's wrapper of its parent's, as a directory's own modeling code often writes) takes what
    the nearest forward up its classes names."""
    named = _named_params(model.forward)
    for klass in type(model).__mro__:
        if named:
            break
        if "forward" in vars(klass):
            named = _named_params(vars(klass)["forward"])
    return named


def _vocab_size(model: PreTrainedModel) -> int:
    head = model.get_output_embeddings()
    if head is not None and hasattr(head, "out_features"):
        return int(head.out_features)  # what the logits' last dimension really is
    return int(model.config.get_text_config(decoder=True).vocab_size)


class _GenerationDefaults:
    """The model's `generation_config` end and padding tokens, read at each call (so a change to
    the config is seen), as `generate` defaults them: transformers stops and pads with these too."""

    model: PreTrainedModel

    @property
    def eos_token_id(self) -> list[int] | None:
        eos = getattr(self.model.generation_config, "eos_token_id", None)
        if eos is None:
            return None
        return [int(t) for t in (eos if isinstance(eos, (list, tuple)) else [eos])]

    @property
    def pad_token_id(self) -> int | None:
        pad = getattr(self.model.generation_config, "pad_token_id", None)
        return None if pad is None else int(pad)


class TransformersCausalLM(_GenerationDefaults):
    """A transformers causal LM as a `kvcache.protocol.CausalLM`.

    Calls the unmodified model with the kvcache cache behind `as_transformers_cache`, and returns
    its logits `[batch, new, vocab]`. Models made of recurrent layers only (Mamba, Mamba2) read the
    attention mask per new token, so they get its last `new` columns.
    """

    is_encoder_decoder = False

    def __init__(self, model: PreTrainedModel) -> None:
        self.model = model
        self.config = model.config
        self.vocab_size = _vocab_size(model)
        kind = getattr(model.config.get_text_config(decoder=True), "model_type", model.config.model_type)
        if kind in OWN_STATE or model.config.model_type in OWN_STATE:
            why = OWN_STATE.get(kind) or OWN_STATE[model.config.model_type]
            raise CacheInputError(f"{type(model).__name__}: {why}, so kvcache cannot hold its past")
        params = _forward_params(model)
        if not params & {"cache", "past_key_values"}:  # RWKV, GPT-1, XLNet: the past kept its own way, or not at all
            raise CacheInputError(f"{type(model).__name__}'s forward takes no cache (no `cache` or `past_key_values`):"
                                  " kvcache holds a model's past through that argument, so it cannot run this model "
                                  "(each step would see only the new tokens)")  # fmt: skip
        self._takes_position_ids = "position_ids" in params
        self._takes_logits_to_keep = "logits_to_keep" in params
        layers = self.new_cache().layers
        self._mask_per_new_token = all(isinstance(layer, RecurrentLayer) for layer in layers)
        #: why rows of different lengths (a per-row crop) cannot be masked for this model, or None
        self.ragged_refusal = None if self._mask_per_new_token else ragged_refusal(model.config)
        self._per_token = PerTokenRecurrence(model)
        self._stepwise = stepwise_layers(model)  # Mamba1 mixers: every chunk on a held state token by token
        #: ... by kvcache's own single-token forwards where transformers cannot be asked (< 5.25)
        self._one_by_one = bool(self._stepwise) and not asks_for_states(model)
        #: other mixers whose code hands over the states asked for: token by token while switched on
        self._asked = frozenset() if self._per_token else asked_layers(model)
        self._asking = False
        #: the most positions the model takes and its config field that says so (None: none named)
        self.context_length = context_length(model.config)

    def set_per_token_recurrence(self, enabled: bool) -> None:
        """Run the recurrent mixers (Mamba2, gated delta net) one token at a time inside multi-token
        forwards, so every token's state is recorded and a cache can be cropped per row inside a
        verify forward (batched speculative decoding switches this on, and off again after). Mamba1
        mixers (`STEPWISE_MIXER_CLASSES`) always do, for chunks on a held state; other mixers whose
        code hands over the states the cache asks for (`ASKED_MIXER_CLASSES`) do while this is on."""
        if not self.has_per_token_recurrence:
            raise CacheInputError(f"{type(self.model).__name__} has no recurrent mixer of {MIXER_CLASSES} nor one "
                                  "that hands over per-token states")  # fmt: skip
        self._per_token.set(bool(enabled))
        self._asking = bool(enabled) and bool(self._asked)

    @property
    def per_token_recurrence(self) -> bool:
        """Whether the recurrent mixers currently run one token at a time."""
        return (bool(self._per_token) and self._per_token.enabled) or bool(self._stepwise) or self._asking

    @property
    def has_per_token_recurrence(self) -> bool:
        """Whether `set_per_token_recurrence` applies (the model has known recurrent mixers)."""
        return bool(self._per_token) or bool(self._stepwise) or bool(self._asked)

    #: Quantize the attention layers of `new_cache()` (`wrap_model(..., kv_bits=)`).
    kv_bits: int | None = None
    kv_group_size: int = 64

    def new_cache(self) -> Cache:
        """A fresh cache of the kind this model's layers need (`cache_from_config(model.config)`,
        attention quantized to `kv_bits` when set)."""
        return cache_from_config(self.config, kv_bits=self.kv_bits, group_size=self.kv_group_size)  # type: ignore[return-value]

    def __call__(
        self,
        input_ids: torch.Tensor,
        *,
        cache: Cache | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        logits_to_keep: int = 0,
        **model_kwargs: Any,
    ) -> torch.Tensor:
        check_logits_to_keep(logits_to_keep)
        pieces = cache.forward_segments(input_ids.shape[1]) if isinstance(cache, Cache) else []
        if self._one_by_one and isinstance(cache, Cache) and input_ids.shape[1] > 1 and any(
            cache.has_previous_state(i) for i in self._stepwise
        ):  # fmt: skip
            pieces = [1] * input_ids.shape[1]  # (a Mamba1 chunk would be scanned from zero)
        past = cache.get_seq_length() if len(pieces) > 1 else 0  # type: ignore[union-attr]
        if len(pieces) > 1 and (attention_mask is None or attention_mask.shape[1] == past + input_ids.shape[1]):
            return in_pieces(self.__call__, pieces, input_ids, cache, attention_mask, position_ids, past,
                             logits_to_keep, **model_kwargs)  # fmt: skip
        if attention_mask is not None and self._mask_per_new_token:
            attention_mask = attention_mask[:, -input_ids.shape[1] :]
        elif cache is not None and cache.is_ragged:
            attention_mask = ragged_masks(self.config, cache, attention_mask, input_ids.shape[1], self.model.dtype,
                                          input_ids.device)  # fmt: skip
        kwargs: dict[str, Any] = {"attention_mask": attention_mask, **model_kwargs}
        if position_ids is not None and self._takes_position_ids:
            kwargs["position_ids"] = position_ids
        if cache is None:
            kwargs["use_cache"] = False
        else:
            adapter = as_transformers_cache(cache)
            if (self._stepwise or self._asking) and isinstance(adapter, TransformersCache):
                adapter.stepwise_layers = self._stepwise | self._asked if self._asking else self._stepwise
            kwargs.update(cache=adapter, use_cache=True)
        if logits_to_keep and self._takes_logits_to_keep:
            kwargs["logits_to_keep"] = logits_to_keep
        logits = self.model(input_ids=input_ids, **kwargs).logits
        return logits[:, -logits_to_keep:] if logits_to_keep else logits


#: Layer types whose mask is only a padding mask over the new tokens (gated delta rule, LFM2's short
#: convolutions): transformers passes them none for tokens that are never padding.
STATE_LAYER_TYPES = frozenset({"linear_attention", "conv"})
#: Layer types that attend to nothing (Nemotron-H's MLP and MoE blocks): no mask at all.
MASKLESS_LAYER_TYPES = frozenset({"mlp", "moe"})


def _mask_layer_types(text: Any) -> tuple[list[str], list[dict[str, Any]]]:
    """The layer types the cache was built from (`cache_from_config`: Mistral-style configs name
    none and slide every layer; named types are taken as named, a "dummy" layer keeping its own
    mask's type) and each layer's cache arguments."""
    inferred, layer_kwargs = get_layer_types_and_kwargs(text)
    types = getattr(text, "layer_types", None) or inferred
    return [_MASK_ALIASES.get(kind, kind) for kind in types], layer_kwargs


#: inferred layer types that attend as another: parallel hybrids (Falcon-H1) attend in full or sliding
_MASK_ALIASES = {"hybrid": "full_attention", "hybrid_sliding": "sliding_attention"}


def ragged_refusal(config: Any) -> str | None:
    """Why a forward on rows of different lengths cannot be masked for `config`'s model (None: it
    can, through `ragged_masks`): ALiBi built from a 2-D padding mask (Bloom, Falcon with `alibi`)
    cannot place rows at different lengths, and only full, sliding and state layers get masks."""
    text = config.get_text_config(decoder=True)
    if text.model_type == "bloom" or (text.model_type == "falcon" and getattr(text, "alibi", False)):
        return f"{type(config).__name__} builds its ALiBi biases from a 2-D padding mask"
    known = {"full_attention", "sliding_attention", *STATE_LAYER_TYPES, *MASKLESS_LAYER_TYPES}
    unknown = sorted(set(_mask_layer_types(text)[0]) - known)
    return f"no mask for layer types {unknown} ({type(config).__name__})" if unknown else None


def ragged_masks(
    config: Any, cache: Cache, attention_mask: torch.Tensor | None, query_length: int, dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor | dict[str, torch.Tensor]:  # fmt: skip
    """The 4-D additive masks of a forward on a ragged cache (rows of different lengths after a
    per-row crop), which transformers' mask functions cannot express: they place every row's
    queries at one shared position. Each row's queries follow its own tokens (`get_seq_lengths`);
    a sliding layer sees itself and the `sliding_window - 1` keys before; `attention_mask` marks
    padding. One tensor for models of one layer type, else one per type (as Gemma3-style models
    accept them); transformers uses a prepared 4-D mask as given."""
    from ..models.modules import attention_bias

    refusal = ragged_refusal(config)
    if refusal:
        raise CacheInputError(f"rows of different lengths: {refusal}")
    text = config.get_text_config(decoder=True)
    types, layer_kwargs = _mask_layer_types(text)
    past = cache.get_seq_lengths().to(device)
    masks: dict[str, torch.Tensor] = {}
    for layer_idx, kind in enumerate(types):
        if kind in STATE_LAYER_TYPES or kind in MASKLESS_LAYER_TYPES:  # padding only ever precedes the prompt
            masks.setdefault(kind, None)  # type: ignore[arg-type]
        elif kind not in masks:
            kv_length, kv_offset = cache.get_mask_sizes(query_length, layer_idx)
            window = None
            if kind == "sliding_attention":
                window = layer_kwargs[layer_idx].get("sliding_window", text.sliding_window)
            masks[kind] = attention_bias(query_length=query_length, past_length=past, kv_length=kv_length,
                                         kv_offset=kv_offset, sliding_window=window, attention_mask=attention_mask,
                                         dtype=dtype, device=device)  # fmt: skip
    return masks if len(masks) > 1 else next(iter(masks.values()))  # type: ignore[return-value]


class TransformersEncoderDecoderLM(_GenerationDefaults):
    """A transformers encoder-decoder model (T5, Bart, ...) as a `kvcache.protocol.EncoderDecoderLM`."""

    is_encoder_decoder = True

    def __init__(self, model: PreTrainedModel) -> None:
        self.model = model
        self.config = model.config
        self.vocab_size = _vocab_size(model)
        self.decoder_start_token_id = _decoder_start_token_id(model)

    def new_cache(self) -> Any:
        """A fresh `EncoderDecoderCache` (`cache_from_config(model.config)`)."""
        return cache_from_config(self.config)

    def encode(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Encoder hidden states `[batch, src_len, hidden]`."""
        return self.model.get_encoder()(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state

    def __call__(
        self,
        input_ids: torch.Tensor,
        *,
        cache: Any = None,
        encoder_hidden_states: torch.Tensor,
        encoder_attention_mask: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        **model_kwargs: Any,
    ) -> torch.Tensor:
        # Decoder positions come from the cache length inside Bart/T5; `position_ids` is not an input there.
        kwargs: dict[str, Any] = {
            "encoder_outputs": (encoder_hidden_states,),
            "attention_mask": encoder_attention_mask,
            "decoder_attention_mask": attention_mask,
            **model_kwargs,
        }
        if cache is None:
            kwargs["use_cache"] = False
        else:
            kwargs.update(cache=as_transformers_cache(cache), use_cache=True)
        return self.model(decoder_input_ids=input_ids, **kwargs).logits


def _decoder_start_token_id(model: PreTrainedModel) -> int:
    """transformers' rule: the generation config's decoder start token, else its BOS token, else the config's."""
    sources = (model.generation_config, model.config)
    for name in ("decoder_start_token_id", "bos_token_id"):
        for source in sources:
            token = getattr(source, name, None)
            if isinstance(token, int) and not isinstance(token, bool):
                return token
    raise CacheInputError(
        f"{type(model).__name__}: set generation_config.decoder_start_token_id (or bos_token_id) to decode"
    )


def wrap_model(model: PreTrainedModel, *, kv_bits: int | None = None,
               group_size: int = 64) -> TransformersCausalLM | TransformersEncoderDecoderLM:  # fmt: skip
    """Adapt a transformers causal LM or encoder-decoder model to kvcache's generation protocol.

    The result's `new_cache()` is `cache_from_config(model.config)` (its attention quantized to
    `kv_bits`, 8, 4 or 2, in groups of `group_size`, for a causal LM); calling it runs the unmodified
    model with a kvcache cache, so `kvcache.generation.generate` and speculative decoding drive it.
    """
    if not isinstance(model, PreTrainedModel):
        raise CacheInputError(f"wrap_model takes a transformers PreTrainedModel, got {type(model).__name__}")
    if model.config.is_encoder_decoder:
        if kv_bits is not None:
            raise CacheInputError("kv_bits is for causal LMs (an encoder-decoder cache is not quantized)")
        return TransformersEncoderDecoderLM(model)
    wrapped = TransformersCausalLM(model)
    if kv_bits is not None:
        from ..layers.quant import check_quant

        wrapped.kv_bits, wrapped.kv_group_size = check_quant(kv_bits, group_size)
    return wrapped
