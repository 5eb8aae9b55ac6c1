"""How models plug into `kvcache.generation` (docs/contract.md, "Who calls what")."""

from __future__ import annotations

import inspect
from typing import Any, Protocol, runtime_checkable

import torch

from .cache import Cache


@runtime_checkable
class CausalLM(Protocol):
    """A decoder-only model: called on new tokens and the cache, returns their logits.

    `attention_mask` is `[batch, past + new]` (1 = real token, 0 = padding), `position_ids` is
    `[batch, new]`; both may be None for an unpadded batch. The model appends to `cache` itself.

    Optionally (`takes_logits_to_keep`), a `logits_to_keep` keyword as transformers' models take
    it: only the last `logits_to_keep` positions' logits are computed (0: every position). A
    prefill needs one position's; the head over every prompt token is wasted arithmetic and a
    `[batch, prompt, vocab]` tensor (600 MB for 1,000 tokens of a 150k vocabulary in float32).
    """

    vocab_size: int

    def __call__(
        self,
        input_ids: torch.Tensor,
        *,
        cache: Cache | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:  # logits [batch, new, vocab]
        ...

    def new_cache(self) -> Cache:
        """A fresh, empty cache of the kind this model's layers need."""
        ...


_KEEPS_LOGITS: dict[type, bool] = {}


def takes_logits_to_keep(model: Any) -> bool:
    """Whether `model`'s call names a `logits_to_keep` parameter (its class's answer, kept)."""
    kind = type(model)
    if kind not in _KEEPS_LOGITS:
        call = kind.forward if issubclass(kind, torch.nn.Module) else kind.__call__  # type: ignore[attr-defined]
        try:
            _KEEPS_LOGITS[kind] = "logits_to_keep" in inspect.signature(call).parameters
        except (TypeError, ValueError):  # a builtin or an object without a readable signature
            _KEEPS_LOGITS[kind] = False
    return _KEEPS_LOGITS[kind]


def last_logits(model: Any) -> dict[str, int]:
    """The keyword arguments that make `model` compute only the last position's logits (none for a
    model that does not take `logits_to_keep`: the caller slices, the result is the same)."""
    return {"logits_to_keep": 1} if takes_logits_to_keep(model) else {}


@runtime_checkable
class EncoderDecoderLM(Protocol):
    """An encoder-decoder model: `encode` once, then decode with an `EncoderDecoderCache`.

    The decoder call takes the new decoder tokens; cross-attention keys/values are written into
    the cache's cross-attention part on the first call and reused after.
    """

    vocab_size: int
    is_encoder_decoder: bool
    decoder_start_token_id: int

    def encode(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Encoder hidden states `[batch, src_len, hidden]`."""
        ...

    def __call__(
        self,
        input_ids: torch.Tensor,
        *,
        cache: Cache | None = None,
        encoder_hidden_states: torch.Tensor,
        encoder_attention_mask: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:  # logits [batch, new, vocab]
        ...

    def new_cache(self) -> Cache:
        """A fresh, empty `EncoderDecoderCache`."""
        ...
