"""A left-padded batch with a quantized cache: every row quantized at its own positions
(`QuantizedRows`), so each row's tokens and scores are those it gets alone, in `generate` and in
batched speculative decoding; the layer's forward cuts, crops into the padding, persistence and
bad input. Models in float64: a batch and a single row then compute alike bit for bit (checked
here for full precision first), so any difference is the quantization's grouping."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_speculative import VOCAB, make_target

from kvcache import CacheInputError, DynamicCache, RollbackError, load_cache, save_cache
from kvcache.cache import Cache
from kvcache.generation import ModelDrafter, PromptLookupDrafter, generate, speculative_generate
from kvcache.layers import QuantizedLayer, QuantizedRows, QuantizedSlidingWindowLayer

pytestmark = pytest.mark.usefixtures("one_thread")

LENGTHS = [30, 21, 9, 14]  # prompts crossing 16-token blocks, padded by 0 to 21 slots
NEW = 30


def padded(lengths: list[int] = LENGTHS, seed: int = 4) -> tuple[torch.Tensor, torch.Tensor, list[list[int]]]:
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(1, VOCAB, (n,), generator=gen).tolist() for n in lengths]
    width = max(lengths)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return ids, mask, prompts


def model_of(kind: str, bits: int | None) -> torch.nn.Module:
    model = make_target(kind).double()
    model.kv_bits, model.kv_group_size = bits, 32
    return model


def alone(model, prompt: list[int], cache=None) -> tuple[list[int], list[torch.Tensor]]:
    out = generate(model, torch.tensor([prompt]), max_new_tokens=NEW, eos_token_id=[], output_scores=True,
                   cache=cache if cache is not None else model.new_cache())  # fmt: skip
    return out.sequences[0, len(prompt) :].tolist(), [s[0] for s in out.scores]


@pytest.mark.parametrize("bits", [None, 4, 8])
@pytest.mark.parametrize("kind", ["full", "sliding", "hybrid"])
def test_every_row_of_a_padded_batch_is_what_it_is_alone(kind: str, bits: int | None) -> None:
    """Tokens and scores bit for bit, for each row of a left-padded batch through `generate`, and
    tokens for batched speculative decoding (prompt lookup and a draft model). Before rows were
    quantized alone, the padded rows' scores differed by up to 0.5 at int4."""
    model = model_of(kind, bits)
    ids, mask, prompts = padded()
    out = generate(model, ids, attention_mask=mask, max_new_tokens=NEW, eos_token_id=[], output_scores=True)
    width = ids.shape[1]
    for b, prompt in enumerate(prompts):
        tokens, scores = alone(model, prompt)
        assert out.sequences[b, width:].tolist() == tokens, b
        assert all(torch.equal(step[b], own) for step, own in zip(out.scores, scores, strict=True)), b
        for drafter in (PromptLookupDrafter(), ModelDrafter(model)):
            spec = speculative_generate(model, drafter, ids, attention_mask=mask, max_new_tokens=NEW,
                                        eos_token_id=[], num_draft_tokens=3)  # fmt: skip
            assert spec.sequences[b, width:].tolist() == tokens, (b, type(drafter).__name__)
    if bits is not None:
        attention = [getattr(layer, "attention", layer) for layer in out.cache.layers]
        assert any(isinstance(layer, QuantizedRows) for layer in attention), out.cache.layers


def test_a_lazy_quantized_cache_quantizes_the_rows_alone_too() -> None:
    """`DynamicCache(kv_bits=4)` builds its layers in the first forward: they are built as rows
    quantized alone, and the cache's layer factory is left as it was."""
    model = model_of("full", None)
    ids, mask, prompts = padded()
    cache = DynamicCache(kv_bits=4, group_size=32)
    factory = cache.layer_factory
    out = generate(model, ids, attention_mask=mask, max_new_tokens=NEW, eos_token_id=[], cache=cache)
    assert cache.layer_factory is factory and all(isinstance(layer, QuantizedRows) for layer in cache.layers)
    for b, prompt in enumerate(prompts):
        own = alone(model, prompt, DynamicCache(kv_bits=4, group_size=32))[0]
        assert out.sequences[b, ids.shape[1] :].tolist() == own


