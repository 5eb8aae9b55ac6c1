"""A hybrid model: attention layers, recurrent layers, and parallel-hybrid layers that run both.

The recurrent mixer is a gated linear recurrence in the style of Mamba2 / gated delta net: a
causal depthwise conv over the q/k/v channels, then per head a matrix state

    S_t = a_t * S_{t-1} + beta_t * k_t v_t^T,        y_t = S_t^T q_t

with a data-dependent decay `a_t` in (0, 1) and input gate `beta_t`. It is computed with a plain
loop over tokens (clarity over speed). It talks to the cache as transformers' Mamba2 / Qwen3-Next
code does: `update_conv_state` (returns the window the conv must read), `get_recurrent_state`
(None before the first update) and `update_recurrent_state`, optionally with the per-token
`intermediate_states` a speculative decoder needs to roll back inside a verified chunk.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..cache import Cache
from .decoder import DecoderLM
from .modules import MLP, RMSNorm, SelfAttention, check_layer_types

HYBRID_LAYER_TYPES = ("full_attention", "sliding_attention", "linear_attention", "hybrid")


@dataclass
class HybridConfig:
    """Shape of a `HybridLM`. `layer_types` per layer: "full_attention", "sliding_attention",
    "linear_attention" (the recurrent mixer only) or "hybrid" (full attention and the recurrent
    mixer side by side on the same input, outputs summed)."""

    vocab_size: int = 256
    hidden_size: int = 64
    intermediate_size: int = 128
    num_heads: int = 4
    num_kv_heads: int = 2
    layer_types: list[str] = field(
        default_factory=lambda: ["linear_attention", "full_attention", "hybrid", "sliding_attention"]
    )
    sliding_window: int | None = 8
    recurrent_heads: int = 2
    recurrent_key_dim: int = 16
    recurrent_value_dim: int = 16
    conv_kernel_size: int = 4
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    tie_word_embeddings: bool = True

    def __post_init__(self) -> None:
        check_layer_types("layer_types", self.layer_types, HYBRID_LAYER_TYPES, self.sliding_window)

    @property
    def num_layers(self) -> int:
        return len(self.layer_types)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def gated_linear_recurrence(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, decay: torch.Tensor, beta: torch.Tensor, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`S_t = decay_t * S_{t-1} + beta_t * k_t v_t^T`, `y_t = S_t^T q_t`, one token at a time, in fp32.

    q, k `[batch, T, heads, dk]`; v `[batch, T, heads, dv]`; decay, beta `[batch, T, heads]`;
    state `[batch, heads, dk, dv]` (S_0). Returns y `[batch, T, heads, dv]` and every S_t
    `[batch, T, heads, dk, dv]` (the last one is the new state).
    """
    outputs, states = [], []
    for t in range(q.shape[1]):
        update = torch.einsum("bhk,bhv->bhkv", k[:, t].float(), v[:, t].float())
        state = decay[:, t, :, None, None] * state + beta[:, t, :, None, None] * update
        outputs.append(torch.einsum("bhk,bhkv->bhv", q[:, t].float(), state))
        states.append(state)
    return torch.stack(outputs, dim=1), torch.stack(states, dim=1)


