"""An encoder-decoder transformer (T5 / BART shape) whose decoder cross-attends to the encoder.

The decoder uses an `EncoderDecoderCache` the way transformers' BART/T5 code does: self-attention
keys/values grow in `cache.self_attention_cache`; cross-attention keys/values are projected from
the encoder output once, written to `cache.cross_attention_cache` and flagged in
`cache.is_updated[layer_idx]`, and read back from `cross_attention_cache.layers[layer_idx]` on
every later step.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from ..caches import DynamicCache
from ..errors import CacheInputError
from .decoder import ATTENTION_TYPES
from .modules import (
    MLP,
    RMSNorm,
    SelfAttention,
    attend,
    check_inputs,
    check_layer_types,
    default_position_ids,
    init_weights,
    past_lengths,
)


@dataclass
class EncoderDecoderConfig:
    """Shape of an `EncoderDecoderLM`; `decoder_layer_types` as in `DecoderConfig.layer_types`."""

    vocab_size: int = 256
    hidden_size: int = 64
    intermediate_size: int = 128
    num_heads: int = 4
    num_kv_heads: int = 2
    encoder_layers: int = 2
    decoder_layer_types: list[str] = field(default_factory=lambda: ["full_attention", "sliding_attention"])
    sliding_window: int | None = 8
    decoder_start_token_id: int = 0
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6

    def __post_init__(self) -> None:
        check_layer_types("decoder_layer_types", self.decoder_layer_types, ATTENTION_TYPES, self.sliding_window)
        if not 0 <= self.decoder_start_token_id < self.vocab_size:
            raise CacheInputError(f"decoder_start_token_id {self.decoder_start_token_id} is outside the vocabulary")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class CrossAttention(nn.Module):
    """Decoder queries attend to the encoder output; its keys/values are computed once per cache."""

    def __init__(self, dim: int, num_heads: int, num_kv_heads: int, layer_idx: int) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, dim // num_heads
        self.layer_idx = layer_idx
        self.q_proj = nn.Linear(dim, dim, bias=False)
        self.k_proj = nn.Linear(dim, num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(dim, num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(dim, dim, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        *,
        cache: Any,
        encoder_attention_mask: torch.Tensor | None,
    ) -> torch.Tensor:
        batch, length, _ = x.shape
        q = self.q_proj(x).view(batch, length, self.num_heads, self.head_dim).transpose(1, 2)
        if cache is not None and cache.is_updated.get(self.layer_idx):
            held = cache.cross_attention_cache.layers[self.layer_idx]
            k, v = held.keys, held.values
        else:
            src = encoder_hidden_states.shape[1]
            k = self.k_proj(encoder_hidden_states).view(batch, src, self.num_kv_heads, self.head_dim).transpose(1, 2)
            v = self.v_proj(encoder_hidden_states).view(batch, src, self.num_kv_heads, self.head_dim).transpose(1, 2)
            if cache is not None:
                k, v = cache.cross_attention_cache.update(k, v, self.layer_idx)
                cache.is_updated[self.layer_idx] = True
        bias = torch.zeros(1, 1, 1, k.shape[2], dtype=x.dtype, device=x.device)
        if encoder_attention_mask is not None:
            hidden = ~encoder_attention_mask.bool()[:, None, None, :]
            bias = bias.masked_fill(hidden, torch.finfo(x.dtype).min)
        out = attend(q, k, v, bias)
        return self.o_proj(out.transpose(1, 2).reshape(batch, length, -1))


class EncoderBlock(nn.Module):
    """Bidirectional self-attention then MLP (pre-norm)."""

    def __init__(self, config: EncoderDecoderConfig, layer_idx: int) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(config.hidden_size, config.norm_eps)
        self.attn = SelfAttention.for_layer(config, layer_idx, "full_attention", causal=False)
        self.mlp_norm = RMSNorm(config.hidden_size, config.norm_eps)
        self.mlp = MLP(config.hidden_size, config.intermediate_size)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), position_ids, cache=None, past_length=0, attention_mask=attention_mask)
        return x + self.mlp(self.mlp_norm(x))


class DecoderBlock(nn.Module):
    """Causal self-attention, cross-attention to the encoder, MLP (pre-norm)."""

    def __init__(self, config: EncoderDecoderConfig, layer_idx: int) -> None:
        super().__init__()
        self.self_norm = RMSNorm(config.hidden_size, config.norm_eps)
        self.self_attn = SelfAttention.for_layer(config, layer_idx, config.decoder_layer_types[layer_idx])
        self.cross_norm = RMSNorm(config.hidden_size, config.norm_eps)
        self.cross_attn = CrossAttention(config.hidden_size, config.num_heads, config.num_kv_heads, layer_idx)
        self.mlp_norm = RMSNorm(config.hidden_size, config.norm_eps)
        self.mlp = MLP(config.hidden_size, config.intermediate_size)

    def forward(
        self,
        x: torch.Tensor,
        position_ids: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        *,
        cache: Any,
        past_length: int | torch.Tensor,
        attention_mask: torch.Tensor | None,
        encoder_attention_mask: torch.Tensor | None,
    ) -> torch.Tensor:
        self_cache = cache.self_attention_cache if cache is not None else None
        x = x + self.self_attn(
            self.self_norm(x), position_ids, cache=self_cache, past_length=past_length, attention_mask=attention_mask
        )
        x = x + self.cross_attn(
            self.cross_norm(x), encoder_hidden_states, cache=cache, encoder_attention_mask=encoder_attention_mask
        )
        return x + self.mlp(self.mlp_norm(x))


class EncoderDecoderLM(nn.Module):
    """Encoder-decoder language model implementing `kvcache.protocol.EncoderDecoderLM`."""

    is_encoder_decoder = True

    def __init__(self, config: EncoderDecoderConfig) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)  # shared by encoder and decoder
        self.encoder_layers = nn.ModuleList(EncoderBlock(config, i) for i in range(config.encoder_layers))
        self.encoder_norm = RMSNorm(config.hidden_size, config.norm_eps)
        self.decoder_layers = nn.ModuleList(DecoderBlock(config, i) for i in range(len(config.decoder_layer_types)))
        self.decoder_norm = RMSNorm(config.hidden_size, config.norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.lm_head.weight = self.embed.weight
        self.apply(init_weights)

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def decoder_start_token_id(self) -> int:
        return self.config.decoder_start_token_id

    @property
    def device(self) -> torch.device:
        return self.embed.weight.device

    def new_cache(self) -> Any:
        """An `EncoderDecoderCache`: full/sliding self-attention layers and full cross layers."""
        from ..encoder_decoder import EncoderDecoderCache

        layer_types = self.config.decoder_layer_types
        return EncoderDecoderCache(
            DynamicCache(layer_types=layer_types, sliding_window=self.config.sliding_window),
            DynamicCache(layer_types=["full_attention"] * len(layer_types)),
        )

    def encode(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Encoder output `[batch, src_len, hidden]`; `attention_mask` marks padding (any side)."""
        check_inputs(input_ids, self.vocab_size, attention_mask, None, 0)
        batch, length = input_ids.shape
        position_ids = default_position_ids(batch, length, 0, attention_mask, input_ids.device)
        x = self.embed(input_ids)
        for block in self.encoder_layers:
            x = block(x, position_ids, attention_mask)
        return self.encoder_norm(x)

    def forward(
        self,
        input_ids: torch.Tensor,
        *,
        cache: Any = None,
        encoder_hidden_states: torch.Tensor,
        encoder_attention_mask: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits of the new decoder tokens `input_ids` `[batch, new]`, appending to `cache`."""
        past_length = cache.get_seq_length() if cache is not None else 0
        check_inputs(input_ids, self.vocab_size, attention_mask, position_ids, past_length)
        batch, length = input_ids.shape
        if encoder_hidden_states.dim() != 3 or encoder_hidden_states.shape[0] != batch:
            raise CacheInputError(
                f"encoder_hidden_states must be [batch={batch}, src_len, hidden], "
                f"got {list(encoder_hidden_states.shape)}"
            )
        if encoder_attention_mask is not None and encoder_attention_mask.shape != encoder_hidden_states.shape[:2]:
            raise CacheInputError(
                f"encoder_attention_mask must be [batch, src_len] = {list(encoder_hidden_states.shape[:2])}, "
                f"got {list(encoder_attention_mask.shape)}"
            )
        rows_past = past_lengths(cache, input_ids.device)  # per row once a per-row crop left them ragged
        if position_ids is None:
            position_ids = default_position_ids(batch, length, rows_past, attention_mask, input_ids.device)
        x = self.embed(input_ids)
        for block in self.decoder_layers:
            x = block(
                x,
                position_ids,
                encoder_hidden_states,
                cache=cache,
                past_length=rows_past,
                attention_mask=attention_mask,
                encoder_attention_mask=encoder_attention_mask,
            )
        return self.lm_head(self.decoder_norm(x))


__all__ = ["CrossAttention", "EncoderDecoderConfig", "EncoderDecoderLM"]
