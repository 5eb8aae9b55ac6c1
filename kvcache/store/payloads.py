"""What a prefix store keeps of each cache layer at a chunk boundary, how an entry is checked
against the model before anything is built, and how a cache is rebuilt.

Full-attention keys/values grow with the prefix, so a boundary keeps only its chunk's slice (a
*delta*): a prefix of m chunks is the concatenation of m deltas, and prefixes that share chunks
share their tensors. A sliding window at least a chunk wide keeps deltas too (its window at a
boundary is the tail of the last chunks). Every other layer kind keeps a bounded state, whole, at
the boundary (a *snapshot*): a narrow sliding window's last `W - 1` tokens, a recurrent layer's
conv window and state (the state *at* the boundary, not a replay of tokens), nothing for an empty
layer. A `HybridLayer` keeps a delta of its attention part and a snapshot of its recurrent part.

A snapshot is the layer as a committed, non-recording layer at that boundary (`canonical`), so
one taken during a prefill and one taken while decoding (recording, one step of history) are the
same thing, and an entry can be compared field by field with the model's own reference.

Entries may come from other processes and other models. `check_payload` compares one against a
*reference*: what the model's own fresh cache holds after one chunk (`reference_payloads`), with
the token counts scaled to the entry's boundary. Kind, class, every `meta_state` field, tensor
names, dtypes and shapes must agree, so a foreign entry is refused before any layer is built, and
what `rebuild` allocates is bounded by the reference.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..layers.base import LAYER_REGISTRY, CacheLayer
from ..layers.dynamic import DynamicLayer
from ..layers.hybrid import HybridLayer
from ..layers.kv_buffer import KVBuffer
from ..layers.quantized import QuantizedLayer
from ..layers.sliding import SlidingWindowLayer
from ..protocol import last_logits
from .quant_payloads import QuantDelta, capture_quantized, check_quantized, quantized_capturable, rebuild_quantized


@dataclass(frozen=True)
class Delta:
    """One chunk's keys/values `[batch, heads, chunk, dim]` of a full-attention layer."""

    keys: torch.Tensor
    values: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes


@dataclass(frozen=True)
class WindowDelta(Delta):
    """One chunk's keys/values of a sliding-window layer whose window spans at least a chunk: the
    window at a boundary is the tail of the last chunks' deltas, so chunks are shared here too."""

    window: int = 1


@dataclass(frozen=True)
class Snapshot:
    """A whole layer at a boundary: its class name, `meta_state` and private copies of its `state`."""

    cls: str
    meta: dict[str, Any]
    state: dict[str, torch.Tensor]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.state.values())


@dataclass(frozen=True)
class HybridPayload:
    attention: Delta | Snapshot
    recurrent: Snapshot

    @property
    def nbytes(self) -> int:
        return self.attention.nbytes + self.recurrent.nbytes


Payload = Delta | Snapshot | HybridPayload | QuantDelta


def canonical(layer: CacheLayer) -> CacheLayer:
    """A copy of `layer` as a committed, non-recording layer holding the same tokens: rollback
    history dropped, commit bookkeeping reset, so the state at a boundary has one form however the
    layer got there (a prefill, or decoding with recording on). Bounded: only layers that keep a
    bounded state (windows, recurrent states) are copied."""
    if isinstance(layer, HybridLayer):
        return HybridLayer(canonical(layer.attention), canonical(layer.recurrent))
    copy = layer.copy()
    copy._commit()
    copy._recording = False
    if hasattr(copy, "_seen_at_commit"):
        copy._seen_at_commit = 0  # unused while not recording; a prefilled layer has 0
    for slot in getattr(copy, "_slots", ()):
        slot.conv_from_empty = True  # likewise (`activate_past_recording` sets it anew)
        slot.spare.clear()
        # at a boundary every step is whole; a conv-only slot (LFM2's short conv) still counts its
        # last conv update as awaiting a recurrent update that never comes: a prefill chunk's 16, a
        # decode step's 1. That count changes nothing that follows, so one form: none open.
        slot.open_tokens = slot.open_at_commit = None
    return copy


def capture(layer: CacheLayer, start: int, end: int) -> Payload:
    """What `layer`, holding exactly tokens `[0, end)`, keeps for the boundary at `end` (the chunk
    being `[start, end)`). Copies: the store shares nothing with the cache."""
    n = end - start
    if type(layer) is DynamicLayer:
        keys, values = (state := layer.state)["keys"], state["values"]  # one `state`: it builds both views
        return Delta(keys[:, :, start:end].clone(), values[:, :, start:end].clone())
    if type(layer) is SlidingWindowLayer and layer.sliding_window - 1 >= n:
        keys, values = (state := layer.state)["keys"], state["values"]  # holds at least the chunk (W - 1 >= n)
        return WindowDelta(keys[:, :, -n:].clone(), values[:, :, -n:].clone(), layer.sliding_window)
    if isinstance(layer, QuantizedLayer):
        return capture_quantized(layer, start, end)
    if isinstance(layer, HybridLayer):
        recurrent = capture(layer.recurrent, start, end)
        assert isinstance(recurrent, Snapshot)
        return HybridPayload(capture(layer.attention, start, end), recurrent)  # type: ignore[arg-type]
    snap = canonical(layer)
    return Snapshot(type(snap).__name__, snap.meta_state, {k: v.clone() for k, v in snap.state.items()})


