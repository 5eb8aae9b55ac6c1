"""A batch's quantized attention layer that quantizes every row as if it ran alone.

A quantized layer quantizes by blocks at fixed positions, and a batch's rows share its quantized
part (`layers.quantized`). Rows that start at different slots (a left-padded batch, a server's
right-aligned batch) would then be cut into blocks where their padding puts them, and a row's
output would depend on what it was batched with. Here each row keeps its own batch-1 layer of its
real tokens, quantized exactly as when it runs alone, and the batch sees them laid out as its
other layers are: row b's tokens after its `pads[b]` padding slots (zeros, masked). A row's
padding may still lie ahead (`skip`): the first tokens fed to that row are then padding, passed
over, so an empty layer takes a left-padded prompt as it comes. Forwards are cut at every row's
own block boundaries (`forward_cuts`), as a lone row's are at its own.

A decode step appends and quantizes per row and dequantizes every row's quantized part in one pass;
joins and leaves move whole row layers, no copy.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any, NamedTuple

import torch
from typing_extensions import Self

from ..errors import CacheInputError
from ..validation import check_flag, check_move, check_query_length
from .base import LAYER_REGISTRY, CacheLayer, register_layer
from .dynamic import record_past_flag
from .quantized import QuantizedLayer, quantize_due


def _counts(value: Any, name: str) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0
                                              for n in value):  # fmt: skip
        raise CacheInputError(f"QuantizedRows: {name} must be a list of non-negative ints, got {value!r}"[:200])
    return list(value)


class _Taken(NamedTuple):
    """A row that took tokens in an update: what it returns, positions `[start, longest)`, goes to
    slots from `slot` of the batch's output, the part before `seen` dequantized."""

    b: int
    row: QuantizedLayer
    slot: int
    start: int
    seen: int


def _lay_out(taken: list[_Taken], keys: torch.Tensor, values: torch.Tensor) -> None:
    """What `QuantizedLayer._assemble` returns for each row that took tokens, written into the
    batch's keys and values: every row's quantized part dequantized in one pass (the same values
    as row by row: the dequantizers are elementwise), joined with the rows' full-precision parts
    and placed with one indexed write. A constant number of kernels per layer, not a dozen per
    row, is what makes a served batch's decode step affordable."""
    if not taken:
        return
    like = taken[0].row
    for i, out in enumerate((keys, values)):
        data, params, fps, places, fp_places, at, fp_at = [], [], [], [], [], 0, 0
        for b, row, slot, start, seen in taken:
            split, longest = max(seen, start), row._longest()
            if split > start:
                held, held_params, first = row._held(i, start, split)
                data.append(held)
                params.append(held_params)
                places.append((b, slot, at + start - first, split - start))
                at += split - first
            if longest > split:
                fps.append(row._fp.span(i, longest - split, longest - split))
                fp_places.append((b, slot + split - start, fp_at, longest - split))
                fp_at += longest - split
        # the dequantized parts, then the full-precision ones, in one buffer: the large part is
        # written where it stays, not copied again by a concatenation
        source = out.new_empty(1, out.shape[1], at + fp_at, out.shape[3])
        if data:
            joined = [torch.cat(parts, 2) if len(parts) > 1 else parts[0] for parts in (data, params)]
            like._dequantize_held(i, *joined, out.dtype, out=source.narrow(2, 0, at))
        if fps:
            source.narrow(2, at, fp_at).copy_(torch.cat(fps, 2) if len(fps) > 1 else fps[0])
        placed = (*places, *((b, slot, at + src, n) for b, slot, src, n in fp_places))
        rows, slots, picks = _placement(placed, out.device)
        out[rows, :, slots] = (source[0] if picks is None else source[0].index_select(1, picks)).transpose(0, 1)