def naive_cuts(owns: list[int], ahead: list[int], length: int, block: int) -> set[int]:
    """Offsets into a forward of `length` tokens before which some row reaches a multiple of
    `block` of its own tokens (after its `ahead` padding tokens), token by token."""
    cuts = set()
    for own, skip in zip(owns, ahead, strict=True):
        for offset in range(skip, length):
            position = own + offset - skip  # the row's own position of the token at `offset`
            if position and position % block == 0 and offset:
                cuts.add(offset)
    return cuts


def test_forwards_are_cut_at_every_rows_own_block_boundaries() -> None:
    pads = [0, 3, 6, 9]
    layer = QuantizedRows.padded(QuantizedLayer(4, 32, residual=4), pads)
    cache = Cache([layer])
    keys = torch.randn(4, 1, 13, 8, dtype=torch.float64)
    assert layer.forward_cuts(13) == naive_cuts([0] * 4, pads, 13, 4) == {4, 7, 8, 10, 11, 12}
    assert cache.forward_segments(13) == [4, 3, 1, 2, 1, 1, 1]
    layer.update(keys, keys)
    owns = [13 - p for p in pads]
    assert layer.row_lengths() == [13] * 4 and [row.get_seq_length() for row in layer.rows] == owns
    assert layer.forward_cuts(7) == naive_cuts(owns, [0] * 4, 7, 4) and layer.forward_cuts(7)
    # a server's rows (drafts stop at each row's boundaries; what it feeds past them is dropped): no cuts
    served = QuantizedRows.from_state({**layer.meta_state, "cuts": False}, layer.state)
    assert served.forward_cuts(7) == set() and Cache([served]).forward_segments(7) == [7]
    assert QuantizedRows.from_state(served.meta_state, served.state).cuts is False
    with pytest.raises(CacheInputError, match="cuts"):
        QuantizedRows.from_state({**layer.meta_state, "cuts": "no"}, layer.state)


@pytest.mark.parametrize("window", [None, 6])
def test_a_crop_into_the_padding_brings_the_padding_back(window: int | None) -> None:
    """Cropping a padded row past its own tokens puts its padding back to come: the same update
    again returns the same keys, and the rows hold what they held."""
    blank = QuantizedLayer(4, 32, residual=4) if window is None else QuantizedSlidingWindowLayer(window, 4, 32, 4)
    layer = QuantizedRows.padded(blank, [0, 5])
    layer.activate_past_recording()
    keys, values = torch.randn(2, 1, 9, 8, dtype=torch.float64), torch.randn(2, 1, 9, 8, dtype=torch.float64)
    first = layer.update(keys, values)
    assert layer.row_lengths() == [9, 9] and layer.rows[1].get_seq_length() == 4 and layer.skip == [0, 0]
    layer.crop(-7)
    assert layer.row_lengths() == [2, 2] and layer.skip == [0, 3] and layer.rows[1].get_seq_length() == 0
    again = layer.update(keys[:, :, 2:], values[:, :, 2:])
    assert all(torch.equal(a.narrow(2, a.shape[2] - 7, 7), b.narrow(2, b.shape[2] - 7, 7))
               for a, b in zip(first, again, strict=True))  # fmt: skip
    layer.crop([-3, -9])
    assert layer.row_lengths() == [6, 0] and layer.skip == [0, 5]
    with pytest.raises(RollbackError, match="QuantizedRows"):
        layer.crop(-7)
    assert layer.row_lengths() == [6, 0]