def capture_back(layer: CacheLayer, start: int, end: int, held: int) -> Payload:
    """`capture` of the chunk `[start, end)` from `layer` now holding `held >= end` tokens: a
    boundary a prefill forward passed over. Only layers for which `prefill_span` allowed that
    forward's length are asked (attention whose chunk is still held); the rest only at `held`."""
    if end == held:
        return capture(layer, start, end)
    if type(layer) is DynamicLayer:
        keys, values = (state := layer.state)["keys"], state["values"]
        return Delta(keys[:, :, start:end].clone(), values[:, :, start:end].clone())
    if type(layer) is SlidingWindowLayer and layer.sliding_window - 1 >= end - start:
        keys, values = (state := layer.state)["keys"], state["values"]
        first = held - keys.shape[2]  # absolute position of the oldest token held
        if start < first:
            raise ValueError(f"chunk [{start}, {end}) is no longer held by the window (it keeps {first}..{held})")
        return WindowDelta(keys[:, :, start - first : end - first].clone(), values[:, :, start - first : end - first]
                           .clone(), layer.sliding_window)  # fmt: skip
    if type(layer).__name__ == "EmptyLayer":
        return capture(layer, start, end)
    if quantized_capturable(layer, end - start):  # recording: the forward's codes and copies are held
        return capture_quantized(layer, start, end, held)  # type: ignore[arg-type]
    raise ValueError(f"{type(layer).__name__} keeps no state for a boundary {held - end} token(s) back")


def prefill_span(layer: CacheLayer, chunk: int) -> int:
    """The most tokens one prefill forward into `layer` may feed (from a chunk boundary) while every
    chunk boundary it passes can still be captured afterwards (`capture_back`): any number for
    full attention, for a sliding window at least a chunk wide and for quantized layers, which
    record the forward (keeping its tokens past the window, and the codes and full-precision
    copies of every boundary, until the commit); one chunk for layers that keep only their latest
    state (recurrent, narrow windows)."""
    if isinstance(layer, HybridLayer):
        return min(prefill_span(layer.attention, chunk), prefill_span(layer.recurrent, chunk))
    if type(layer) is DynamicLayer or type(layer).__name__ == "EmptyLayer":
        return 1 << 62
    if type(layer) is SlidingWindowLayer and layer.sliding_window - 1 >= chunk:
        return 1 << 62
    if quantized_capturable(layer, chunk):  # recording the forward: it keeps every boundary's codes
        return 1 << 62
    return chunk


def rebuild(path: list[Payload], device: torch.device | None = None) -> CacheLayer:
    """The layer a cache held after the chunks whose payloads (for this layer) are `path`, in order,
    its tensors on `device` (checked payloads only: see `check_payload`)."""
    last = path[-1]
    if isinstance(last, QuantDelta):
        return rebuild_quantized(path, device)  # type: ignore[arg-type]
    if isinstance(last, WindowDelta):
        keep, parts, held = last.window - 1, [], 0
        for p in reversed(path):  # the last chunks, back to W - 1 tokens
            if held >= keep:
                break
            parts.append(p)
            held += p.keys.shape[2]  # type: ignore[union-attr]
        cut = max(held - keep, 0)
        keys = torch.cat([p.keys.to(device) for p in reversed(parts)], dim=2)[:, :, cut:]  # type: ignore[union-attr]
        values = torch.cat([p.values.to(device) for p in reversed(parts)], dim=2)[:, :, cut:]  # type: ignore[union-attr]
        seen = sum(p.keys.shape[2] for p in path)  # type: ignore[union-attr]
        meta = {"sliding_window": last.window, "seq_length": seen, "kept_length": keys.shape[2],
                "seq_length_at_commit": 0, "record_past": False}  # fmt: skip
        return SlidingWindowLayer.from_state(meta, {"keys": keys, "values": values})
    if isinstance(last, Delta):
        layer = DynamicLayer()  # one copy of each chunk, straight into the layer's storage
        chunks = [(p.keys.to(device), p.values.to(device)) for p in path]  # type: ignore[union-attr]
        layer._kv = KVBuffer.from_chunks(chunks, layer.headroom())
        return layer
    if isinstance(last, HybridPayload):
        attention = rebuild([p.attention for p in path], device)  # type: ignore[union-attr]
        return HybridLayer(attention, rebuild([last.recurrent], device))
    cls = LAYER_REGISTRY[last.cls]  # type: ignore[union-attr]
    return cls.from_state(last.meta, {k: v.to(device=device, copy=True) for k, v in last.state.items()})  # type: ignore[union-attr]


