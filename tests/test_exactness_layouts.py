"""Nothing incidental changes the computation a model sees: a cache that was loaded, copied,
batch-indexed, committed or regrown continues *bitwise* like the original, under 1 and 2 torch
threads. These runs do the same computation (same kernels, shapes and layouts), so the claim is
`torch.equal`. The layout of what the layers hand out is checked to be the same too, since a kernel
may take another path (and other bits) for another layout: the shape, the strides inside each
(batch, head) block `[seq, head_dim]`, and block strides in whole multiples of 64 bytes (every block
starts at the alignment of the first). Where the blocks start (the batch and head strides) follows
the storage's capacity; attention reads each block on its own, which the bitwise comparisons of the
logits check.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from test_models import decoder, tokens
from test_models_hybrid import hybrid

from kvcache import load_cache, save_cache

MODELS: dict[str, Callable[[], Any]] = {
    "decoder": lambda: decoder(("full_attention", "sliding_attention", "full_attention"), window=8),
    "hybrid": hybrid,
}


@pytest.fixture(params=[1, 2], ids=["1thread", "2threads"])
def threads(request: pytest.FixtureRequest):
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


def layouts(cache: Any) -> list:
    """The layout of every tensor each attention layer would hand to attention now: its shape, the
    strides inside a (batch, head) block, and whether the blocks lie whole multiples of 64 bytes apart."""
    out = []
    for layer in cache.layers:
        for part in (layer, getattr(layer, "attention", None)):
            if part is not None and part.has_attention and getattr(part, "keys", None) is not None:
                for t in (part.keys, part.values):
                    aligned = all(s * t.element_size() % 64 == 0 for s in t.stride()[:2])
                    out.append((tuple(t.shape), t.stride()[2:], aligned))
    return out


def decode(model: Any, cache: Any, first: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """Greedy decode `steps` tokens from `first`; the logits of each step."""
    logits, token = [], first
    with torch.no_grad():
        for _ in range(steps):
            step = model(token, cache=cache)
            logits.append(step)
            token = step[:, -1:].argmax(-1)
    return logits


FORKS: dict[str, Callable[[Any, Path], Any]] = {
    "load": lambda cache, tmp: (save_cache(cache, tmp / "c.safetensors"), load_cache(tmp / "c.safetensors"))[1],
    "copy": lambda cache, tmp: cache.copy(),
    "batch_select_all_rows": lambda cache, tmp: _selected(cache.copy()),
}


def _selected(cache: Any) -> Any:
    cache.batch_select_indices(torch.arange(cache.batch_size))
    return cache


@pytest.mark.parametrize("fork", sorted(FORKS))
@pytest.mark.parametrize("decoded", [0, 40], ids=["before regrowth", "after regrowth"])
@pytest.mark.parametrize("prefill", [64, 100])  # 64: a power-of-two prefill
@pytest.mark.parametrize("kind", sorted(MODELS))
def test_forked_cache_continues_bitwise(kind: str, prefill: int, decoded: int, fork: str, threads: int,
                                        tmp_path: Path) -> None:  # fmt: skip
    model = MODELS[kind]()
    ids = tokens(2, prefill + decoded + 1, seed=3)
    original = model.new_cache()
    with torch.no_grad():
        model(ids[:, :prefill], cache=original)
        for i in range(prefill, prefill + decoded):  # 40 steps: past a regrowth of the storage
            model(ids[:, i : i + 1], cache=original)
    forked = FORKS[fork](original, tmp_path)
    assert layouts(forked) == layouts(original)
    nxt = ids[:, -1:]
    want, got = decode(model, original, nxt, 30), decode(model, forked, nxt, 30)
    for step, (a, b) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(a, b), f"{kind} {fork}: step {step}"
    assert layouts(forked) == layouts(original)


@pytest.mark.parametrize("kind", sorted(MODELS))
def test_commit_and_recording_do_not_change_the_computation(kind: str, threads: int) -> None:
    """A cache that recorded, was cropped and committed (its storage shrunk) continues like one that
    never recorded; so does one saved before and loaded after a regrowth."""
    model = MODELS[kind]()
    ids = tokens(1, 300, seed=5)
    plain, detoured = model.new_cache(), model.new_cache()
    with torch.no_grad():
        model(ids[:, :200], cache=plain)
        model(ids[:, :200], cache=detoured)
        detoured.activate_past_recording()
        for i in range(200, 260):  # 60 single steps, then undone
            model(ids[:, i : i + 1], cache=detoured)
        detoured.crop(-60)
        detoured.crop(0)
    assert layouts(detoured) == layouts(plain)
    want, got = decode(model, plain, ids[:, 200:201], 20), decode(model, detoured, ids[:, 200:201], 20)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
