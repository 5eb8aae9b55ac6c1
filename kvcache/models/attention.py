"""Softmax attention for the reference models, costing what attention costs: the scores and no
quadratic work beyond them where the geometry allows.

Queries sit at absolute positions `past_length + i`, keys at `kv_offset + j` (the geometry the
cache reports through `get_mask_sizes`). Where every key is visible (a decode step), where the
keys are exactly the queries' own (a prefill from nothing: causal), where a block of queries
follows keys they all see (a prefill block onto a cache: the held prefix unmasked, the block
causal, the two softmaxes merged by their log-sum-exps, unless the block's scores are few: see
`SMALL_MASK`) or where a long prefill meets a sliding window (blocks of the window), no mask over
all keys is built. Otherwise one additive mask is built, and shared by the layers of one forward
that need the same one.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

#: Scores below which a block onto a cache is attended with one mask rather than in two merged
#: pieces: a verify forward's few queries over a short context (9 over 250 keys on the bundled
#: model: 1.72 ms against 1.94 ms for the whole forward), where building the small mask, shared
#: by the forward's layers, costs less than a second kernel call and the merge.
SMALL_MASK = 1 << 16
#: The CPU flash-attention kernel behind `scaled_dot_product_attention`, which also returns the
#: log-sum-exp of each query's scores (what merging two partial softmaxes needs).
_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def attention_bias(
    *,
    query_length: int,
    past_length: int | torch.Tensor,
    kv_length: int,
    kv_offset: int,
    sliding_window: int | None,
    attention_mask: torch.Tensor | None,
    dtype: torch.dtype,
    device: torch.device,
    causal: bool = True,
) -> torch.Tensor:
    """Additive mask `[batch or 1, 1, query_length, kv_length]`: 0 where a query may attend, the
    dtype's minimum elsewhere.

    Query `i` sits at absolute position `past_length + i` (of its own row, when `past_length` is a
    `[batch]` tensor: rows of a ragged cache), key `j` at `kv_offset + j`; a key is visible when it
    is not in the future (for a `causal` mask), within the window for a sliding layer, and not
    padding (`attention_mask[:, kv_offset + j]`). Keys past the mask's end (a static cache's
    unwritten slots, a shorter row's stale slots) are future keys and stay hidden.
    """
    per_row = isinstance(past_length, torch.Tensor) and past_length.dim() == 1  # 0-dim: a compiled static length
    start = past_length[:, None] if per_row else past_length
    q_pos = start + torch.arange(query_length, device=device)[None, :]  # [batch or 1, q]
    k_pos = kv_offset + torch.arange(kv_length, device=device)
    allowed = k_pos[None, None, :] <= q_pos[:, :, None]
    if not causal:
        allowed = torch.ones_like(allowed)
    if sliding_window is not None:
        allowed &= (q_pos[:, :, None] - k_pos[None, None, :]) < sliding_window
    allowed = allowed[:, None]
    if attention_mask is not None:
        columns = k_pos.clamp(max=attention_mask.shape[1] - 1)
        allowed = allowed & attention_mask.bool()[:, columns][:, None, None, :]
    bias = torch.zeros(allowed.shape, dtype=dtype, device=device)
    return bias.masked_fill(~allowed, torch.finfo(dtype).min)


def blocks_bias(past: int, length: int, geometry: tuple[int, int, int], block: int, sliding_window: int | None,
                dtype: torch.dtype, device: torch.device) -> torch.Tensor:  # fmt: skip
    """Additive mask `[1, 1, length, keys]` over what a quantized layer's `update_blocks` returned
    (`geometry`: `(visible, quantized, from)`: dequantized keys of positions `[visible,
    quantized)`, then full-precision ones of `[from, past + length)`): query `p = past + i` sees
    the dequantized keys before its block (`p // block * block`) and the full-precision ones from
    there to itself, within the window, as a one-token step at `p` would."""
    visible, quantized, fp_from = geometry
    p = past + torch.arange(length, device=device)[:, None]
    own = p // block * block
    t_quantized = torch.arange(visible, quantized, device=device)[None]
    t_full = torch.arange(fp_from, past + length, device=device)[None]
    allowed = torch.cat([t_quantized < own, (t_full >= own) & (t_full <= p)], dim=1)
    if sliding_window is not None:
        allowed &= p - torch.cat([t_quantized, t_full], dim=1) < sliding_window
    bias = torch.zeros(allowed.shape, dtype=dtype, device=device)
    return bias.masked_fill(~allowed, torch.finfo(dtype).min)[None, None]


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor | None, *,
           is_causal: bool = False) -> torch.Tensor:  # fmt: skip
    """Softmax attention `[batch, heads, q, head_dim]` (`scaled_dot_product_attention`); `k`/`v`
    may have fewer (grouped) heads; `bias` is additive (None: every key visible)."""
    if bias is not None and bias.dtype != q.dtype:
        bias = bias.to(q.dtype)
    # enable_gqa: grouped heads read in place, not repeated (a copy of every cached key per step)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, is_causal=is_causal,
                                          enable_gqa=q.shape[1] != k.shape[1])  # fmt: skip


def masked_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, past_length: int | torch.Tensor, kv_offset: int,
    sliding_window: int | None, attention_mask: torch.Tensor | None, causal: bool = True,
    masks: dict[tuple, torch.Tensor] | None = None,
) -> torch.Tensor:  # fmt: skip
    """Attention of queries at positions `past_length + i` over keys at `kv_offset + j` (causal, a
    sliding window, a padding mask), without a mask over all keys where none is needed (see the
    module's docstring); otherwise one additive mask, shared by the layers of one forward that
    need the same one (`masks`)."""
    query_length, kv_length = q.shape[2], k.shape[2]
    plain = attention_mask is None and not isinstance(past_length, torch.Tensor)
    if plain and not causal:
        return attend(q, k, v, None)
    if plain:
        last_key, first_query = kv_offset + kv_length - 1, past_length
        window_ok = sliding_window is None or first_query + query_length - 1 - kv_offset < sliding_window
        if query_length == 1 and last_key <= first_query and window_ok:
            return attend(q, k, v, None)  # a decode step: every key held is visible
        if kv_offset == first_query == 0 and kv_length == query_length and window_ok:
            return attend(q, k, v, None, is_causal=True)  # a prefill from nothing
        prefix = first_query - kv_offset
        if last_key == first_query + query_length - 1 and prefix > 0 and window_ok and _can_merge(q) \
                and query_length * kv_length > SMALL_MASK:  # fmt: skip
            return _prefix_then_causal(q, k, v, prefix)  # a prefill block onto a cache
        if sliding_window is not None and query_length > 2 * sliding_window:
            return _windowed(q, k, v, past_length, kv_offset, sliding_window)
    # `masks` lives for one forward, whose layers share its padding mask and per-row lengths: those
    # objects (by identity) and the geometry say which layers can share a mask (a compiled forward
    # shares only masks of int lengths without padding: identities would be guarded on, and recompile)
    fixed = isinstance(past_length, int) and attention_mask is None
    shared = masks is not None and (fixed or not torch.compiler.is_compiling())
    key = (query_length, kv_length, kv_offset, sliding_window, causal,
           past_length if fixed else (id(past_length), id(attention_mask)))  # fmt: skip
    bias = masks.get(key) if shared else None  # type: ignore[union-attr]
    if bias is None:
        bias = attention_bias(query_length=query_length, past_length=past_length, kv_length=kv_length,
                              kv_offset=kv_offset, sliding_window=sliding_window, attention_mask=attention_mask,
                              dtype=q.dtype, device=q.device, causal=causal)  # fmt: skip
        if shared:
            masks[key] = bias  # type: ignore[index]
    return attend(q, k, v, bias)


def _windowed(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, past: int, kv_offset: int,
              window: int) -> torch.Tensor:  # fmt: skip
    """Sliding-window attention in blocks of `window` queries, each over the keys its window can
    reach (`2 * window` at most): linear in the length instead of quadratic."""
    out = torch.empty_like(q)
    for start in range(0, q.shape[2], window):
        end = min(start + window, q.shape[2])
        lo = max(past + start - window + 1, kv_offset)
        hi = past + end
        bias = attention_bias(query_length=end - start, past_length=past + start, kv_length=hi - lo, kv_offset=lo,
                              sliding_window=window, attention_mask=None, dtype=q.dtype, device=q.device)  # fmt: skip
        out[:, :, start:end] = attend(q[:, :, start:end], k[:, :, lo - kv_offset : hi - kv_offset],
                                      v[:, :, lo - kv_offset : hi - kv_offset], bias)  # fmt: skip
    return out


def _can_merge(q: torch.Tensor) -> bool:
    return _FLASH_CPU is not None and q.device.type == "cpu" and q.dtype in (torch.float32, torch.float64,
                                                                              torch.bfloat16)  # fmt: skip


def _prefix_then_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix: int) -> torch.Tensor:
    """Queries that all see the first `prefix` keys, then the rest causally (one key per query):
    attention over the prefix without a mask, over the rest with the causal square, and the two
    merged by their log-sum-exps. Equal to one masked softmax up to rounding; a query's grouped
    heads read the prefix together (no repeated keys)."""
    batch, heads, length, dim = q.shape
    kv_heads = k.shape[1]
    groups = heads // kv_heads
    grouped = q.reshape(batch, kv_heads, groups * length, dim)  # heads h of kv head h // groups, stacked
    out_prefix, lse_prefix = _FLASH_CPU(grouped, k[:, :, :prefix], v[:, :, :prefix])[:2]
    k_new, v_new = k[:, :, prefix:], v[:, :, prefix:]
    if groups > 1:
        k_new, v_new = k_new.repeat_interleave(groups, dim=1), v_new.repeat_interleave(groups, dim=1)
    out_new, lse_new = _FLASH_CPU(q, k_new, v_new, is_causal=True)[:2]
    lse_prefix = lse_prefix.reshape(batch, heads, length, 1)
    lse_new = lse_new.reshape(batch, heads, length, 1)
    top = torch.maximum(lse_prefix, lse_new)
    w_prefix, w_new = torch.exp(lse_prefix - top), torch.exp(lse_new - top)
    merged = out_prefix.reshape(batch, heads, length, dim) * w_prefix + out_new * w_new
    return (merged / (w_prefix + w_new)).to(q.dtype)