# ------------------------------------------------------------------------------ checking
#: meta_state fields that count tokens, per snapshot class (they scale with the boundary).
_TOKEN_COUNTS = {"SlidingWindowLayer": ("seq_length",)}


def _scaled_meta(cls: str, meta: Any, chunks: int) -> Any:
    """The reference's `meta_state` (taken after one chunk) as it must read after `chunks` chunks."""
    if not isinstance(meta, dict):
        return meta
    out = dict(meta)
    for name in _TOKEN_COUNTS.get(cls, ()):
        out[name] = meta[name] * chunks
    if cls == "RecurrentLayer" and isinstance(meta.get("slots"), list):
        out["slots"] = [{**slot, "seen": slot["seen"] * chunks} for slot in meta["slots"]]
    return out


def _same_tensor(t: Any, ref: torch.Tensor) -> bool:
    return isinstance(t, torch.Tensor) and t.dtype == ref.dtype and tuple(t.shape) == tuple(ref.shape)


def check_payload(payload: Any, ref: Payload, chunks: int) -> str | None:
    """None when `payload` is what the model's own layer keeps at the boundary after `chunks`
    chunks (`ref`: its payload after one chunk); else what differs, for the warning."""
    if type(payload) is not type(ref):
        return f"a {type(payload).__name__} where the model keeps a {type(ref).__name__}"
    if isinstance(ref, QuantDelta):
        return check_quantized(payload, ref, chunks)
    if isinstance(ref, HybridPayload):
        return check_payload(payload.attention, ref.attention, chunks) or check_payload(
            payload.recurrent, ref.recurrent, chunks
        )
    if isinstance(ref, Delta):
        if isinstance(ref, WindowDelta) and payload.window != ref.window:
            return f"sliding window {payload.window}, the model's is {ref.window}"
        for name in ("keys", "values"):
            got, want = getattr(payload, name), getattr(ref, name)
            if not _same_tensor(got, want):
                return f"{name} {tuple(got.shape)} {got.dtype}, the model's are {tuple(want.shape)} {want.dtype}"
        return None
    if payload.cls != ref.cls:
        return f"a {payload.cls} snapshot where the model has a {ref.cls}"
    expected = _scaled_meta(ref.cls, ref.meta, chunks)
    if payload.meta != expected:
        return f"{ref.cls} bookkeeping {payload.meta!r} differs from the model's {expected!r}"[:300]
    if sorted(payload.state) != sorted(ref.state):
        return f"{ref.cls} tensors {sorted(payload.state)}, the model's are {sorted(ref.state)}"
    for name, want in ref.state.items():
        got = payload.state[name]
        if not _same_tensor(got, want):
            return f"{ref.cls} {name} {tuple(got.shape)} {got.dtype}, the model's is {tuple(want.shape)} {want.dtype}"
    return None


def reference_payloads(model: Any, cache: Any, chunk_size: int) -> list[Payload]:
    """What each layer of the model's fresh `cache` keeps after one chunk of tokens: the model run
    on `chunk_size` copies of token 0 (the shapes and kinds do not depend on the tokens)."""
    device = next((p.device for p in model_module(model).parameters()), None) if model_module(model) else None
    ids = torch.zeros(1, chunk_size, dtype=torch.long, device=device)
    with torch.no_grad():
        model(ids, cache=cache, position_ids=torch.arange(chunk_size, device=device)[None], **last_logits(model))
    return [capture(layer, 0, chunk_size) for layer in cache]


def kind_of(layer: CacheLayer) -> str:
    """A layer's kind and parameters, for the layout fingerprint (shapes come from the model)."""
    if isinstance(layer, HybridLayer):
        return f"Hybrid({kind_of(layer.attention)},{kind_of(layer.recurrent)})"
    names = ("sliding_window", "num_states", "bits", "group_size", "residual", "key_groups", "value_groups")
    params = {k: getattr(layer, k) for k in names if hasattr(layer, k)}
    return f"{type(layer).__name__}{sorted(params.items())}"


def storable(layer: CacheLayer, chunk: int) -> bool:
    """Layers a prefix store can keep with chunks of `chunk` tokens: the growing kinds (static
    layers are fixed-size buffers)."""
    if isinstance(layer, HybridLayer):
        return storable(layer.attention, chunk) and storable(layer.recurrent, chunk)
    if isinstance(layer, QuantizedLayer):
        return quantized_capturable(layer, chunk)
    return not layer.is_compileable or type(layer).__name__ == "EmptyLayer"


def model_module(model: Any) -> torch.nn.Module | None:
    """The torch module behind a model (a transformers model behind `wrap_model`), or None."""
    for candidate in (model, getattr(model, "model", None)):
        if isinstance(candidate, torch.nn.Module):
            return candidate
    return None