def test_a_saved_padded_batch_continues_exactly(tmp_path: Path) -> None:
    """A padded batch's cache saved after the prompt and loaded continues with the tokens of an
    uninterrupted run, and a damaged description of its rows is a clear error."""
    model = model_of("sliding", 4)
    ids, mask, _ = padded()
    whole = generate(model, ids, attention_mask=mask, max_new_tokens=NEW, eos_token_id=[])
    first = generate(model, ids, attention_mask=mask, max_new_tokens=1, eos_token_id=[])
    save_cache(first.cache, tmp_path / "c.kvcache")
    loaded = load_cache(tmp_path / "c.kvcache")
    assert isinstance(loaded.layers[0], QuantizedRows) and loaded.layers[0].pads == [0, 9, 21, 16]
    rest = generate(model, first.sequences, attention_mask=torch.cat([mask, torch.ones(4, 1, dtype=torch.long)], 1),
                    max_new_tokens=NEW - 1, eos_token_id=[], cache=loaded)  # fmt: skip
    assert torch.equal(rest.sequences, whole.sequences)
    layer = first.cache.layers[0]
    meta, state = layer.meta_state, layer.state
    bad = [({**meta, "skip": [0, 0, 0, 99]}, state, "still to come"),
           ({**meta, "pads": "0"}, state, "pads"),
           ({**meta, "rows": [{"class": "DynamicLayer", "meta_state": {}}] * 4}, state, "quantized layer class"),
           ({**meta, "record_past": not meta["record_past"]}, state, "record_past"),
           (meta, {**state, "9.keys": state["0.keys"]}, "belong to no row")]
    for broken, tensors, words in bad:
        with pytest.raises(CacheInputError, match=words):
            QuantizedRows.from_state(broken, tensors)


def test_bad_rows_are_clear_errors() -> None:
    row = QuantizedLayer(4, 32)
    with pytest.raises(CacheInputError, match="one padding count"):
        QuantizedRows([row], [0, 1])
    with pytest.raises(CacheInputError, match="batch-1 quantized"):
        QuantizedRows([DynamicCache().layer_factory()], [0])  # type: ignore[list-item]
    with pytest.raises(CacheInputError, match="non-negative"):
        QuantizedRows([row], [-1])
    held = QuantizedLayer(4, 32)
    held.update(torch.randn(1, 1, 3, 8), torch.randn(1, 1, 3, 8))
    with pytest.raises(CacheInputError, match="still to come"):
        QuantizedRows([held], [2], [1])
    with pytest.raises(CacheInputError, match="empty layer"):
        QuantizedRows.padded(held, [0, 2])
    layer = QuantizedRows.padded(row, [0, 2])
    with pytest.raises(CacheInputError, match="batch of 2"):
        layer.update(torch.randn(3, 1, 2, 8), torch.randn(3, 1, 2, 8))
    assert layer.row_lengths() == [0, 0] and layer.skip == [0, 2]


def test_moving_rows_keeps_their_quantized_data_and_scales() -> None:
    """`to(dtype)` casts each row's full-precision tokens only (as `QuantizedLayer.to`), and a bad
    argument changes nothing."""
    layer = QuantizedRows.padded(QuantizedLayer(4, 32, residual=4), [0, 3])
    layer.update(torch.randn(2, 1, 11, 8, dtype=torch.float64), torch.randn(2, 1, 11, 8, dtype=torch.float64))
    before = {k: v.clone() for k, v in layer.state.items()}
    with pytest.raises(CacheInputError):
        layer.to(dtype="float32")  # type: ignore[arg-type]
    assert all(torch.equal(before[k], v) for k, v in layer.state.items())
    assert layer.to(dtype=torch.float32) is layer
    for name, tensor in layer.state.items():
        kind = name.split(".", 1)[1]
        assert tensor.dtype == (torch.float32 if kind in ("keys", "values") else before[name].dtype), name


