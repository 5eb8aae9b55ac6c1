"""A server's running batch: the caches of several requests as the rows of one cache.

Rows are right-aligned: every row ends at the same physical position `P`, and row b's real tokens
are the last `P - pad[b]` (its first `pad[b]` slots are padding that its attention mask hides, as
in a left-padded batch). A decode step then appends one token to every row with one forward, at
positions taken from each row's own length. A request joins by `stack`: its own cache (prefilled
alone, through the prefix store) and every row already running are laid out again around the new
longest row. This copies the batch once per join (not per token), and normalizes whatever the
rows went through (per-row crops, left padding no longer needed). A row's content comes out of the
batch as a batch-1 layer of its real tokens only (`row_state`), which is also what the prefix
store captures at a row's chunk boundaries (`row_payloads`).

Layers must be committed (no rollback history) when rows are stacked or read.
"""

from __future__ import annotations

from typing import Any

import torch

from ..cache import Cache
from ..errors import CacheInputError
from ..layers.base import LAYER_REGISTRY, CacheLayer
from ..layers.dynamic import DynamicLayer
from ..layers.empty import EmptyLayer
from ..layers.hybrid import HybridLayer
from ..layers.quantized_rows import QuantizedRows
from ..layers.recurrent import RecurrentLayer
from ..layers.sliding import SlidingWindowLayer
from ..store.payloads import Delta, Payload, WindowDelta, capture

#: (class name, meta_state, state) of a batch-1 layer: one row's content.
RowState = tuple[str, dict[str, Any], dict[str, torch.Tensor]]
#: Quantized attention, batched as `QuantizedRows`.
QUANTIZED = ("QuantizedLayer", "QuantizedSlidingWindowLayer")


def row_state(layer: CacheLayer, r: int, pad: int, end: int | None = None) -> RowState:
    """Row `r` of `layer` (committed) as a batch-1 layer of its real tokens (the physical slots
    after its `pad` padding ones, up to the row's length or the physical slot `end`: what a forward
    put after it is not the row's); tensors are views."""
    if isinstance(layer, HybridLayer):
        parts = {name: row_state(getattr(layer, name), r, pad, end) for name in ("attention", "recurrent")}
        state = {f"{name}.{k}": v for name, (_, _, s) in parts.items() for k, v in s.items()}
        meta = {name: {"class": cls, "meta_state": m} for name, (cls, m, _) in parts.items()}
        return "HybridLayer", meta, state
    if isinstance(layer, EmptyLayer):
        return "EmptyLayer", {"record_past": False}, {}
    if isinstance(layer, QuantizedRows):  # each row is its own layer already
        row = layer.rows[r]
        return type(row).__name__, row.meta_state, row.state
    length = layer.row_lengths()[r] if end is None else end  # physical: padding included
    real = length - pad
    if type(layer) is SlidingWindowLayer:
        meta, held = layer.meta_state, layer.state
        kept_from = meta["seq_length"] - meta["kept_length"]
        window = min(layer.sliding_window - 1, real)
        keys, values = (held[name][r : r + 1, :, length - window - kept_from : length - kept_from]
                        for name in ("keys", "values"))  # fmt: skip
        return "SlidingWindowLayer", {"sliding_window": layer.sliding_window, "seq_length": real,
                                      "kept_length": window, "seq_length_at_commit": 0,
                                      "record_past": False}, {"keys": keys, "values": values}  # fmt: skip
    if type(layer) is DynamicLayer:
        held = layer.state
        state = {name: held[name][r : r + 1, :, pad:length] for name in ("keys", "values")}
        return "DynamicLayer", {"seq_length": real, "record_past": False}, state
    if type(layer) is RecurrentLayer:
        state, slots = {}, []
        for s in range(layer.num_states):
            conv, rec = layer.get_conv_state(s), layer.get_recurrent_state(s)
            if conv is not None:
                state[f"conv.{s}"] = conv[r : r + 1]
            if rec is not None:
                state[f"recurrent.{s}"] = rec[r : r + 1]
            kernel = None if conv is None else conv.shape[-1]
            slots.append({"kernel": kernel, "conv_columns": kernel or 0, "conv_from_empty": True,
                          "seen": real if (conv is not None or rec is not None) else 0, "open_tokens": None,
                          "open_at_commit": None, "steps": []})  # fmt: skip
        return "RecurrentLayer", {"num_states": layer.num_states, "record_past": False, "slots": slots}, state
    if type(layer).__name__ in QUANTIZED:  # a request's own cache (batch 1, real tokens only)
        return type(layer).__name__, layer.meta_state, layer.state
    raise CacheInputError(f"a server batch holds dynamic layers only, not {type(layer).__name__}")


def row_layer(layer: CacheLayer, r: int, pad: int, end: int | None = None) -> CacheLayer:
    """Row `r` of `layer` as a batch-1 layer of its own (copies; `end` as `row_state` takes it)."""
    cls, meta, state = row_state(layer, r, pad, end)
    return LAYER_REGISTRY[cls].from_state(meta, {k: v.clone() for k, v in state.items()})


