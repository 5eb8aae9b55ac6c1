"""How models plug into `kvcache.generation` (docs/contract.md, "Who calls what")."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from .cache import Cache


@runtime_checkable
class CausalLM(Protocol):
    """A decoder-only model: called on new tokens and the cache, returns their logits.

    `attention_mask` is `[batch, past + new]` (1 = real token, 0 = padding), `position_ids` is
    `[batch, new]`; both may be None for an unpadded batch. The model appends to `cache` itself.
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
