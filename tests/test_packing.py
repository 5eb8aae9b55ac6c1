"""`tokens_per_row`: a forward whose rows feed different numbers of real tokens (a verify forward's
rows with shorter drafts, the right-padded rests of a prefill group) computes the real tokens only
in its linear layers, and its real tokens' logits and the cache a per-row crop leaves are those of
each row fed alone.

The reference is each row alone, one forward without a cache over its prompt and its real tokens
(float64). A packed forward's matmuls run over fewer rows than the rectangle's, and a row alone
over fewer still, so the sums are blocked differently: equal within float64 rounding (1e-10 on
logits of magnitude ~1-10), not bit for bit. The hybrid model, which computes every position
anyway, is compared with its own rectangle forward: the same computation, `torch.equal`.
"""

from __future__ import annotations

import pytest
import torch

from kvcache import CacheInputError
from kvcache.models import DecoderConfig, DecoderLM, HybridConfig, HybridLM
from kvcache.models.packing import Packing

VOCAB = 40
TOLERANCE = 1e-10


@pytest.fixture(autouse=True)
def pack_every_filler(monkeypatch):
    """These batches are small: packed whatever their fillers (the model packs from 24 by default)."""
    monkeypatch.setattr(Packing, "MIN_FILLERS", 1)


def randomize(model: torch.nn.Module) -> torch.nn.Module:
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            scale = 0.1 if name.endswith("norm.weight") else (0.3 if p.dim() > 1 else 0.1)
            p.copy_((1.0 if name.endswith("norm.weight") else 0.0) + scale * torch.randn(p.shape, generator=gen))
    return model.double().eval()


def decoder(kv_bits: int | None = None) -> DecoderLM:
    """Quantized: head_dim 32, one group of 32 channels."""
    config = DecoderConfig(vocab_size=VOCAB, hidden_size=128 if kv_bits else 32, intermediate_size=48,
                           num_heads=4, num_kv_heads=2, layer_types=["full_attention", "sliding_attention"],
                           sliding_window=4)  # fmt: skip
    model = randomize(DecoderLM(config))
    model.kv_bits, model.kv_group_size = kv_bits, 32
    return model


def ids(*rows: list[int]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.long)


PROMPTS = [[3, 9, 4, 17, 5, 30, 2], [11, 6, 8, 1], [7, 22, 13, 5, 19, 2, 36, 4, 10]]
NEW = [[12, 5, 33, 8, 2], [9], [14, 3, 27]]  # each row's real tokens in the second forward
NEXT = [6, 21, 18]  # then one plain step


def prefilled(model: DecoderLM) -> tuple:
    """The three prompts left-padded into one batch cache: `(cache, mask)`."""
    width = max(map(len, PROMPTS))
    pads = [width - len(p) for p in PROMPTS]
    mask = torch.tensor([[0] * pad + [1] * len(p) for pad, p in zip(pads, PROMPTS, strict=True)])
    cache = model.new_cache()
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    model(ids(*[[0] * pad + p for pad, p in zip(pads, PROMPTS, strict=True)]), cache=cache, attention_mask=mask,
          position_ids=positions)  # fmt: skip
    return cache, mask


def decode(model: DecoderLM, packed: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Prefill, one forward of each row's real tokens right-padded to 5 (with `tokens_per_row`
    when `packed`), the fillers cropped per row, one plain step: the two forwards' logits."""
    cache, mask = prefilled(model)
    width = max(map(len, NEW))
    counts = [len(n) for n in NEW]
    lengths = torch.tensor([len(p) for p in PROMPTS])[:, None]
    cache.activate_past_recording()
    wide = ids(*[n + [n[-1]] * (width - len(n)) for n in NEW])  # fillers: the row's last token, as the engine pads
    mask = torch.cat([mask, torch.ones(3, width, dtype=torch.long)], dim=1)
    first = model(wide, cache=cache, attention_mask=mask, position_ids=lengths + torch.arange(width),
                  **({"tokens_per_row": counts} if packed else {}))  # fmt: skip
    cache.crop([-(width - n) for n in counts])
    cache.crop(0)
    step_mask = torch.cat([mask, torch.ones(3, 1, dtype=torch.long)], dim=1)
    after = lengths + torch.tensor(counts)[:, None]
    second = model(ids(*[[t] for t in NEXT]), cache=cache, attention_mask=step_mask, position_ids=after)
    return first, second


def alone(model: DecoderLM, b: int) -> torch.Tensor:
    """Row `b` alone, one forward without a cache: the logits of its new tokens and the next one."""
    sequence = PROMPTS[b] + NEW[b] + [NEXT[b]]
    return model(ids(sequence))[0, len(PROMPTS[b]) - 1 + 1 :]