def test_a_failed_padded_run_leaves_the_cache_as_it_was() -> None:
    """A run that fails is rolled back to what was streamed: a cache it left empty (the streamer
    raised at the first step) holds its own quantized layers again, the very objects, and serves
    the next run; one that streamed two steps keeps them, in rows quantized alone."""
    model = model_of("sliding", 4)
    ids, mask, prompts = padded()
    cache = model.new_cache()
    layers = list(cache.layers)

    class Failing:
        def __init__(self, at: int) -> None:
            self.steps, self.at = 0, at

        def put(self, tokens: torch.Tensor) -> None:
            self.steps += 1
            if self.steps == self.at:
                raise RuntimeError("the client went away")

        def end(self) -> None:
            pass

    def fail(at: int) -> None:
        with pytest.raises(RuntimeError, match="went away"):
            generate(model, ids, attention_mask=mask, max_new_tokens=NEW, eos_token_id=[], cache=cache,
                     streamer=Failing(at), defer_stop=False)  # fmt: skip

    fail(1)
    assert cache.get_seq_length() == 0 and all(a is b for a, b in zip(cache.layers, layers, strict=True))
    out = generate(model, ids, attention_mask=mask, max_new_tokens=NEW, eos_token_id=[], cache=cache)
    assert out.sequences[1, ids.shape[1] :].tolist() == alone(model, prompts[1])[0]
    cache = model.new_cache()
    fail(3)
    assert cache.get_seq_length() == ids.shape[1] + 1 and isinstance(cache.layers[0], QuantizedRows)


@pytest.mark.parametrize("window", [None, 12])
@pytest.mark.parametrize("value_groups", ["channel", "token"])
def test_an_update_returns_each_row_as_its_layer_alone_returns_it(window: int | None, value_groups: str) -> None:
    """A random program (a left-padded prefill, steps of 1-3 tokens, crops while recording, a
    commit): every update's keys and values, row by row, are exactly what the row's own batch-1
    layer returns for the same tokens (`QuantizedLayer.update`, which dequantizes row by row; the
    batch dequantizes all rows in one pass), at the row's slots, and zeros in its padding."""
    gen = torch.Generator().manual_seed(7 if window is None else 8)

    def blank() -> QuantizedLayer:
        if window is None:
            return QuantizedLayer(4, 32, residual=4, value_groups=value_groups)
        return QuantizedSlidingWindowLayer(window, 4, 32, residual=4, value_groups=value_groups)

    pads = [0, 5, 11, 3]
    batch = QuantizedRows.padded(blank(), pads)
    batch.activate_past_recording()
    twins = [blank() for _ in pads]
    for twin in twins:
        twin.activate_past_recording()
    step = 0
    for step in range(40):
        if step and step % 7 == 0:
            n = int(torch.randint(1, 4, (), generator=gen))
            if all(twin.get_seq_length() > n + 8 for twin in twins):
                batch.crop(-n)
                for twin in twins:
                    twin.crop(-n)
                continue
        if step == 25:
            batch.crop(0)
            for twin in twins:
                twin.crop(0)
        query = 16 if step == 0 else int(torch.randint(1, 4, (), generator=gen))
        keys, values = (torch.randn(4, 2, query, 32, generator=gen, dtype=torch.float64) for _ in range(2))
        offset = batch.get_mask_sizes(query)[1]
        ahead = list(batch.skip)
        got_keys, got_values = batch.update(keys, values)
        for b, twin in enumerate(twins):
            skip = min(ahead[b], query)
            visible = twin.get_mask_sizes(query - skip)[1]
            own_keys, own_values = twin.update(keys[b : b + 1, :, skip:], values[b : b + 1, :, skip:])
            slot, n = pads[b] + visible - offset, own_keys.shape[2]
            for got, own in ((got_keys, own_keys), (got_values, own_values)):
                assert torch.equal(got[b, :, slot : slot + n], own[0]), (step, b)
                assert not got[b, :, :slot].any() and not got[b, :, slot + n :].any(), (step, b)
    assert batch.row_lengths() == [pad + twin.get_seq_length() for pad, twin in zip(pads, twins, strict=True)]
