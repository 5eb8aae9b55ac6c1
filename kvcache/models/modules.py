"""Building blocks shared by the reference models: norm, rotary embedding, MLP, the attention
module, input checks.

Attention reads its mask geometry from the cache exactly like transformers' model code: before
appending, `cache.get_mask_sizes(query_length, layer_idx)` says how many keys the update will
return (`kv_length`) and the absolute position of the first one (`kv_offset`); the causal,
sliding-window and padding masks (`attention`) are then built for those key positions. A sliding
layer that returns only its window therefore gets the right columns of the padding mask.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..cache import Cache
from ..errors import CacheInputError, KVCacheError
from .attention import attend, attention_bias, blocks_bias, masked_attention
from .packing import Packing

__all__ = ["attend", "attention_bias", "masked_attention"]  # re-exported: the models import them from here


def init_weights(module: nn.Module) -> None:
    """GPT-2 style init (normal, std 0.02): keeps initial logits small, so training starts near
    the uniform loss `log(vocab)`."""
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, std=0.02)
        if getattr(module, "bias", None) is not None:
            nn.init.zeros_(module.bias)


class RMSNorm(nn.Module):
    """Root-mean-square layer norm with a learned scale."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        variance = x.float().pow(2).mean(-1, keepdim=True)
        return (x.float() * torch.rsqrt(variance + self.eps)).to(x.dtype) * self.weight


class MLP(nn.Module):
    """SwiGLU feed-forward block."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.gate = nn.Linear(dim, hidden, bias=False)
        self.up = nn.Linear(dim, hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


def rotary_cos_sin(
    position_ids: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin `[batch, 1, seq, head_dim]` for rotary embedding at `position_ids` `[batch, seq]`."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=position_ids.device).float() / head_dim))
    angles = position_ids.float()[..., None] * inv_freq  # [batch, seq, head_dim/2]
    angles = torch.cat([angles, angles], dim=-1)[:, None]
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate `x` `[batch, heads, seq, head_dim]` by the rotary angles (rotate-half convention)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def check_layer_types(name: str, layer_types: list[str], allowed: tuple[str, ...], sliding_window: int | None) -> None:
    """Reject a model config whose `layer_types` are empty or unknown, or whose sliding layers lack a window."""
    if not layer_types or any(t not in allowed for t in layer_types):
        raise CacheInputError(f"{name} must be a non-empty list of {allowed}, got {layer_types}")
    if "sliding_attention" in layer_types and (sliding_window is None or sliding_window < 1):
        raise CacheInputError(f"sliding layers need a positive sliding_window, got {sliding_window!r}")


def new_tokens_real(attention_mask: torch.Tensor | None, length: int,
                    masks: dict[tuple, Any] | None) -> torch.Tensor | None:  # fmt: skip
    """Which of a forward's `length` new tokens are real, not padding (`[batch, 1, length, 1]`,
    from `attention_mask`), or None where all are: no mask, or every new token real as read on
    the host (a decode step of a padded batch; on an accelerator the mask is kept rather than have
    the host wait). Shared by the layers of one forward (`masks`)."""
    if attention_mask is None or attention_mask.shape[1] < length:
        return None
    key = ("real", id(attention_mask), length)
    if masks is not None and key in masks:
        return masks[key]
    real: torch.Tensor | None = attention_mask[:, None, -length:, None].bool()
    if attention_mask.device.type == "cpu" and not torch.compiler.is_compiling() and bool(real.all()):  # type: ignore[union-attr]
        real = None
    if masks is not None:
        masks[key] = real
    return real


def check_inputs(
    input_ids: torch.Tensor,
    vocab_size: int,
    attention_mask: torch.Tensor | None,
    position_ids: torch.Tensor | None,
    past_length: int,
) -> None:
    """Raise `CacheInputError` naming what is wrong with a model call's token/mask/position inputs."""
    integer = isinstance(input_ids, torch.Tensor) and input_ids.dtype in (torch.long, torch.int)
    if not integer or input_ids.dim() != 2:
        raise CacheInputError("input_ids must be an integer tensor [batch, seq]")
    if input_ids.shape[1] == 0:
        raise CacheInputError("input_ids has no tokens")
    # Range check on the host only, and not in a compiled forward: on an accelerator, or traced, it
    # would make the host wait every step (the generation driver validates prompts once, up front).
    on_host = input_ids.device.type == "cpu" and not torch.compiler.is_compiling()
    if on_host and input_ids.numel() and (int(input_ids.min()) < 0 or int(input_ids.max()) >= vocab_size):
        raise CacheInputError(f"input_ids out of range for vocab_size {vocab_size}")
    batch, length = input_ids.shape
    if attention_mask is not None and tuple(attention_mask.shape) != (batch, past_length + length):
        raise CacheInputError(
            f"attention_mask must be [batch, past + new] = [{batch}, {past_length + length}], "
            f"got {list(attention_mask.shape)}"
        )
    if position_ids is not None and tuple(position_ids.shape) not in ((batch, length), (1, length)):
        raise CacheInputError(
            f"position_ids must be [batch, new] = [{batch}, {length}], got {list(position_ids.shape)}"
        )


