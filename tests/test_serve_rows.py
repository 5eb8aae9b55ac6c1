"""The server's running batch: a join lays the rows out exactly as stacking every row again would.

`rows.join` copies the running rows of a batch of full attention and sliding windows as one
block; `rows.stack(rows.rows_of(...)
+ joining)` takes them apart and stacks them row by row. Both are copies of the same numbers into
the same layout, so they are compared with `torch.equal`, padding and strides included.
"""

from __future__ import annotations

import pytest
import torch

from kvcache.models import DecoderConfig, DecoderLM
from kvcache.serve import rows

pytestmark = pytest.mark.usefixtures("one_thread")


def model_of(layer_types: list[str]) -> DecoderLM:
    torch.manual_seed(0)
    config = DecoderConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_heads=4, num_kv_heads=2,
                           layer_types=layer_types, sliding_window=8)  # fmt: skip
    return DecoderLM(config).eval()


def single(model: DecoderLM, length: int, seed: int) -> list:
    ids = torch.randint(0, 64, (1, length), generator=torch.Generator().manual_seed(seed))
    cache = model.new_cache()
    with torch.no_grad():
        model(ids, cache=cache)
    return rows.single(cache)


def assert_same(a: tuple, b: tuple) -> None:
    (cache_a, pads_a), (cache_b, pads_b) = a, b
    assert pads_a == pads_b
    for layer_a, layer_b in zip(cache_a, cache_b, strict=True):
        assert type(layer_a) is type(layer_b)
        assert layer_a.row_lengths() == layer_b.row_lengths()
        for name, tensor in layer_a.state.items():
            other = layer_b.state[name]
            assert torch.equal(tensor, other) and tensor.stride() == other.stride(), name


@pytest.mark.parametrize(("running", "joining", "leaving"), [
    ((5, 9, 7), (3,), ()),  # a newcomer shorter than the batch
    ((5, 9, 7), (12, 4), ()),  # one longer: every running row moves right
    ((5, 9, 7, 6), (6,), (1,)),  # the longest row left: the columns only it used are dropped
    ((4,), (4, 11), ()),  # one running row
])  # fmt: skip
@pytest.mark.parametrize("layer_types", [["full_attention"] * 2, ["full_attention", "sliding_attention"]])
def test_a_join_equals_stacking_every_row_again(running, joining, leaving, layer_types, monkeypatch) -> None:
    """Window 8: rows shorter and longer than the 7 tokens a window keeps, on either side."""
    model = model_of(layer_types)
    batch, pads = rows.stack([single(model, n, i) for i, n in enumerate(running)])
    if leaving:
        keep = [i for i in range(len(running)) if i not in leaving]
        batch.batch_select_indices(torch.tensor(keep))
        pads = [pads[i] for i in keep]
    newcomers = [single(model, n, 100 + i) for i, n in enumerate(joining)]
    expected = rows.stack(rows.rows_of(batch, pads) + newcomers)
    monkeypatch.setattr(rows, "rows_of", None)  # the block copy, not the row-by-row way
    joined = rows.join(batch, pads, newcomers)
    assert_same(joined, expected)
    assert joined[0].layers[0].state["keys"].data_ptr() != batch.layers[0].state["keys"].data_ptr()  # a new batch
    with torch.no_grad():  # and it decodes on: the new batch holds room for the next token
        joined[0].layers[0].update(*(torch.zeros(len(joined[1]), 2, 1, 8) for _ in range(2)))


def test_batches_the_block_copy_does_not_cover_are_stacked_row_by_row() -> None:
    """Rows that no longer end together (a per-row crop) go the general way."""
    full = model_of(["full_attention"] * 2)
    batch, pads = rows.stack([single(full, n, i) for i, n in enumerate((5, 10))])
    batch.crop([-1, 0])
    assert batch.layers[0].is_ragged
    newcomer = [single(full, 6, 7)]
    assert_same(rows.join(batch, pads, newcomer), rows.stack(rows.rows_of(batch, pads) + newcomer))
