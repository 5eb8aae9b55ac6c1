"""Group-wise integer quantization of keys and values, token by token.

Each token's vector of `head_dim` values (per batch row and head) is cut into groups of
`group_size`; a group is stored as unsigned integers of `bits` bits with its own scale and zero
point (asymmetric: `x ~ q * scale + zero`, `q = round((x - min) / scale)`, `scale = (max - min) /
(2**bits - 1)`). int4 packs two values per byte: a group's first half in the low nibbles, its
second half in the high ones (so unpacking writes two contiguous halves). Scales and zero points
are float16 (bfloat16 for bfloat16 inputs, whose range float16 lacks), so the bytes per value are
`bits / 8 + 4 / group_size`:
1.0625 at int8 and 0.5625 at int4 with groups of 64, against 2 for float16.

Quantizing a token never looks at another token, so a token's quantized form is the same whichever
block it is quantized in, and whether it was quantized during a prefill or while decoding: what
exact rollback and the prefix store rely on.
"""

from __future__ import annotations

import torch

from ..errors import CacheInputError

BITS = (8, 4)
GROUP_SIZES = (32, 64, 128)


def check_quant(bits: object, group_size: object) -> tuple[int, int]:
    """`bits` in (8, 4) and `group_size` in (32, 64, 128)."""
    if bits not in BITS or isinstance(bits, bool):
        raise CacheInputError(f"kv_bits must be 8 or 4, got {bits!r}")
    if group_size not in GROUP_SIZES or isinstance(group_size, bool):
        raise CacheInputError(f"group_size must be one of {GROUP_SIZES}, got {group_size!r}")
    return int(bits), int(group_size)  # type: ignore[call-overload]


def groups_of(head_dim: int, group_size: int) -> int:
    """The group size used for a head dimension: `group_size`, or the whole head when it is smaller."""
    group = min(group_size, head_dim)
    if head_dim % group:
        raise CacheInputError(f"head_dim {head_dim} is not a multiple of the quantization group size {group}")
    return group


def param_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.bfloat16 if dtype == torch.bfloat16 else torch.float16


def quantize(x: torch.Tensor, bits: int, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`x` `[..., D]` as `(data, params)`: data uint8 `[..., D]` (int8) or `[..., D // 2]` (int4,
    two per byte), params `[..., 2 * D // group]` (scales, then zero points)."""
    *lead, dim = x.shape
    pdtype = param_dtype(x.dtype)
    g = x.reshape(*lead, dim // group, group).float()
    low, high = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
    levels = (1 << bits) - 1
    scale = ((high - low) / levels).to(pdtype)
    zero = low.to(pdtype)
    step = scale.float()
    safe = torch.where(step > 0, step, torch.ones_like(step))
    q = ((g - zero.float()) / safe).round_().clamp_(0, levels).to(torch.uint8)
    if bits == 4:  # a group's first half in the low nibbles, its second half in the high ones
        half = group // 2
        q = q[..., :half] | (q[..., half:] << 4)
    q = q.reshape(*lead, -1)
    params = torch.cat([scale.squeeze(-1), zero.squeeze(-1)], dim=-1)
    return q, params


def dequantize(data: torch.Tensor, params: torch.Tensor, bits: int, group: int, dtype: torch.dtype,
               out: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """The values `quantize` stored, in `dtype`, written straight into `out` when given (a view
    whose last dimension is contiguous), one pass over the output."""
    *lead, width = data.shape
    dim = width * (2 if bits == 4 else 1)
    n = dim // group
    if out is None:
        out = torch.empty(*lead, dim, dtype=dtype, device=data.device)
    scale, zero = params[..., :n, None].to(dtype), params[..., n:, None].to(dtype)
    grouped = out.view(*lead, n, group)
    if bits == 8:
        torch.mul(data.view(*lead, n, group), scale, out=grouped)
    else:
        half = group // 2
        packed = data.view(*lead, n, half)
        torch.mul(packed & 0x0F, scale, out=grouped[..., :half])
        torch.mul(packed >> 4, scale, out=grouped[..., half:])
    grouped.add_(zero)
    return out