def in_pieces(forward: Any, pieces: list[int], input_ids: torch.Tensor, cache: Any,
              attention_mask: torch.Tensor | None, position_ids: torch.Tensor | None, past: int,
              logits_to_keep: int = 0, **kwargs: Any) -> torch.Tensor:  # fmt: skip
    """`forward` run on consecutive pieces of `input_ids` (`Cache.forward_segments`), each with its
    part of the mask and positions; the logits of all (of the last `logits_to_keep`, when not 0),
    concatenated. A piece whose positions are all dropped computes one position's logits only."""
    out, start = [], 0
    first_kept = input_ids.shape[1] - logits_to_keep if logits_to_keep else 0
    for n in pieces:
        mask = None if attention_mask is None else attention_mask[:, : past + start + n]
        positions = None if position_ids is None else position_ids[:, start : start + n]
        wanted = start + n - max(first_kept, start)  # this piece's positions that are returned
        keep = {"logits_to_keep": 1 if wanted <= 0 else wanted} if logits_to_keep and wanted < n else {}
        logits = forward(input_ids[:, start : start + n], cache=cache, attention_mask=mask, position_ids=positions,
                         **keep, **kwargs)  # fmt: skip
        if wanted > 0:
            out.append(logits)
        start += n
    return torch.cat(out, dim=1)


def check_logits_to_keep(logits_to_keep: Any) -> int:
    """`logits_to_keep` as transformers takes it (the last k positions' logits; 0: all), or
    `CacheInputError` naming the value."""
    if isinstance(logits_to_keep, bool) or not isinstance(logits_to_keep, int) or logits_to_keep < 0:
        raise CacheInputError(f"logits_to_keep must be an int >= 0 (0 keeps every position), got {logits_to_keep!r}")
    return logits_to_keep


def past_lengths(cache: Any, device: torch.device) -> int | torch.Tensor:
    """What every row of a batch holds in `cache`: one int, or an int64 `[batch]` tensor on `device`
    once a per-row crop left rows of different lengths (each row's queries then follow its own
    tokens; `attention_bias` takes either)."""
    if cache is None:
        return 0
    if getattr(cache, "is_ragged", False):
        return cache.get_seq_lengths().to(device)
    return cache.get_seq_length()


def default_position_ids(
    batch: int, length: int, past_length: int | torch.Tensor, attention_mask: torch.Tensor | None,
    device: torch.device,
) -> torch.Tensor:  # fmt: skip
    """Positions of the new tokens: from the padding mask when given (pads do not count), else
    continuing from `past_length` (per row, when it is a tensor)."""
    per_row = isinstance(past_length, torch.Tensor) and past_length.dim() == 1
    if attention_mask is not None and not per_row:
        positions = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
        return positions[:, -length:]
    if per_row:
        start = past_length[:, None]
        if attention_mask is not None:  # left padding: pads before each row's end do not count
            columns = torch.arange(attention_mask.shape[1], device=device)
            start = start - ((columns[None, :] < start) & ~attention_mask.bool()).sum(-1, keepdim=True)
        return start + torch.arange(length, device=device)
    return (past_length + torch.arange(length, device=device)).expand(batch, length)


