"""What a prefix store keeps of each cache layer at a chunk boundary, and how a cache is rebuilt.

Full-attention keys/values grow with the prefix, so a boundary keeps only its chunk's slice (a
*delta*): a prefix of m chunks is the concatenation of m deltas, and prefixes that share chunks
share their tensors. A sliding window wider than a chunk keeps deltas too (its window at a
boundary is the tail of the last chunks). Every other layer kind keeps a bounded state, kept whole
at the boundary (a *snapshot*): a sliding window's last `W - 1` tokens, a recurrent layer's conv window and state
(the SGLang "trailing" idea: the state *at* the boundary, not a replay of tokens), nothing for an
empty layer. A `HybridLayer` keeps a delta of its attention part and a snapshot of its recurrent
part.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..errors import CacheInputError
from ..layers.base import LAYER_REGISTRY, CacheLayer
from ..layers.dynamic import DynamicLayer
from ..layers.hybrid import HybridLayer
from ..layers.kv_buffer import KVBuffer
from ..layers.sliding import SlidingWindowLayer


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
    """One chunk's keys/values of a sliding-window layer whose window spans several chunks: the
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


Payload = Delta | Snapshot | HybridPayload


def capture(layer: CacheLayer, start: int, end: int) -> Payload:
    """What `layer`, holding exactly tokens `[0, end)`, keeps for the boundary at `end` (the chunk
    being `[start, end)`). Copies: the store shares nothing with the cache."""
    if type(layer) is DynamicLayer:
        keys, values = layer.state["keys"], layer.state["values"]
        return Delta(keys[:, :, start:end].clone(), values[:, :, start:end].clone())
    if type(layer) is SlidingWindowLayer and not layer.record_past:
        keys, values = layer.state["keys"], layer.state["values"]
        if keys.shape[2] >= end - start:  # the window holds the whole chunk: keep the chunk only
            n = end - start
            return WindowDelta(keys[:, :, -n:].clone(), values[:, :, -n:].clone(), layer.sliding_window)
    if isinstance(layer, HybridLayer):
        recurrent = capture(layer.recurrent, start, end)
        assert isinstance(recurrent, Snapshot)
        return HybridPayload(capture(layer.attention, start, end), recurrent)  # type: ignore[arg-type]
    if layer.record_past:
        raise CacheInputError("prefix store: a recording layer cannot be captured (commit it first)")
    return Snapshot(type(layer).__name__, layer.meta_state, {k: v.clone() for k, v in layer.state.items()})


def rebuild(path: list[Payload]) -> CacheLayer:
    """The layer a cache held after the chunks whose payloads (for this layer) are `path`, in order."""
    last = path[-1]
    if isinstance(last, WindowDelta):
        keep, parts = last.window - 1, []
        held = 0
        for p in reversed(path):  # the last chunks, back to W - 1 tokens
            if held >= keep:
                break
            parts.append(p)
            held += p.keys.shape[2]  # type: ignore[union-attr]
        keys = torch.cat([p.keys for p in reversed(parts)], dim=2)[:, :, max(held - keep, 0) :]  # type: ignore[union-attr]
        values = torch.cat([p.values for p in reversed(parts)], dim=2)[:, :, max(held - keep, 0) :]  # type: ignore[union-attr]
        seen = sum(p.keys.shape[2] for p in path)  # type: ignore[union-attr]
        # as the layer is after a prefill: not recording, never committed
        meta = {"sliding_window": last.window, "seq_length": seen, "kept_length": keys.shape[2],
                "seq_length_at_commit": 0, "record_past": False}  # fmt: skip
        return SlidingWindowLayer.from_state(meta, {"keys": keys, "values": values})
    if isinstance(last, Delta):
        layer = DynamicLayer()  # one copy of each chunk, straight into the layer's storage
        layer._kv = KVBuffer.from_chunks([(p.keys, p.values) for p in path], layer.growth)  # type: ignore[union-attr]
        return layer
    if isinstance(last, HybridPayload):
        attention = rebuild([p.attention for p in path])  # type: ignore[union-attr]
        return HybridLayer(attention, rebuild([last.recurrent]))
    cls = LAYER_REGISTRY[last.cls]
    return cls.from_state(last.meta, {k: v.clone() for k, v in last.state.items()})


def kind_of(layer: CacheLayer) -> str:
    """A layer's kind and parameters, for the layout fingerprint (shapes come from the model)."""
    if isinstance(layer, HybridLayer):
        return f"Hybrid({kind_of(layer.attention)},{kind_of(layer.recurrent)})"
    params = {k: getattr(layer, k) for k in ("sliding_window", "num_states") if hasattr(layer, k)}
    return f"{type(layer).__name__}{sorted(params.items())}"


def storable(layer: CacheLayer) -> bool:
    """Layers a prefix store can keep: the growing kinds (static layers are fixed-size buffers)."""
    if isinstance(layer, HybridLayer):
        return storable(layer.attention) and storable(layer.recurrent)
    return not layer.is_compileable or type(layer).__name__ == "EmptyLayer"
