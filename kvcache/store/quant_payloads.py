"""What a prefix store keeps of a quantized attention layer at a chunk boundary.

What the layer holds at a boundary is a function of the tokens before it (`layers.quantized`):
the first `Q(end)` tokens quantized, the rest in full precision (the block being filled, none at a
boundary that is a multiple of `residual`, and what a sliding window keeps). A chunk's entry keeps the tokens the
layer quantized between its start and end boundaries (a delta, shared by every prefix that shares
the chunk, as full attention's are; none for a chunk that quantized nothing) and the layer's
full-precision part at its end boundary. A prefix of m chunks rebuilds as the concatenation of its
chunks' quantized tokens (from where the layer still holds them), followed by the last chunk's
full-precision part. Per-channel keys are quantized by whole blocks, which is why an entry holds
what the layer quantized rather than its own tokens: a chunk may end inside a block. So a
quantized sliding window of any width is kept, even one narrower than a chunk.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..layers.quant import channel_param_width, data_width, param_dtype
from ..layers.quantized import QuantizedLayer
from ..layers.quantized_sliding import QuantizedSlidingWindowLayer


@dataclass(frozen=True)
class QuantDelta:
    """One chunk of `tokens` tokens of a quantized layer: the tokens quantized at its end boundary
    that were not at its start (`data_*`, `params_*`: `[1, heads, n, ...]`), the full-precision
    part at its end boundary (`residual_*`), and the layer's parameters."""

    data_k: torch.Tensor
    data_v: torch.Tensor
    params_k: torch.Tensor
    params_v: torch.Tensor
    residual_k: torch.Tensor
    residual_v: torch.Tensor
    bits: int
    group_size: int
    residual: int
    window: int = 0  # 0: full attention
    tokens: int = 0
    key_groups: str = "channel"
    value_groups: str = "token"  # (entries stored before per-channel values were per token)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    @property
    def tensors(self) -> dict[str, torch.Tensor]:
        names = ("data_k", "data_v", "params_k", "params_v", "residual_k", "residual_v")
        return {name: getattr(self, name) for name in names}


@dataclass(frozen=True)
class _Layout:
    """Where a quantized layer of these parameters keeps what, as a function of its length."""

    residual: int
    window: int
    block: int  # tokens are kept by whole blocks of this many (1: any)

    def quantized(self, n: int) -> int:
        return n // self.residual * self.residual

    def _floor(self, n: int) -> int:
        return n // self.block * self.block

    def window_start(self, n: int) -> int:
        return self._floor(max(n - (self.window - 1), 0)) if self.window else 0

    def quantized_from(self, n: int) -> int:
        """The first quantized token a layer holding `n` tokens keeps."""
        return min(self.window_start(n), self.quantized(n))

    def full_precision_from(self, n: int) -> int:
        return max(self.quantized(n), self.window_start(n))

    def span(self, start: int, end: int) -> tuple[int, int]:
        """The tokens a chunk `[start, end)` keeps quantized: what its end quantized and still holds."""
        stop = self.quantized(end)
        return min(max(self.quantized(start), self.quantized_from(end)), stop), stop


def _blocked(residual: int, key_groups: str, value_groups: str) -> int:
    """Tokens are kept by whole blocks when keys or values are quantized per channel."""
    return residual if "channel" in (key_groups, value_groups) else 1


def _layout(layer: QuantizedLayer) -> _Layout:
    window = layer.sliding_window if type(layer) is QuantizedSlidingWindowLayer else 0
    return _Layout(layer.residual, window, _blocked(layer.residual, layer.key_groups, layer.value_groups))


def _layout_of(delta: QuantDelta) -> _Layout:
    return _Layout(delta.residual, delta.window, _blocked(delta.residual, delta.key_groups, delta.value_groups))


def quantized_capturable(layer: object, chunk: int) -> bool:
    """Whether the store can keep `layer` as quantized deltas of `chunk` tokens: both kinds, any
    window (an entry holds what the layer quantized and its full-precision part, not the chunk)."""
    return type(layer) in (QuantizedLayer, QuantizedSlidingWindowLayer)


