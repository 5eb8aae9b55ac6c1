"""A decoder-only transformer: rotary positions, grouped-query attention, and a configurable
pattern of full and sliding-window attention layers (like Gemma / Mistral / gpt-oss)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from ..cache import Cache
from ..caches import DynamicCache, StaticCache
from ..layers.static_sliding import DEFAULT_ROLLBACK_TOKENS
from .modules import (
    MLP,
    RMSNorm,
    SelfAttention,
    check_inputs,
    check_layer_types,
    check_logits_to_keep,
    default_position_ids,
    in_pieces,
    init_weights,
    past_lengths,
)
from .packing import Packing, check_tokens_per_row

ATTENTION_TYPES = ("full_attention", "sliding_attention")


@dataclass
class DecoderConfig:
    """Shape of a `DecoderLM`. `layer_types` has one entry per layer: "full_attention" or
    "sliding_attention" (the latter sees itself and the `sliding_window - 1` tokens before it)."""

    vocab_size: int = 256
    hidden_size: int = 64
    intermediate_size: int = 128
    num_heads: int = 4
    num_kv_heads: int = 2
    layer_types: list[str] = field(default_factory=lambda: ["full_attention", "sliding_attention"])
    sliding_window: int | None = 8
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    tie_word_embeddings: bool = True

    def __post_init__(self) -> None:
        check_layer_types("layer_types", self.layer_types, ATTENTION_TYPES, self.sliding_window)

    @property
    def num_layers(self) -> int:
        return len(self.layer_types)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DecoderConfig:
        return cls(**data)


class DecoderBlock(nn.Module):
    """Pre-norm transformer block: attention then MLP, each added to the residual stream."""

    def __init__(self, config: DecoderConfig, layer_idx: int) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(config.hidden_size, config.norm_eps)
        self.attn = SelfAttention.for_layer(config, layer_idx, config.layer_types[layer_idx])
        self.mlp_norm = RMSNorm(config.hidden_size, config.norm_eps)
        self.mlp = MLP(config.hidden_size, config.intermediate_size)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor, **attn_kwargs: Any) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), position_ids, **attn_kwargs)
        return x + self.mlp(self.mlp_norm(x))


class DecoderLM(nn.Module):
    """Decoder-only language model implementing `kvcache.protocol.CausalLM`.

    `model(input_ids, cache=cache)` appends the new tokens' keys/values to `cache` and returns
    their logits `[batch, new, vocab]`; without a cache it runs the whole sequence at once.
    """

    #: The block built for each layer index; subclasses (the hybrid model) swap in their own.
    block_class: type[nn.Module] = DecoderBlock
    #: A forward crossing quantized blocks is computed at once where the cache can (`Cache.in_one_forward`),
    #: not one forward per block: the blocks' attention takes `blocks=True`.
    blocks_at_once: bool = True
    #: `tokens_per_row` leaves a forward's fillers out of the linear layers (`Packing`); a model
    #: whose mixers need every position (the hybrid's recurrence) computes them all.
    packs_rows: bool = True

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(self.block_class(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed.weight
        self.apply(init_weights)

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def device(self) -> torch.device:
        return self.embed.weight.device

    #: Quantize the attention layers of `new_cache()` to this many bits (8, 4 or 2; None: full precision),
    #: in groups of `kv_group_size` along head_dim.
    kv_bits: int | None = None
    kv_group_size: int = 64

    def new_cache(self, kv_bits: int | None = None, group_size: int | None = None) -> Cache:
        """A fresh `DynamicCache` with one layer per model layer, of the kind its layer type names;
        attention quantized to `kv_bits` (default: the model's `kv_bits`)."""
        bits = self.kv_bits if kv_bits is None else kv_bits
        return DynamicCache(layer_types=self.config.layer_types, sliding_window=self.config.sliding_window,
                            kv_bits=bits, group_size=group_size or self.kv_group_size)  # fmt: skip

    def new_static_cache(self, max_cache_len: int, rollback_tokens: int = DEFAULT_ROLLBACK_TOKENS) -> Cache:
        """A fresh `StaticCache` (fixed shapes, for `torch.compile`) with one layer per model layer."""
        return StaticCache(
            max_cache_len, layer_types=self.config.layer_types, sliding_window=self.config.sliding_window,
            rollback_tokens=rollback_tokens,
        )  # fmt: skip

    def forward(
        self,
        input_ids: torch.Tensor,
        *,
        cache: Cache | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        logits_to_keep: int = 0,
        tokens_per_row: list[int] | torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits of the new tokens `input_ids` `[batch, new]` (of the last `logits_to_keep` of
        them, when not 0), appending to `cache`. `tokens_per_row`: row b's real tokens are its
        first `tokens_per_row[b]`; the positions after them are fillers, whose logits and cache
        entries are unspecified (zeros where they are left out, `Packing`; the caller crops them)."""
        past_length = cache.get_seq_length() if cache is not None else 0
        check_inputs(input_ids, self.vocab_size, attention_mask, position_ids, past_length)
        check_logits_to_keep(logits_to_keep)
        batch, length = input_ids.shape
        counts = check_tokens_per_row(tokens_per_row, batch, length)
        pieces = cache.forward_segments(length) if cache is not None else [length]
        at_once = len(pieces) > 1 and self.blocks_at_once and len(cache.layers) >= len(self.layers) \
            and cache.in_one_forward(batch, attention_mask)  # fmt: skip
        if len(pieces) > 1 and not at_once:  # (fillers computed: a piece may hold only a row's fillers)
            return in_pieces(self.forward, pieces, input_ids, cache, attention_mask, position_ids, past_length,
                             logits_to_keep)  # fmt: skip
        rows_past = past_lengths(cache, input_ids.device)  # per row once a per-row crop left them ragged
        if position_ids is None:
            position_ids = default_position_ids(batch, length, rows_past, attention_mask, input_ids.device)
        packing = Packing.of(counts, batch, length, input_ids.device) if self.packs_rows and not at_once else None
        x = self.embed(input_ids)
        masks: dict[tuple, Any] = {}  # attention masks and rotary angles this forward's layers share
        extra: dict[str, Any] = {"blocks": True} if at_once else {}  # quantized layers: every piece's queries at once
        if packing is not None:
            x, extra = packing.pack(x), {"packing": packing}
        for block in self.layers:
            x = block(x, position_ids, cache=cache, past_length=rows_past, attention_mask=attention_mask, masks=masks,
                      **extra)  # fmt: skip
        if packing is not None:
            head = lambda h: self.lm_head(self.norm(h))  # noqa: E731
            return packing.unpack_last(x, min(logits_to_keep or length, length), head)
        if logits_to_keep:
            x = x[:, -logits_to_keep:]
        return self.lm_head(self.norm(x))
