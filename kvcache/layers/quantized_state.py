"""What quantized attention layers share beyond their class: quantizing several layers' due
tokens in one call, and restoring a layer from its saved state (every saved length and tensor
checked against the others before anything is held)."""

from __future__ import annotations

from typing import Any, TypeVar

import torch

from ..errors import CacheInputError
from ..validation import check_row_lengths
from .dynamic import nonneg_int, record_past_flag
from .kv_buffer import KVBuffer
from .quant import channel_param_width, data_width, groups_of

L = TypeVar("L")


def quantize_due(like: Any, dues: list[tuple[torch.Tensor, torch.Tensor]]) -> list[tuple[torch.Tensor, ...]]:
    """`(data_k, params_k, data_v, params_v)` for each `(keys, values)` of `dues` (what layers of
    `like`'s parameters must quantize now), quantized in one call per grouping, dtype and shape
    rather than two per layer: a call's cost is mostly its ~80 small operations, and a group's
    codes do not depend on the groups quantized with it (`quant`), so the results are the same."""
    pieces = [(0, k) for k, _ in dues] + [(1, v) for _, v in dues]
    batches: dict[tuple[Any, ...], list[int]] = {}
    for n, (i, x) in enumerate(pieces):
        batches.setdefault((like._per_channel[i], x.dtype, x.shape[:2], x.shape[3]), []).append(n)
    out: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * len(pieces)
    for (per_channel, *_), members in batches.items():
        tensors = [pieces[n][1] for n in members]
        data, params = like._quantize_part(torch.cat(tensors, 2) if len(tensors) > 1 else tensors[0], per_channel)
        sizes = [t.shape[2] for t in tensors]
        for n, d, p in zip(members, data.split(sizes, 2), params.split(sizes, 2), strict=True):
            out[n] = (d, p)
    half = len(dues)
    return [(*out[n], *out[half + n]) for n in range(half)]  # type: ignore[misc]


def saved_tensors(layer: Any) -> dict[str, torch.Tensor]:
    """A quantized layer's tensors as saved: its full-precision tokens, and the quantized ones
    with their scales and zero points where any are held."""
    if layer._fp.keys is None:
        return {}
    keys, values = layer._fp.tail(len(layer._fp))
    out = {"keys": keys, "values": values}
    if layer._q.keys is not None and layer._held_quantized:
        n = layer._held_quantized
        out["keys_q"], out["values_q"] = layer._q.tail(n)
        out["params_k"], out["params_v"] = layer._p.tail(n)
    return out


def saved_meta(layer: Any) -> dict[str, Any]:
    """A quantized layer's parameters and lengths as saved (`restore` takes them back)."""
    meta: dict[str, Any] = {"bits": layer.bits, "group_size": layer.group_size, "residual": layer.residual,
                            "key_groups": layer.key_groups, "value_groups": layer.value_groups,
                            "seq_length": layer._longest(), "full_precision_from": layer._fp_start,
                            "quantized_from": layer._q_start, "quantized": layer._quantized,
                            "record_past": layer._recording}  # fmt: skip
    if layer.is_ragged:
        meta["row_lengths"] = layer.row_lengths()
    return meta


def restore(layer: L, meta_state: dict[str, Any], state: dict[str, torch.Tensor]) -> L:
    """`layer` (new, with its parameters) given the saved lengths and tensors: each checked against
    the others and the parameters (a `CacheInputError` naming what does not fit)."""
    name = type(layer).__name__
    seen = nonneg_int(meta_state, "seq_length", name)
    fp_start = nonneg_int(meta_state, "full_precision_from", name)
    q_start = nonneg_int(meta_state, "quantized_from", name)
    quantized = nonneg_int(meta_state, "quantized", name)
    recording = record_past_flag(meta_state, name)
    if not state:
        if seen:
            raise CacheInputError(f"{name}: {seen} token(s) announced but no keys/values given")
        layer._recording = recording
        return layer
    quant_names = {"keys_q", "values_q", "params_k", "params_v"}
    expected = {"keys", "values"} | (quant_names if quantized > q_start else set())
    if set(state) != expected:
        raise CacheInputError(f"{name}: expected tensors {sorted(expected)}, got {sorted(state)}")
    keys, values = state["keys"], state["values"]
    if keys.dim() != 4 or values.dim() != 4 or keys.shape[:3] != values.shape[:3] or keys.dtype != values.dtype \
            or not keys.is_floating_point():  # fmt: skip
        raise CacheInputError(f"{name}: keys {tuple(keys.shape)} and values {tuple(values.shape)} are not a pair")
    if fp_start + keys.shape[2] != seen or quantized > seen:
        raise CacheInputError(f"{name}: inconsistent lengths (seen {seen}, full precision from {fp_start}, "
                              f"quantized [{q_start}, {quantized}))")  # fmt: skip
    layer._group = groups_of(keys.shape[3], layer.group_size)
    if any(layer._block_floor(n) != n for n in (fp_start, q_start)):
        raise CacheInputError(f"{name}: per-channel keys are kept in blocks of {layer.residual} tokens, but "
                              f"full precision starts at {fp_start} and quantization at {q_start}")  # fmt: skip
    layer._fp = KVBuffer.from_tensors(keys, values)
    layer._fp_start, layer._q_start, layer._quantized = fp_start, q_start, quantized
    if quantized > q_start:
        n = quantized - q_start
        data_k, data_v, pk, pv = (state[k] for k in ("keys_q", "values_q", "params_k", "params_v"))
        dim, lead = keys.shape[3], (*keys.shape[:2], n)
        width, groups = data_width(dim, layer.bits), 2 * dim // layer._group
        key_params, value_params = (channel_param_width(dim, layer.residual) if per_channel else groups
                                    for per_channel in layer._per_channel)  # fmt: skip
        ok = (data_k.dtype == data_v.dtype == torch.uint8 and tuple(data_k.shape) == (*lead, width)
              and data_v.shape == data_k.shape and tuple(pk.shape) == (*lead, key_params)
              and tuple(pv.shape) == (*lead, value_params) and pk.dtype == pv.dtype
              and pk.is_floating_point())  # fmt: skip
        if not ok:
            raise CacheInputError(f"{name}: quantized tensors do not fit {layer.bits}-bit keys of "
                                  f"{tuple(keys.shape)} and {n} quantized token(s)")  # fmt: skip
        layer._q = KVBuffer.from_tensors(data_k, data_v)
        layer._p = KVBuffer.from_tensors(pk, pv)
    lengths = meta_state.get("row_lengths")
    held = [n - fp_start for n in lengths] if isinstance(lengths, list) and all(
        isinstance(n, int) for n in lengths) else lengths  # fmt: skip
    layer._fp.set_row_lengths(check_row_lengths(held, layer.batch_size, keys.shape[2], name))
    if layer._quantized != layer._target(layer._shortest()):
        raise CacheInputError(f"{name}: {quantized} quantized token(s) do not follow from the lengths")
    if fp_start > max(quantized, layer._first_visible()):
        raise CacheInputError(f"{name}: full-precision tokens from {fp_start} leave a gap after {quantized} "
                              "quantized ones")  # fmt: skip
    layer._recording = recording
    return layer