def capture_quantized(layer: QuantizedLayer, start: int, end: int, held: int | None = None) -> QuantDelta:
    """The chunk `[start, end)` of `layer` (batch 1, holding exactly `end` tokens; or `held` more,
    for a boundary a prefill forward passed over: the layer recorded the forward, so it still
    holds that boundary's codes and full-precision part)."""
    layout = _layout(layer)
    fp_k, fp_v = layer._fp.tail(len(layer._fp))
    low, high = layout.span(start, end)
    heads, dim = fp_k.shape[1], fp_k.shape[3]
    if high > low:
        first = layer._quantized - layer._held_quantized
        if low < first or high > layer._quantized:
            raise ValueError(f"tokens [{low}, {high}) are not held quantized (the layer holds [{first}, "
                             f"{layer._quantized}))")  # fmt: skip
        data, params = layer._q.tail(layer._held_quantized), layer._p.tail(layer._held_quantized)
        parts = [t.narrow(2, low - first, high - low).clone() for t in (*data, *params)]
    else:
        pdtype = param_dtype(fp_k.dtype)
        groups = 2 * dim // layer._group
        key_params, value_params = (channel_param_width(dim, layer.residual) if groups_of_part == "channel" else groups
                                    for groups_of_part in (layer.key_groups, layer.value_groups))  # fmt: skip
        widths = ((data_width(dim, layer.bits), torch.uint8), (data_width(dim, layer.bits), torch.uint8),
                  (key_params, pdtype), (value_params, pdtype))  # fmt: skip
        parts = [fp_k.new_empty(1, heads, 0, width, dtype=dtype) for width, dtype in widths]
    res_from = layout.full_precision_from(end) - layer._fp_start
    if res_from < 0 or (held is not None and held != layer._longest()):
        raise ValueError(f"the full-precision tokens of boundary {end} are not held (the layer keeps them from "
                         f"{layer._fp_start})")  # fmt: skip
    stop = end - layer._fp_start
    residual = [t.narrow(2, res_from, stop - res_from).clone() for t in (fp_k, fp_v)]
    return QuantDelta(*parts, *residual, layer.bits, layer.group_size, layer.residual, layout.window,
                      end - start, layer.key_groups, layer.value_groups)  # fmt: skip


def rebuild_quantized(path: list[QuantDelta], device: torch.device | None) -> QuantizedLayer:
    last = path[-1]
    layout = _layout_of(last)
    end = sum(p.tokens for p in path)
    quantized, q_start = layout.quantized(end), layout.quantized_from(end)
    pieces, position, first = [], 0, None
    for p in path:  # the chunks whose quantized tokens reach past `q_start`, back to where they start
        low, high = layout.span(position, position + p.tokens)
        position += p.tokens
        if high > max(low, q_start):
            first = low if first is None else first
            pieces.append(p)
    meta = {"bits": last.bits, "group_size": last.group_size, "residual": last.residual,
            "key_groups": last.key_groups, "value_groups": last.value_groups, "seq_length": end,
            "full_precision_from": layout.full_precision_from(end), "quantized_from": q_start,
            "quantized": quantized, "record_past": False}  # fmt: skip
    state = {"keys": last.residual_k.to(device), "values": last.residual_v.to(device)}
    if quantized > q_start:
        names = {"keys_q": "data_k", "values_q": "data_v", "params_k": "params_k", "params_v": "params_v"}
        for name, field in names.items():
            joined = torch.cat([getattr(p, field).to(device) for p in pieces], dim=2)
            state[name] = joined[:, :, q_start - first : quantized - first]  # type: ignore[operator]
    if last.window:
        return QuantizedSlidingWindowLayer.from_state({**meta, "sliding_window": last.window,
                                                       "seq_length_at_commit": 0}, state)  # fmt: skip
    return QuantizedLayer.from_state(meta, state)


def check_quantized(payload: QuantDelta, ref: QuantDelta, chunks: int) -> str | None:
    """None when `payload` is the model's quantized layer after `chunks` chunks (`ref`: after one)."""
    params = ("bits", "group_size", "residual", "window", "tokens", "key_groups", "value_groups")
    if any(getattr(payload, n) != getattr(ref, n) for n in params):
        mine, theirs = ([getattr(x, n) for n in params] for x in (payload, ref))
        return f"quantization {mine}, the model's is {theirs}"
    layout, chunk = _layout_of(ref), ref.tokens
    end = chunks * chunk
    low, high = layout.span(end - chunk, end)
    residual = end - layout.full_precision_from(end)
    for name, length in (("data_k", high - low), ("data_v", high - low), ("params_k", high - low),
                         ("params_v", high - low), ("residual_k", residual), ("residual_v", residual)):  # fmt: skip
        got, want = getattr(payload, name), getattr(ref, name)
        shape = (*want.shape[:2], length, want.shape[3])
        if not isinstance(got, torch.Tensor) or got.dtype != want.dtype or tuple(got.shape) != shape:
            return f"{name} {tuple(got.shape)} {got.dtype}, the model's would be {shape} {want.dtype}"
    return None