@functools.lru_cache(maxsize=8)
def _placement(places: tuple[tuple[int, int, int, int], ...],
               device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:  # fmt: skip
    """For runs `(row, first slot, first source token, count)`: the row and slot each source token
    goes to and the source tokens picked (None: all, in order), as index tensors on `device`
    (cached: a step's layers share them; built from the runs on the device, no host wait)."""
    runs = torch.tensor(places, dtype=torch.long).T
    cuda = device.type == "cuda"
    runs = runs.pin_memory().to(device, non_blocking=True) if cuda else runs.to(device)
    total = sum(n for *_, n in places)
    counts = runs[3]
    within = torch.arange(total, device=device) - torch.repeat_interleave(counts.cumsum(0) - counts, counts,
                                                                          output_size=total)  # fmt: skip
    rows, slots, picks = (torch.repeat_interleave(runs[k], counts, output_size=total) for k in range(3))
    ends = [src + n for _, _, src, n in places]
    in_order = places[0][2] == 0 and all(src == end for (_, _, src, _), end in zip(places[1:], ends, strict=False))
    return rows, slots + within, None if in_order else picks + within


@register_layer
class QuantizedRows(CacheLayer):
    """Rows of a batch, each a batch-1 `QuantizedLayer` (or quantized window) of its real tokens,
    placed after `pads[b]` padding slots, of which the first `skip[b]` are still to come (the row
    holds nothing until they have passed). With no rows (after `reset`), the first update makes
    one unpadded row per batch row, like the `blank` layer. `cuts=False`: the caller never feeds a
    row's real tokens across its own block boundary in one forward (a server's drafts stop there),
    so forwards are not cut for what it feeds past them (fillers it drops)."""

    crops_rows = True

    def __init__(self, rows: list[QuantizedLayer], pads: list[int], skip: list[int] | None = None,
                 blank: QuantizedLayer | None = None, *, cuts: bool = True) -> None:  # fmt: skip
        super().__init__()
        if not isinstance(cuts, bool):
            raise CacheInputError(f"QuantizedRows: cuts must be a bool, got {cuts!r}")
        self.cuts = cuts
        pads = _counts(pads, "pads")
        skip = [0] * len(pads) if skip is None else _counts(skip, "skip")
        if not isinstance(rows, list) or len(rows) != len(pads) or len(skip) != len(pads):
            raise CacheInputError("QuantizedRows takes one padding count (and skip count) per row")
        for row, pad, ahead in zip(rows, pads, skip, strict=True):
            if not isinstance(row, QuantizedLayer) or row.batch_size not in (None, 1):
                raise CacheInputError(f"QuantizedRows takes batch-1 quantized layers, got {row!r}"[:200])
            if ahead > pad or (ahead and row.get_seq_length()):
                raise CacheInputError(f"QuantizedRows: a row holding {row.get_seq_length()} token(s) after {pad} "
                                      f"padding slot(s) cannot have {ahead} still to come")  # fmt: skip
        blank = blank if blank is not None else rows[0] if rows else None
        if not isinstance(blank, QuantizedLayer):
            raise CacheInputError("QuantizedRows needs a quantized layer to make its rows like (rows or blank)")
        self.rows, self.pads, self.skip = rows, pads, skip
        self._blank = type(blank)(**type(blank)._params(blank.meta_state))  # its parameters, no tokens
        self.is_sliding = self._blank.is_sliding  # type: ignore[misc]

    @property
    def like(self) -> QuantizedLayer:
        """An empty layer of the rows' kind and parameters."""
        return self._blank

    @classmethod
    def padded(cls, layer: QuantizedLayer, pads: list[int]) -> QuantizedRows:
        """Empty rows like `layer` (empty itself) for a batch whose row b starts with `pads[b]`
        padding tokens, still to come."""
        if layer.get_seq_length():
            raise CacheInputError(f"QuantizedRows.padded takes an empty layer, got one of {layer.get_seq_length()}")
        pads = _counts(pads, "pads")
        rows = [layer.copy() for _ in pads]
        padded = cls(rows, pads, list(pads), blank=layer)
        padded._recording = layer.record_past
        return padded

    # ------------------------------------------------------------------------- lengths
    def row_lengths(self) -> list[int]:
        return [pad - ahead + row.get_seq_length() for row, pad, ahead in zip(self.rows, self.pads, self.skip,
                                                                              strict=True)]  # fmt: skip

    def get_seq_length(self) -> int:
        return max(self.row_lengths(), default=0)

    @property
    def is_ragged(self) -> bool:
        return len(set(self.row_lengths())) > 1

    @property
    def batch_size(self) -> int | None:
        return len(self.rows) or None

    @property
    def forward_block(self) -> int:  # type: ignore[override]
        return self._blank.forward_block

    def forward_cuts(self, length: int) -> set[int]:
        """Each row's own block boundaries within a forward of `length` tokens (after its padding
        still to come): where a lone row's forward would be cut."""
        block, cuts = self.forward_block, set()
        if not self.cuts:
            return cuts
        for row, ahead in zip(self.rows, self.skip, strict=True):
            own = row.get_seq_length()
            real = length - min(ahead, length)
            cuts.update(ahead + end - own for end in range((own // block + 1) * block, own + real, block))
        return cuts

    def _layout(self, query_length: int) -> tuple[list[int | None], int, int]:
        """Where each row's returned keys start (physical slots; None: it returns none), the first
        slot returned, and how many slots are returned, for an update of `query_length` tokens."""
        starts: list[int | None] = []
        for row, pad, ahead in zip(self.rows, self.pads, self.skip, strict=True):
            real = query_length - min(ahead, query_length)
            starts.append(pad + row.get_mask_sizes(real)[1] if real or row.get_seq_length() else None)
        present = [s for s in starts if s is not None]
        offset = min(present, default=0) if self.is_sliding else 0
        return starts, offset, self.get_seq_length() + query_length - offset

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        query_length = check_query_length(query_length)
        _, offset, length = self._layout(query_length)
        return length, offset

    def get_max_length(self) -> int:
        return -1

    # -------------------------------------------------------------------------- update
    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not isinstance(key_states, torch.Tensor) or not isinstance(value_states, torch.Tensor) \
                or key_states.dim() != 4 or value_states.dim() != 4:  # fmt: skip
            raise CacheInputError("QuantizedRows.update takes [batch, heads, tokens, head_dim] keys and values")
        if not self.rows:
            batch = key_states.shape[0]
            self.rows, self.pads, self.skip = [self._blank.copy() for _ in range(batch)], [0] * batch, [0] * batch
            for row in self.rows:
                row.record_past = self._recording
        if key_states.shape[0] != len(self.rows) or value_states.shape[0] != len(self.rows):
            raise CacheInputError(f"QuantizedRows.update: {key_states.shape[0]} rows of keys for a batch of "
                                  f"{len(self.rows)}")  # fmt: skip
        query = key_states.shape[2]
        starts, offset, length = self._layout(query)
        batch, heads = key_states.shape[:2]
        keys = key_states.new_zeros(batch, heads, length, key_states.shape[3])
        values = value_states.new_zeros(batch, heads, length, value_states.shape[3])
        passed = [min(ahead, query) for ahead in self.skip]
        fed = [(b, key_states[b : b + 1, :, n:], value_states[b : b + 1, :, n:]) for b, n in enumerate(passed)
               if n < query]  # fmt: skip
        for b, row_keys, row_values in fed:  # every row checked before any changes
            self.rows[b]._check_update(row_keys, row_values)
        taken, due = [], []
        for b, row_keys, row_values in fed:  # as `QuantizedLayer.update` does, up to its `_assemble`
            row = self.rows[b]
            visible, seen = row._first_visible(), row._quantized
            row._fp.append(row_keys, row_values)
            if (tokens := row._due()) is not None:
                due.append((row, tokens))
            taken.append(_Taken(b, row, starts[b] - offset, visible, seen))  # type: ignore[operator]
        if due:  # every row's new blocks quantized together
            for (row, _), quantized in zip(due, quantize_due(due[0][0], [t for _, t in due]), strict=True):
                row._take(*quantized)
        _lay_out(taken, keys, values)
        for took in taken:
            took.row._evict()
        self.skip = [ahead - n for ahead, n in zip(self.skip, passed, strict=True)]
        return keys, values

    # ------------------------------------------------------------------------ rollback
    @property
    def max_rollback(self) -> int:
        return min(self.row_rollback(), default=0)

    def row_rollback(self) -> list[int]:
        """A row goes back within its own tokens, and into its padding once it can drop them all."""
        out = []
        for row, pad, ahead in zip(self.rows, self.pads, self.skip, strict=True):
            most, held = row.max_rollback, row.get_seq_length()
            out.append(most + pad - ahead if most >= held else most)
        return out

    @property
    def is_croppable(self) -> bool:
        return all(row.is_croppable for row in self.rows)

    def activate_past_recording(self) -> None:
        for row in self.rows:
            row.activate_past_recording()
        self._recording = True

    @property
    def record_past(self) -> bool:
        return self._recording

    @record_past.setter
    def record_past(self, value: bool) -> None:
        check_flag(value, "record_past")
        for row in self.rows:
            row.record_past = value
        self._recording = bool(value)

    def _rollback_hint(self) -> str:
        return self.rows[0]._rollback_hint() if self.rows else super()._rollback_hint()

    def _remove_last(self, n: int) -> None:
        self._remove_rows([n] * len(self.rows))

    def _remove_rows(self, counts: list[int]) -> None:
        for b, (row, n) in enumerate(zip(self.rows, counts, strict=True)):
            own = min(n, row.get_seq_length())
            if own:
                row.crop(-own)
            self.skip[b] += n - own  # back into the padding: those slots come again

    def _commit(self) -> None:
        for row in self.rows:
            row.crop(0)

    def reset(self) -> None:
        self.rows, self.pads, self.skip = [], [], []

    def _index_batch(self, index: torch.Tensor) -> None:
        picked = [int(i) for i in index.tolist()]
        self.rows = [self.rows[i] if picked.count(i) == 1 else self.rows[i].copy() for i in picked]
        self.pads = [self.pads[i] for i in picked]
        self.skip = [self.skip[i] for i in picked]

    def nbytes(self) -> int:
        return sum(row.nbytes() for row in self.rows)

    def to(self, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> Self:
        """Every row moved as `QuantizedLayer.to` moves it (quantized data and scales keep their
        types); in place, returns the layer."""
        device, dtype = check_move(device, dtype)
        for row in self.rows:
            row.to(device, dtype)
        return self

    # ---------------------------------------------------------------------- persistence
    @property
    def state(self) -> dict[str, torch.Tensor]:
        return {f"{b}.{name}": t for b, row in enumerate(self.rows) for name, t in row.state.items()}

    @property
    def meta_state(self) -> dict[str, Any]:
        return {"pads": self.pads, "skip": self.skip, "record_past": self._recording, "cuts": self.cuts,
                "blank": {"class": type(self._blank).__name__, "meta_state": self._blank.meta_state},
                "rows": [{"class": type(row).__name__, "meta_state": row.meta_state} for row in self.rows]}  # fmt: skip

    @staticmethod
    def _quantized_layer(about: Any, state: dict[str, torch.Tensor], what: str) -> QuantizedLayer:
        cls = LAYER_REGISTRY.get(about.get("class")) if isinstance(about, dict) else None
        if cls is None or not issubclass(cls, QuantizedLayer) or not isinstance(about.get("meta_state"), dict):
            raise CacheInputError(f"QuantizedRows: {what} must name a quantized layer class and its meta_state")
        return cls.from_state(about["meta_state"], state)

    @classmethod
    def from_state(cls, meta_state: dict[str, Any], state: dict[str, torch.Tensor]) -> Self:
        abouts = meta_state.get("rows")
        if not isinstance(abouts, list):
            raise CacheInputError(f"QuantizedRows: 'rows' must be a list, got {abouts!r}"[:200])
        rows, taken = [], set()
        for b, about in enumerate(abouts):
            prefix = f"{b}."
            own = {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}
            taken.update(prefix + k for k in own)
            rows.append(cls._quantized_layer(about, own, f"row {b}"))
        if set(state) - taken:
            raise CacheInputError(f"QuantizedRows: tensors {sorted(set(state) - taken)} belong to no row")
        blank = cls._quantized_layer(meta_state.get("blank"), {}, "blank")
        layer = cls(rows, meta_state.get("pads"), meta_state.get("skip"), blank=blank,  # type: ignore[arg-type]
                    cuts=meta_state.get("cuts", True))  # fmt: skip
        recording = record_past_flag(meta_state, "QuantizedRows")
        if rows and any(row.record_past != recording for row in rows):
            raise CacheInputError("QuantizedRows: 'record_past' differs from its rows'")
        layer._recording = recording
        return layer


def quantized_rows(layer: CacheLayer, pads: list[int]) -> CacheLayer:
    """`layer` (empty) as a left-padded batch must hold it: a quantized attention layer (or a
    hybrid's quantized attention part) as `QuantizedRows` with `pads[b]` padding slots to come in
    row b; any other layer as it is."""
    from .hybrid import HybridLayer

    if isinstance(layer, HybridLayer):
        attention = quantized_rows(layer.attention, pads)
        return layer if attention is layer.attention else HybridLayer(attention, layer.recurrent)
    if isinstance(layer, QuantizedLayer):
        return QuantizedRows.padded(layer, pads)
    if isinstance(layer, QuantizedRows):
        return QuantizedRows.padded(layer.like, pads)
    return layer


@contextlib.contextmanager
def rows_quantized_alone(cache: Any, pads: list[int]) -> Iterator[None]:
    """While a batch whose row b starts with `pads[b]` padding tokens is fed to `cache` (empty):
    its quantized attention layers quantize every row at the row's own positions (`QuantizedRows`),
    so a row's tokens are those it gets alone; layers a lazy cache builds meanwhile too. Nothing
    changes for unpadded batches of quantized layers, or without any; a cache that ends empty (a
    run that failed and was rolled back) gets its own layers back."""
    container = getattr(cache, "self_attention_cache", cache)
    layers = container.layers
    if container.get_seq_length() or not (any(pads) or any(isinstance(layer, QuantizedRows) for layer in layers)):
        yield
        return
    original = list(layers)
    layers[:] = [quantized_rows(layer, pads) for layer in layers]
    factory = container.layer_factory
    if factory is not None:
        container.layer_factory = lambda: quantized_rows(factory(), pads)
    try:
        yield
    finally:
        container.layer_factory = factory
        if not container.get_seq_length():
            layers[:] = original
