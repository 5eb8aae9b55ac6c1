"""What a prefix store keeps of a quantized attention layer at a chunk boundary.

A token's quantized form depends on the token alone, so a chunk keeps its tokens quantized (a
delta, shared by every prefix that shares the chunk, as full attention's are) and the layer's
full-precision residual at the boundary (at most `2 * residual - 1` tokens, the part not yet
quantized there). A prefix of m chunks rebuilds as the concatenation of its chunks' quantized
tokens, cut where the layer quantizes at that boundary, followed by the last chunk's residual.
A quantized sliding window must be at least a chunk wide (the chunk's tokens are then held).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..layers.quantized import QuantizedLayer
from ..layers.quantized_sliding import QuantizedSlidingWindowLayer


@dataclass(frozen=True)
class QuantDelta:
    """One chunk of a quantized layer: its tokens quantized (`data_*`, `params_*`: `[1, heads, chunk, ...]`),
    the full-precision residual at its end boundary, and the layer's parameters."""

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

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in (self.data_k, self.data_v, self.params_k, self.params_v, self.residual_k,
                                      self.residual_v))  # fmt: skip

    @property
    def tensors(self) -> dict[str, torch.Tensor]:
        names = ("data_k", "data_v", "params_k", "params_v", "residual_k", "residual_v")
        return {name: getattr(self, name) for name in names}


def quantized_capturable(layer: object, chunk: int) -> bool:
    """Whether the store can keep `layer` as quantized deltas of `chunk` tokens."""
    if type(layer) is QuantizedSlidingWindowLayer:
        return layer.sliding_window - 1 >= chunk
    return type(layer) is QuantizedLayer


def capture_quantized(layer: QuantizedLayer, start: int, end: int) -> QuantDelta:
    """The chunk `[start, end)` of `layer` (batch 1, holding exactly `end` tokens)."""
    from ..layers.quant import quantize

    fp_k, fp_v = layer._fp.tail(len(layer._fp))
    quantized, fp_start = layer._quantized, layer._fp_start
    parts: list[list[torch.Tensor]] = [[], [], [], []]
    if start < quantized:  # already quantized in the layer: take its data
        n = min(quantized, end) - start
        offset = layer._held_quantized - (quantized - start)
        for i, buffer in enumerate((layer._q, layer._q, layer._p, layer._p)):
            parts[i].append(buffer.tail(layer._held_quantized)[i % 2].narrow(2, offset, n).clone())
    if end > quantized:  # not quantized yet: quantize the chunk's full-precision tokens now
        lo = max(start, quantized) - fp_start
        for fp, (data_i, params_i) in ((fp_k, (0, 2)), (fp_v, (1, 3))):
            data, params = quantize(fp.narrow(2, lo, end - max(start, quantized)), layer.bits, layer._group)
            parts[data_i].append(data)
            parts[params_i].append(params)
    data_k, data_v, params_k, params_v = (torch.cat(p, dim=2) for p in parts)
    res_from = max(quantized, _window_start(layer, end)) - fp_start
    window = getattr(layer, "sliding_window", 0) if type(layer) is QuantizedSlidingWindowLayer else 0
    return QuantDelta(data_k, data_v, params_k, params_v, fp_k.narrow(2, res_from, end - fp_start - res_from).clone(),
                      fp_v.narrow(2, res_from, end - fp_start - res_from).clone(), layer.bits, layer.group_size,
                      layer.residual, window)  # fmt: skip


def _window_start(layer: object, end: int) -> int:
    window = getattr(layer, "sliding_window", 0) if type(layer) is QuantizedSlidingWindowLayer else 0
    return max(end - (window - 1), 0) if window else 0


def _target(residual: int, end: int) -> int:
    return max(0, (end - residual) // residual) * residual


def rebuild_quantized(path: list[QuantDelta], device: torch.device | None) -> QuantizedLayer:
    last = path[-1]
    end = sum(p.data_k.shape[2] for p in path)
    quantized = _target(last.residual, end)
    window_start = max(end - (last.window - 1), 0) if last.window else 0
    q_start = min(window_start, quantized)
    parts, held = [], 0  # the last chunks, back to `q_start`
    for p in reversed(path):
        if end - held <= q_start:
            break
        parts.append(p)
        held += p.data_k.shape[2]
    first = end - held
    names = ("data_k", "data_v", "params_k", "params_v")
    joined = {n: torch.cat([getattr(p, n).to(device) for p in reversed(parts)], dim=2)[:, :, q_start - first:
                                                                                     quantized - first]
              for n in names}  # fmt: skip
    fp_start = end - last.residual_k.shape[2]
    meta = {"bits": last.bits, "group_size": last.group_size, "residual": last.residual, "seq_length": end,
            "full_precision_from": fp_start, "quantized_from": q_start, "quantized": quantized,
            "record_past": False}  # fmt: skip
    state = {"keys": last.residual_k.to(device), "values": last.residual_v.to(device)}
    if quantized > q_start:
        state.update(keys_q=joined["data_k"], values_q=joined["data_v"], params_k=joined["params_k"],
                     params_v=joined["params_v"])  # fmt: skip
    if last.window:
        return QuantizedSlidingWindowLayer.from_state({**meta, "sliding_window": last.window,
                                                       "seq_length_at_commit": 0}, state)  # fmt: skip
    return QuantizedLayer.from_state(meta, state)


def check_quantized(payload: QuantDelta, ref: QuantDelta, chunks: int) -> str | None:
    """None when `payload` is the model's quantized layer after `chunks` chunks (`ref`: after one)."""
    params = ("bits", "group_size", "residual", "window")
    if any(getattr(payload, n) != getattr(ref, n) for n in params):
        mine, theirs = ([getattr(x, n) for n in params] for x in (payload, ref))
        return f"quantization {mine}, the model's is {theirs}"
    for name in ("data_k", "data_v", "params_k", "params_v"):
        got, want = getattr(payload, name), getattr(ref, name)
        if not isinstance(got, torch.Tensor) or got.dtype != want.dtype or got.shape != want.shape:
            return f"{name} {tuple(got.shape)} {got.dtype}, the model's is {tuple(want.shape)} {want.dtype}"
    chunk = ref.data_k.shape[2]
    end = chunks * chunk
    window_start = max(end - (ref.window - 1), 0) if ref.window else 0
    residual = end - max(_target(ref.residual, end), window_start)
    for name in ("residual_k", "residual_v"):
        got, want = getattr(payload, name), getattr(ref, name)
        shape = (*want.shape[:2], residual, want.shape[3])
        if not isinstance(got, torch.Tensor) or got.dtype != want.dtype or tuple(got.shape) != shape:
            return f"{name} {tuple(got.shape)} {got.dtype}, the model's would be {shape} {want.dtype}"
    return None