class GatedLinearRecurrence(nn.Module):
    """Causal depthwise conv + gated linear recurrence with a per-head matrix state.

    With `attention_mask`, padding tokens are made no-ops: their conv inputs are zero and the
    recurrence keeps its state (decay 1, input gate 0), so a left-padded row computes exactly what
    it computes alone.
    """

    def __init__(self, config: HybridConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.heads, self.dk, self.dv = config.recurrent_heads, config.recurrent_key_dim, config.recurrent_value_dim
        self.kernel = config.conv_kernel_size
        self.conv_channels = self.heads * (2 * self.dk + self.dv)
        self.in_proj = nn.Linear(config.hidden_size, self.conv_channels, bias=False)
        self.conv = nn.Conv1d(self.conv_channels, self.conv_channels, self.kernel, groups=self.conv_channels)
        self.gates = nn.Linear(config.hidden_size, 2 * self.heads)  # decay and input gate logits
        self.out_gate = nn.Linear(config.hidden_size, self.heads * self.dv, bias=False)
        self.out_norm = RMSNorm(self.dv, config.norm_eps)
        self.out_proj = nn.Linear(self.heads * self.dv, config.hidden_size, bias=False)
        self.return_intermediate_states = False  # hand per-token states to the cache (speculative rollback)

    def causal_conv(self, inputs: torch.Tensor, cache: Cache | None) -> torch.Tensor:
        """Conv outputs `[batch, channels, n]` for the new inputs `[batch, channels, n]`.

        The conv reads the last `kernel - 1 + n` columns of what the cache returns (zeros before
        the first token), always the same width, so the result does not depend on how much history
        the cache happens to hold (e.g. while recording).
        """
        n, need = inputs.shape[-1], self.kernel - 1 + inputs.shape[-1]
        window = inputs if cache is None else cache.update_conv_state(inputs, self.layer_idx, 0, self.kernel)
        window = window[..., -need:] if window.shape[-1] >= need else F.pad(window, (need - window.shape[-1], 0))
        out = F.conv1d(window, self.conv.weight, self.conv.bias, groups=self.conv_channels)
        assert out.shape[-1] == n
        return out

    def forward(self, x: torch.Tensor, *, cache: Cache | None, token_mask: torch.Tensor | None) -> torch.Tensor:
        batch, length, _ = x.shape
        conv_in = self.in_proj(x)
        if token_mask is not None:
            conv_in = conv_in * token_mask[..., None].to(conv_in.dtype)
        qkv = F.silu(self.causal_conv(conv_in.transpose(1, 2), cache)).transpose(1, 2)
        q, k, v = qkv.split([self.heads * self.dk, self.heads * self.dk, self.heads * self.dv], dim=-1)
        q = F.normalize(q.view(batch, length, self.heads, self.dk), dim=-1) * self.dk**-0.5
        k = F.normalize(k.view(batch, length, self.heads, self.dk), dim=-1)
        v = v.view(batch, length, self.heads, self.dv)
        decay_logit, gate_logit = self.gates(x).float().chunk(2, dim=-1)  # [batch, length, heads]
        decay, beta = torch.sigmoid(decay_logit + 2.0), torch.sigmoid(gate_logit)
        if token_mask is not None:
            keep = token_mask[..., None].bool()
            decay, beta = decay.masked_fill(~keep, 1.0), beta.masked_fill(~keep, 0.0)

        state = cache.get_recurrent_state(self.layer_idx) if cache is not None else None
        if state is None:
            state = x.new_zeros(batch, self.heads, self.dk, self.dv, dtype=torch.float32)
        outputs, states = gated_linear_recurrence(q, k, v, decay, beta, state)
        if cache is not None:
            extra = {"intermediate_states": states} if self.return_intermediate_states else {}
            cache.update_recurrent_state(states[:, -1], self.layer_idx, 0, **extra)

        y = self.out_norm(outputs.to(x.dtype))  # [batch, length, heads, dv]
        y = y.reshape(batch, length, -1) * F.silu(self.out_gate(x))
        return self.out_proj(y)


class HybridBlock(nn.Module):
    """Pre-norm block whose mixer is attention, the recurrence, or both in parallel; then an MLP."""

    def __init__(self, config: HybridConfig, layer_idx: int) -> None:
        super().__init__()
        kind = config.layer_types[layer_idx]
        self.norm = RMSNorm(config.hidden_size, config.norm_eps)
        self.attn = None
        if kind != "linear_attention":
            self.attn = SelfAttention.for_layer(config, layer_idx, kind)
        self.recurrent = GatedLinearRecurrence(config, layer_idx) if kind in ("linear_attention", "hybrid") else None
        self.mlp_norm = RMSNorm(config.hidden_size, config.norm_eps)
        self.mlp = MLP(config.hidden_size, config.intermediate_size)

    def forward(
        self,
        x: torch.Tensor,
        position_ids: torch.Tensor,
        *,
        cache: Cache | None,
        past_length: int | torch.Tensor,
        attention_mask: torch.Tensor | None,
        masks: dict[tuple, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        h = self.norm(x)
        mixed = torch.zeros_like(x)
        if self.attn is not None:
            mixed = mixed + self.attn(
                h, position_ids, cache=cache, past_length=past_length, attention_mask=attention_mask, masks=masks
            )
        if self.recurrent is not None:
            token_mask = None if attention_mask is None else attention_mask[:, -x.shape[1] :]
            mixed = mixed + self.recurrent(h, cache=cache, token_mask=token_mask)
        x = x + mixed
        return x + self.mlp(self.mlp_norm(x))


class HybridLM(DecoderLM):
    """Hybrid language model implementing `kvcache.protocol.CausalLM`: `DecoderLM`'s embedding,
    head and forward over `HybridBlock`s; its cache mixes attention layers, `RecurrentLayer`s and
    `HybridLayer`s (`new_cache` builds them from the layer types)."""

    block_class = HybridBlock
    blocks_at_once = False  # its blocks feed quantized layers one forward per block
    packs_rows = False  # its recurrence and convolutions read every position: fillers are computed

    def set_return_intermediate_states(self, enabled: bool) -> None:
        """Hand per-token recurrent states to the cache, so `crop` can land inside a multi-token step."""
        for block in self.layers:
            if block.recurrent is not None:
                block.recurrent.return_intermediate_states = enabled