def row_payloads(cache: Cache, r: int, pad: int, start: int, end: int, stop: int | None = None) -> list[Payload]:
    """What the prefix store keeps for row `r`'s chunk `[start, end)` (the row holding exactly
    `end` real tokens, up to the physical slot `stop` where a forward fed it more): as
    `payloads.capture` takes it from a batch-1 cache, without copying more than the chunk of a
    full-attention layer."""
    return [_row_payload(layer, r, pad, start, end, stop) for layer in cache]


def row_payloads_back(cache: Cache, r: int, pad: int, start: int, end: int, held: int) -> list[Payload]:
    """`row_payloads` of a chunk `[start, end)` that a prefill forward passed over, row `r` now
    holding `held >= end` real tokens (`capture_back` for a batch row): full attention keeps every
    token, and a sliding window that recorded the forward keeps the forward's tokens."""
    if end == held:
        return row_payloads(cache, r, pad, start, end)
    return held_payloads(cache, r, pad, start, end)


def held_payloads(cache: Cache, r: int, pad: int, start: int, end: int) -> list[Payload]:
    """`row_payloads` of chunk `[start, end)` read from the physical slots `pad + start ..` that the
    layers still hold (full attention, a window that recorded the forward), whatever the forward
    put after them."""
    out: list[Payload] = []
    for layer in cache:
        if isinstance(layer, EmptyLayer):
            out.append(capture(layer, start, end))
            continue
        held_keys, held_values = (state := layer.state)["keys"], state["values"]
        first = pad + start
        if type(layer) is SlidingWindowLayer:
            first -= layer.get_seq_length() - held_keys.shape[2]  # the oldest physical slot it still holds
            if first < 0 or layer.sliding_window - 1 < end - start:
                raise ValueError(f"chunk [{start}, {end}) of row {r} is no longer held by the window")
        elif type(layer) is not DynamicLayer:
            raise ValueError(f"{type(layer).__name__} keeps no state for chunk [{start}, {end}) of row {r} once a "
                             "forward went past it")  # fmt: skip
        keys, values = (t[r : r + 1, :, first : first + end - start].clone() for t in (held_keys, held_values))
        window = getattr(layer, "sliding_window", None)
        out.append(Delta(keys, values) if type(layer) is DynamicLayer else WindowDelta(keys, values, window))
    return out


def _row_payload(layer: CacheLayer, r: int, pad: int, start: int, end: int, stop: int | None = None) -> Payload:
    if type(layer) is DynamicLayer:
        held = layer.state
        return Delta(*(held[name][r : r + 1, :, pad + start : pad + end].clone() for name in ("keys", "values")))
    if type(layer) is SlidingWindowLayer and layer.sliding_window - 1 >= end - start:
        _, _, state = row_state(layer, r, pad, stop)
        n = end - start
        return WindowDelta(state["keys"][:, :, -n:].clone(), state["values"][:, :, -n:].clone(), layer.sliding_window)
    if isinstance(layer, QuantizedRows):
        return capture(layer.rows[r], start, end)
    if isinstance(layer, HybridLayer):
        from ..store.payloads import HybridPayload

        return HybridPayload(_row_payload(layer.attention, r, pad, start, end, stop),  # type: ignore[arg-type]
                             _row_payload(layer.recurrent, r, pad, start, end, stop))  # type: ignore[arg-type]  # fmt: skip
    return capture(row_layer(layer, r, pad, stop), start, end)


def _stack_layer(rows: list[RowState]) -> CacheLayer:
    """One layer whose rows are `rows` (batch-1 states of one kind), right-aligned."""
    cls, meta0, _ = rows[0]
    if cls == "HybridLayer":
        parts = []
        for name in ("attention", "recurrent"):
            prefix = f"{name}."
            parts.append(_stack_layer([(m[name]["class"], m[name]["meta_state"],
                                        {k[len(prefix):]: v for k, v in s.items() if k.startswith(prefix)})
                                       for _, m, s in rows]))  # fmt: skip
        return HybridLayer(*parts)
    if cls == "EmptyLayer":
        return EmptyLayer()
    if cls == "RecurrentLayer":
        longest = max(m["slots"][0]["seen"] for _, m, _ in rows)
        state = {name: torch.cat([s[name] for _, _, s in rows]) for name in rows[0][2]}
        slots = [{**slot, "seen": longest if slot["seen"] else 0} for slot in meta0["slots"]]
        return RecurrentLayer.from_state({**meta0, "slots": slots}, state)
    reals = [m["seq_length"] for _, m, _ in rows]
    longest = max(reals)
    if cls in QUANTIZED:  # rows keep their own layers (blocks where the request alone has them)
        layers = [LAYER_REGISTRY[c].from_state(m, s) for c, m, s in rows]
        # drafts stop at each row's block boundaries (`serve.speculation`): fillers past them need no cut
        return QuantizedRows(layers, [longest - n for n in reals], cuts=False)  # type: ignore[arg-type]
    if cls == "SlidingWindowLayer":
        kept = min(meta0["sliding_window"] - 1, longest)
        meta = {**meta0, "seq_length": longest, "kept_length": kept}
    else:
        kept, meta = longest, {"seq_length": longest, "record_past": False}
    state = {}
    for name in ("keys", "values"):
        like = rows[0][2][name]
        out = like.new_zeros(len(rows), like.shape[1], kept, like.shape[3])  # padding: finite, masked
        for b, (_, _, s) in enumerate(rows):
            n = s[name].shape[2]
            if n:
                out[b, :, kept - n :] = s[name][0]
        state[name] = out
    return LAYER_REGISTRY[cls].from_state(meta, state)