class SelfAttention(nn.Module):
    """Self-attention with rotary positions, grouped-query heads and an optional sliding window,
    reading and growing `cache` layer `layer_idx`. `causal=False` (an encoder) takes no cache."""

    def __init__(
        self,
        dim: int,
        num_heads: int,
        num_kv_heads: int,
        layer_idx: int,
        *,
        sliding_window: int | None = None,
        rope_theta: float = 10000.0,
        causal: bool = True,
    ) -> None:
        super().__init__()
        self.causal = causal
        if dim % num_heads or num_heads % num_kv_heads:
            raise CacheInputError(f"dim {dim}, heads {num_heads}, kv heads {num_kv_heads} do not divide evenly")
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, dim // num_heads
        self.layer_idx, self.sliding_window, self.rope_theta = layer_idx, sliding_window, rope_theta
        self.q_proj = nn.Linear(dim, num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(dim, num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(dim, num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(num_heads * self.head_dim, dim, bias=False)

    @classmethod
    def for_layer(cls, config: Any, layer_idx: int, layer_type: str, *, causal: bool = True) -> SelfAttention:
        """The attention of layer `layer_idx` of a model `config` (hidden_size, num_heads, num_kv_heads,
        rope_theta, sliding_window); a "sliding_attention" layer gets the window."""
        window = config.sliding_window if layer_type == "sliding_attention" else None
        return cls(
            config.hidden_size, config.num_heads, config.num_kv_heads, layer_idx,
            sliding_window=window, rope_theta=config.rope_theta, causal=causal,
        )  # fmt: skip

    def forward(
        self,
        x: torch.Tensor,
        position_ids: torch.Tensor,
        *,
        cache: Cache | None,
        past_length: int | torch.Tensor,
        attention_mask: torch.Tensor | None,
        masks: dict[tuple, torch.Tensor] | None = None,
        blocks: bool = False,
        packing: Packing | None = None,
    ) -> torch.Tensor:
        """`blocks`: the forward's queries span several quantized blocks, computed at once
        (`Cache.update_blocks`, `blocks_bias`), one row without padding. `packing`: `x` holds the
        forward's real tokens only (`[tokens, dim]`); the rest of the rectangle is zeros here."""
        batch, length = (packing.batch, packing.length) if packing is not None else x.shape[:2]

        def heads(linear: nn.Linear, count: int) -> torch.Tensor:
            y = linear(x) if packing is None else packing.unpack(linear(x))
            return y.view(batch, length, count, self.head_dim).transpose(1, 2)

        q, k, v = heads(self.q_proj, self.num_heads), heads(self.k_proj, self.num_kv_heads), \
            heads(self.v_proj, self.num_kv_heads)  # fmt: skip
        angles = ("rotary", self.head_dim, self.rope_theta, q.dtype)  # the same for every layer of a forward
        cos_sin = None if masks is None else masks.get(angles)
        if cos_sin is None:
            cos_sin = rotary_cos_sin(position_ids, self.head_dim, self.rope_theta, q.dtype)
            if masks is not None:
                masks[angles] = cos_sin
        cos, sin = cos_sin
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if cache is None:
            kv_length, kv_offset = length, 0
        elif not self.causal:
            raise CacheInputError("a non-causal (encoder) attention layer takes no cache")
        elif blocks and hasattr(cache.layers[self.layer_idx], "update_blocks"):  # (other layers: as usual)
            k, v, geometry = cache.update_blocks(k, v, self.layer_idx)
            block = cache.layers[self.layer_idx].forward_block
            key = ("blocks", past_length, length, geometry, block, self.sliding_window)
            bias = None if masks is None else masks.get(key)
            if bias is None:
                bias = blocks_bias(past_length, length, geometry, block, self.sliding_window, q.dtype, q.device)
                if masks is not None:
                    masks[key] = bias
            return self.o_proj(attend(q, k, v, bias).transpose(1, 2).reshape(batch, length, -1))
        else:
            kv_length, kv_offset = cache.get_mask_sizes(length, self.layer_idx)
            real = new_tokens_real(attention_mask, length, masks)
            if real is not None:
                # padding's keys/values are held as zeros: attention never reads them, but a
                # quantized block's scales would, and whatever a padding slot computed (it
                # differs with the forward's width) must not reach the real tokens sharing it
                k, v = torch.where(real, k, 0.0), torch.where(real, v, 0.0)
            k, v = cache.update(k, v, self.layer_idx)
            if k.shape[2] != kv_length:
                raise KVCacheError(
                    f"layer {self.layer_idx}: cache returned {k.shape[2]} keys, get_mask_sizes said {kv_length}"
                )
        out = masked_attention(q, k, v, past_length=past_length, kv_offset=kv_offset,
                               sliding_window=self.sliding_window, attention_mask=attention_mask, causal=self.causal,
                               masks=masks)  # fmt: skip
        out = out.transpose(1, 2).reshape(batch, length, -1)
        return self.o_proj(out if packing is None else packing.pack(out))
