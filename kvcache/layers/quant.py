"""Asymmetric integer quantization of keys and values: per token, or per channel in token blocks.

Per token (`"token"`), each token's vector of `head_dim` numbers (per batch row and head) is cut
into groups of `group_size`, each stored as unsigned integers of `bits` bits with its own scale
and zero point (`x ~ q * scale + zero`, `q = round((x - zero) / scale)`, starting from
`scale = (max - min) / (2**bits - 1)`, `zero = min` and refitted by least squares: `REFITS`). Per
channel (`"channel"`, as KIVI (Liu et al., 2024) quantizes keys), a block of `block` consecutive
tokens shares one scale and zero point per channel, so the channels that are persistently large
(or persistently offset) get a scale of their own instead of stretching everyone else's. Keys
and values each take either.

Values narrower than a byte are packed along the last dimension: a group's (or, per channel, a
token's) values are cut into `8 // bits` contiguous parts, part i in bits `[i * bits, (i + 1) *
bits)` of each byte, so unpacking writes whole contiguous parts. Scales and zero points are
float16 (bfloat16 for bfloat16 inputs, whose range float16 lacks). A block's per-channel
parameters (`2 * head_dim` numbers) are spread over the block's tokens, `channel_param_width`
per token (zero-padded), so every quantized tensor is indexed by token and cut, saved and
batch-selected like the keys themselves.

Quantizing a token (per token) never looks at another token, and a block (per channel) never
looks outside the block: what a token becomes depends on the tokens of its block alone, whichever
forward brought them, which is what exact rollback and the prefix store rely on.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..errors import CacheInputError

BITS = (8, 4, 2)
GROUP_SIZES = (32, 64, 128)
KEY_GROUPS = ("channel", "token")


def check_quant(bits: object, group_size: object) -> tuple[int, int]:
    """`bits` in (8, 4, 2) and `group_size` in (32, 64, 128)."""
    if bits not in BITS or isinstance(bits, bool):
        raise CacheInputError(f"kv_bits must be 8, 4 or 2, got {bits!r}")
    if group_size not in GROUP_SIZES or isinstance(group_size, bool):
        raise CacheInputError(f"group_size must be one of {GROUP_SIZES}, got {group_size!r}")
    return int(bits), int(group_size)  # type: ignore[call-overload]


def check_groups(groups: object, what: str = "key_groups") -> str:
    """`"channel"` (per-channel scales in blocks of tokens) or `"token"` (groups along head_dim),
    for `what` (`key_groups` or `value_groups`)."""
    if groups not in KEY_GROUPS or not isinstance(groups, str):
        raise CacheInputError(f"{what} must be 'channel' or 'token', got {groups!r}")
    return groups


def groups_of(head_dim: int, group_size: int) -> int:
    """The group size used for a head dimension: `group_size`, or the whole head when it is smaller."""
    group = min(group_size, head_dim)
    if head_dim % group:
        raise CacheInputError(f"head_dim {head_dim} is not a multiple of the quantization group size {group}")
    return group


def param_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.bfloat16 if dtype == torch.bfloat16 else torch.float16


def data_width(dim: int, bits: int) -> int:
    """Bytes per token and head for `dim` values of `bits` bits."""
    return dim * bits // 8


def channel_param_width(dim: int, block: int) -> int:
    """Per-channel parameters per token: a block's `2 * dim` spread over its `block` tokens."""
    return -(-2 * dim // block)


def _pack(q: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes `[..., n]` (below `2**bits`) packed `8 // bits` per byte: `[..., n * bits // 8]`."""
    per = 8 // bits
    if per == 1:
        return q
    parts = q.unflatten(-1, (per, -1))
    out = parts[..., 0, :].clone()
    for i in range(1, per):
        out |= parts[..., i, :] << (bits * i)
    return out


def _unpacked_parts(packed: torch.Tensor, bits: int) -> list[torch.Tensor]:
    """The codes `_pack` packed into `packed` `[..., m]`, part by part: part i holds codes
    `[i * m, (i + 1) * m)` of the last dimension, as uint8 `[..., m]` (no concatenation: the
    dequantizers write each part straight to its place)."""
    per = 8 // bits
    if per == 1:
        return [packed]
    mask = (1 << bits) - 1
    return [packed & mask, *((packed >> (bits * i)) & mask for i in range(1, per - 1)), packed >> (bits * (per - 1))]


#: Least-squares refits of each group's scale and zero point after the min-max start. Min-max
#: spends levels on the extremes; refitting the line through (code, value) for the codes chosen,
#: then choosing the nearest codes again, cuts the squared error where it matters (the bundled
#: model at int4: mean KL 3.7e-3 -> 2.8e-3 and the cross-entropy change 9e-3 -> ~0; int2: KL
#: halved; benchmarks/quantized.py). Three: more refits measured no better.
REFITS = 3


def _nearest(g: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, levels: int) -> torch.Tensor:
    """The nearest codes (as floats) of `g` for `scale` and `zero` as stored (broadcast)."""
    step = scale.float()
    return (g - zero.float()).div_(torch.where(step > 0, step, 1.0)).round_().clamp_(0, levels)


def _codes(g: torch.Tensor, dim: int, bits: int,
           pdtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """Codes of `g` in groups along `dim`, with the scale and zero point stored (`pdtype`): min-max
    first, then `REFITS` times the least-squares line through (code, value) for the codes chosen,
    where the codes differ, and the nearest codes again. Sums in float64: a group's figures come
    out alike whichever batch of groups it was quantized in."""
    levels = (1 << bits) - 1
    low, high = g.amin(dim, keepdim=True), g.amax(dim, keepdim=True)
    scale, zero = ((high - low) / levels).to(pdtype), low.to(pdtype)
    q = _nearest(g, scale, zero, levels)
    if REFITS:
        x = g.double()
        mean_x = x.mean(dim, keepdim=True)
        centred_x = x - mean_x
    for _ in range(REFITS):
        codes = q.double()
        mean_q = codes.mean(dim, keepdim=True)
        codes -= mean_q
        spread = codes.square().sum(dim, keepdim=True)
        covariance = codes.mul_(centred_x).sum(dim, keepdim=True)
        fits = covariance > 0  # (then the codes differ: spread > 0)
        fitted = covariance.div_(spread.clamp_(min=0.25))  # when the codes differ, spread >= 1/2: not clamped
        scale = torch.where(fits, fitted, scale).to(pdtype)
        zero = torch.where(fits, mean_x - fitted * mean_q, zero).to(pdtype)
        q = _nearest(g, scale, zero, levels)
    return q.to(torch.uint8), scale, zero


def quantize(x: torch.Tensor, bits: int, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`x` `[..., D]` token by token as `(data, params)`: data uint8 `[..., D * bits // 8]`, params
    `[..., 2 * D // group]` (scales, then zero points)."""
    *lead, dim = x.shape
    g = x.detach().reshape(*lead, dim // group, group).float()  # not differentiable: codes are integers
    q, scale, zero = _codes(g, -1, bits, param_dtype(x.dtype))
    data = _pack(q, bits).reshape(*lead, -1)
    return data, torch.cat([scale.squeeze(-1), zero.squeeze(-1)], dim=-1)


def dequantize(data: torch.Tensor, params: torch.Tensor, bits: int, group: int, dtype: torch.dtype,
               out: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """The values `quantize` stored, in `dtype`, written straight into `out` when given (a view
    whose last dimension is contiguous), one pass over the output."""
    *lead, width = data.shape
    dim = width * 8 // bits
    n = dim // group
    if out is None:
        out = torch.empty(*lead, dim, dtype=dtype, device=data.device)
    scale, zero = params[..., :n, None].to(dtype), params[..., n:, None].to(dtype)
    grouped = out.view(*lead, n, group)
    parts = _unpacked_parts(data.view(*lead, n, group * bits // 8), bits)
    for i, codes in enumerate(parts):
        torch.mul(codes, scale, out=grouped.narrow(-1, i * codes.shape[-1], codes.shape[-1]))
    grouped.add_(zero)  # (mul then add: faster than one addcmul when scales broadcast along the last dim)
    return out


def quantize_channels(x: torch.Tensor, bits: int, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`x` `[..., T, D]` (T a multiple of `block`) per channel in blocks of `block` tokens, as
    `(data, params)`: data uint8 `[..., T, D * bits // 8]`, params `[..., T, channel_param_width]`
    (each block's D scales then D zero points, spread over its tokens)."""
    *lead, tokens, dim = x.shape
    blocks = tokens // block
    g = x.detach().reshape(*lead, blocks, block, dim).float()
    q, scale, zero = _codes(g, -2, bits, param_dtype(x.dtype))
    data = _pack(q, bits).reshape(*lead, tokens, -1)
    width = channel_param_width(dim, block)
    params = torch.cat([scale, zero], dim=-1).reshape(*lead, blocks, 2 * dim)
    params = F.pad(params, (0, block * width - 2 * dim)).reshape(*lead, tokens, width)
    return data, params


def dequantize_channels(data: torch.Tensor, params: torch.Tensor, bits: int, block: int, dtype: torch.dtype,
                        out: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """The keys `quantize_channels` stored (whole blocks), in `dtype`, into `out` when given."""
    *lead, tokens, width = data.shape
    dim, blocks = width * 8 // bits, tokens // block
    if out is None:
        out = torch.empty(*lead, tokens, dim, dtype=dtype, device=data.device)
    flat = params.reshape(*lead, blocks, -1)
    scale, zero = flat[..., None, :dim].to(dtype), flat[..., None, dim : 2 * dim].to(dtype)
    blocked = out.view(*lead, blocks, block, dim)
    for i, codes in enumerate(_unpacked_parts(data.view(*lead, blocks, block, width), bits)):
        part = slice(i * width, (i + 1) * width)  # one pass per part: zero + code * scale
        torch.addcmul(zero[..., part], codes, scale[..., part], out=blocked[..., part])
    return out