def stack(rows: list[list[RowState]]) -> tuple[Cache, list[int]]:
    """A batch cache of `rows` (each a list of per-layer row states, one model's layers) and each
    row's padding: the rows right-aligned at the longest one's length."""
    layers = [_stack_layer([row[i] for row in rows]) for i in range(len(rows[0]))]
    reals = [_real_length(row) for row in rows]
    longest = max(reals)
    return Cache(layers), [longest - n for n in reals]


#: Layers whose running rows `join` copies as one block (rows that end together).
_BLOCK_COPIED = (DynamicLayer, SlidingWindowLayer)


def join(cache: Cache | None, pads: list[int], joining: list[list[RowState]]) -> tuple[Cache, list[int]]:
    """`stack(rows_of(cache, pads) + joining)`, the same layout bit for bit, with the running rows
    of a batch of full attention and sliding windows (every layer's rows ending together) copied as
    one block per tensor instead of row by row: a join's cost no longer grows with the batch's rows
    in the interpreter (31 rows, 2 newcomers, a 4-layer model: 7.6 -> 0.5 ms). Other batches (rows
    that a per-row crop left ragged, recurrent and quantized layers) are laid out again row by row."""
    if cache is None or not pads:
        return stack(joining)
    if not all(type(layer) in _BLOCK_COPIED and not layer.is_ragged for layer in cache) or not all(
            row[i][0] == type(layer).__name__ for row in joining for i, layer in enumerate(cache)):  # fmt: skip
        return stack(rows_of(cache, pads) + joining)
    physical = cache.get_seq_length()
    trim = min(pads)  # columns that are padding in every running row: dropped, as `stack` drops them
    reals = [physical - pad for pad in pads] + [_real_length(row) for row in joining]
    longest = max(reals)
    layers: list[CacheLayer] = []
    for i, layer in enumerate(cache):
        sliding = type(layer) is SlidingWindowLayer
        # a window holds each row's last `kept` tokens, right-aligned (zeros before a shorter row's)
        kept = min(layer.sliding_window - 1, longest) if sliding else longest  # type: ignore[attr-defined]
        state = {}
        for name, held in layer.state.items():
            batch, heads, width, dim = held.shape
            capacity = layer.headroom().capacity(kept)  # what a copy into a new layer would reserve
            out = held.new_empty(batch + len(joining), heads, capacity, dim).narrow(2, 0, kept)
            # the running rows' last columns (every real token a window keeps, then padding)
            take = min(kept, width) if sliding else physical - trim
            out[:batch, :, : kept - take].zero_()
            out[:batch, :, kept - take :].copy_(held[:, :, width - take :])
            for j, row in enumerate(joining):
                tensor = row[i][2][name][0]
                out[batch + j, :, : kept - tensor.shape[1]].zero_()  # padding: finite, masked
                out[batch + j, :, kept - tensor.shape[1] :].copy_(tensor)
            state[name] = out
        if sliding:
            meta = {"sliding_window": layer.sliding_window, "seq_length": longest, "kept_length": kept,  # type: ignore[attr-defined]
                    "seq_length_at_commit": 0, "record_past": False}  # fmt: skip
            layers.append(SlidingWindowLayer.adopt_state(meta, state))
        else:
            layers.append(DynamicLayer.adopt_state({"seq_length": longest, "record_past": False}, state))
    return Cache(layers), [longest - n for n in reals]


def _real_length(row: list[RowState]) -> int:
    for cls, meta, _ in row:
        if cls in ("DynamicLayer", "SlidingWindowLayer", *QUANTIZED):
            return meta["seq_length"]
        if cls == "HybridLayer":
            return meta["attention"]["meta_state"]["seq_length"]
    for cls, meta, _ in row:
        if cls == "RecurrentLayer":
            return max(slot["seen"] for slot in meta["slots"])
    return 0


def rows_of(cache: Cache, pads: list[int]) -> list[list[RowState]]:
    """Every row of a batch cache as per-layer row states (views)."""
    return [[row_state(layer, r, pad) for layer in cache] for r, pad in enumerate(pads)]


def single(cache: Cache) -> list[RowState]:
    """A batch-1 cache (a request prefilled alone) as the row states `stack` takes."""
    return [row_state(layer, 0, 0) for layer in cache]