@pytest.mark.parametrize("kv_bits", [None, 4])
def test_a_packed_forward_gives_each_row_what_it_gives_alone(kv_bits) -> None:
    """Each row's real tokens' logits, and the next step's after the fillers are cropped, equal the
    row alone (a quantized cache: the rectangle forward's, whose fillers are cropped the same way)."""
    model = decoder(kv_bits)
    with torch.no_grad():
        first, second = decode(model, packed=True)
        rectangle = decode(model, packed=False)
        for b, new in enumerate(NEW):
            if kv_bits is None:  # the quantized cache is not the full-precision forward's: compared below
                reference = alone(model, b)
                assert torch.allclose(first[b, : len(new)], reference[: len(new)], atol=TOLERANCE, rtol=0)
                assert torch.allclose(second[b, 0], reference[len(new)], atol=TOLERANCE, rtol=0)
            assert torch.allclose(first[b, : len(new)], rectangle[0][b, : len(new)], atol=TOLERANCE, rtol=0)
            assert torch.allclose(second[b], rectangle[1][b], atol=TOLERANCE, rtol=0)


def test_the_linear_layers_compute_the_real_tokens_only() -> None:
    """What packing is for: the MLP of every layer and the head see 5 + 1 + 3 rows, not 3 x 5."""
    model = decoder()
    seen: list[int] = []
    hooks = [block.mlp.down.register_forward_pre_hook(lambda m, args: seen.append(args[0].numel() // 48))
             for block in model.layers]  # fmt: skip
    try:
        with torch.no_grad():
            decode(model, packed=True)
    finally:
        for hook in hooks:
            hook.remove()
    prefill_rows = 3 * max(map(len, PROMPTS))
    assert seen == [prefill_rows] * 2 + [sum(map(len, NEW))] * 2 + [3] * 2


def test_a_forward_with_few_fillers_is_computed_whole(monkeypatch) -> None:
    """Packing costs a few operations per layer: below `MIN_FILLERS` fillers (24) the rectangle
    is computed; a verify forward of 8 rows where one drafts 4 tokens (28 fillers) is packed."""
    monkeypatch.setattr(Packing, "MIN_FILLERS", 24)
    model = decoder()
    seen: list[int] = []
    hook = model.layers[0].mlp.down.register_forward_pre_hook(lambda m, args: seen.append(args[0].numel() // 48))
    try:
        with torch.no_grad():
            for counts in ([5] + [1] * 7, [5, 2, 1, 3, 5, 1, 1, 2]):  # 28 and 20 fillers
                model(torch.ones(8, 5, dtype=torch.long), cache=model.new_cache(), tokens_per_row=counts)
    finally:
        hook.remove()
    assert seen == [12, 40]


def test_the_hybrid_model_takes_tokens_per_row_and_computes_every_position() -> None:
    """A model whose mixers read every position (`packs_rows = False`) computes the fillers too: its
    forward is the rectangle's, bit for bit."""
    config = HybridConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_heads=4, num_kv_heads=2,
                          layer_types=["linear_attention", "full_attention"])  # fmt: skip
    model = randomize(HybridLM(config))
    outs = []
    with torch.no_grad():
        for extra in ({}, {"tokens_per_row": [4, 1]}):
            cache = model.new_cache()
            model(ids([1, 2, 3], [4, 5, 6]), cache=cache)
            outs.append(model(ids([7, 8, 9, 10], [11, 11, 11, 11]), cache=cache, **extra))
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("bad", [[4, 1, 2], [4, 0], [5, 1], [True, 1], [4.0, 1], "41", torch.tensor([4.0, 1.0]),
                                 torch.tensor([[4, 1]])])  # fmt: skip
def test_bad_tokens_per_row_is_refused_and_changes_nothing(bad) -> None:
    model = decoder()
    cache = model.new_cache()
    with torch.no_grad():
        model(ids([1, 2, 3], [4, 5, 6]), cache=cache)
        before = [t.clone() for layer in cache for t in layer.state.values()]
        with pytest.raises(CacheInputError, match="tokens_per_row"):
            model(ids([7, 8, 9, 10], [11, 11, 11, 11]), cache=cache, tokens_per_row=bad)
    assert cache.get_seq_length() == 3
    assert all(torch.equal(a, b) for a, b in zip(before, [t for layer in cache for t in layer.state.values()],
                                                  strict=True))  # fmt: skip


@pytest.mark.parametrize("keep", [1, 2, 5, 9])
def test_logits_to_keep_on_a_packed_forward(keep) -> None:
    """The last `keep` positions' logits, as the rectangle gives them (all of them past the width)."""
    model = decoder()
    ids5 = ids([1, 2, 3, 4, 5], [6, 7, 7, 7, 7])
    with torch.no_grad():
        whole = model(ids5, cache=model.new_cache())
        kept = model(ids5, cache=model.new_cache(), tokens_per_row=[5, 2], logits_to_keep=keep)
    assert kept.shape == whole[:, -keep:].shape
    assert torch.allclose(kept[0], whole[0, -keep:], atol=TOLERANCE, rtol=0)
    real = [c for c in range(5 - min(keep, 5), 5) if c < 2]  # row 1's real columns among the kept
    assert torch.allclose(kept[1, [c - (5 - min(keep, 5)) for c in real]], whole[1, real], atol=TOLERANCE, rtol=0)
