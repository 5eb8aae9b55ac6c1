"""Quantized caches in everything else a cache does: speculative decoding (batch 1 and 4, per-row
rollback) equal to plain decoding with the same quantized cache, saved files that are smaller and
continue exactly, the prefix store, transformers models (`cache_from_config(kv_bits=)`), the
command line's `--kv-bits`, and bad arguments."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_speculative import VOCAB, make_target
from test_speculative_batch import padded_batch

from kvcache import CacheInputError, DynamicCache, load_cache, save_cache
from kvcache.cache import Cache
from kvcache.generation import PromptLookupDrafter, generate, speculative_generate
from kvcache.layers import QuantizedLayer, QuantizedSlidingWindowLayer
from kvcache.models import load_default_model
from kvcache.store import DirectoryBackend, PrefixStore

pytestmark = pytest.mark.usefixtures("one_thread")


def quantized_target(kind: str, bits: int):
    model = make_target(kind)
    model.kv_bits, model.kv_group_size = bits, 32
    return model


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("kind", ["full", "sliding", "hybrid"])
def test_speculative_decoding_equals_plain_decoding_with_the_same_quantized_cache(kind: str, bits: int) -> None:
    """Batch 1 (the target's cache handed in, cropped inside verify forwards) and a left-padded batch
    of 4 (every row verified together and cropped by its own count): token for token the plain
    greedy decoding with the same kind of quantized cache."""
    model = quantized_target(kind, bits)
    prompt = torch.randint(1, VOCAB, (1, 30), generator=torch.Generator().manual_seed(3))
    plain = generate(model, prompt, max_new_tokens=40)
    spec = speculative_generate(model, PromptLookupDrafter(), prompt, max_new_tokens=40, cache=model.new_cache())
    assert spec.sequences.tolist() == plain.sequences.tolist()
    assert isinstance(spec.cache.layers[0], (QuantizedLayer, type(spec.cache.layers[0])))
    ids, mask = padded_batch(4, 1, False)
    batched = generate(model, ids, attention_mask=mask, max_new_tokens=20).sequences
    drafted = speculative_generate(model, model, ids, attention_mask=mask, max_new_tokens=20, num_draft_tokens=3)
    assert drafted.sequences.tolist() == batched.tolist()


@pytest.mark.parametrize("kind", ["full", "hybrid"])
def test_ragged_rows_of_a_quantized_batch_see_their_own_blocks(kind: str) -> None:
    """A draft that is right only sometimes leaves the rows of a batch at different lengths; a row
    longer than the shortest still sees its own blocks quantized (and a verify forward is cut at
    every row's block boundaries), so the tokens are those of plain batched decoding, k = 1, 3, 5."""
    from test_speculative_batch import RowSteeredDraft, new_tokens

    from kvcache.generation import ModelDrafter

    model = quantized_target(kind, 4)
    ids, mask = padded_batch(4, 2, False)
    plain = new_tokens(generate(model, ids, attention_mask=mask, max_new_tokens=40).sequences, ids.shape[1])
    for k in (1, 3, 5):
        out = speculative_generate(model, ModelDrafter(RowSteeredDraft(model, "sometimes")), ids,
                                   attention_mask=mask, num_draft_tokens=k, max_new_tokens=40)  # fmt: skip
        assert new_tokens(out.sequences, ids.shape[1]) == plain, k


@pytest.mark.parametrize("kind", ["full", "hybrid"])
def test_what_padding_holds_does_not_reach_a_quantized_row(kind: str) -> None:
    """Padding shares key blocks with a left-padded row's first tokens: whatever the padding slots
    hold (here other token ids), the real rows' logits are bitwise the same, so a padding slot
    cannot move a block's scales."""
    model = quantized_target(kind, 4)
    ids, mask = padded_batch(4, 1, False)
    other = torch.where(mask.bool(), ids, torch.full_like(ids, 7))
    out = [generate(model, x, attention_mask=mask, max_new_tokens=24, output_scores=True).scores for x in (ids, other)]
    assert all(torch.equal(a, b) for a, b in zip(*out, strict=True))


def test_a_saved_quantized_cache_is_smaller_and_continues_exactly(tmp_path: Path) -> None:
    model, tokenizer = load_default_model()
    ids = torch.tensor([tokenizer.encode("The value of the sequence pattern is the same as the container " * 8)])
    sizes = {}
    for bits in (None, 8, 4):
        out = generate(model, ids, max_new_tokens=10, cache=model.new_cache(kv_bits=bits))
        path = tmp_path / f"{bits}.safetensors"
        save_cache(out.cache, path)
        sizes[bits] = path.stat().st_size
        whole = generate(model, ids, max_new_tokens=30, cache=model.new_cache(kv_bits=bits), output_scores=True)
        rest = generate(model, out.sequences, cache=load_cache(path), max_new_tokens=20, output_scores=True)
        assert torch.equal(rest.sequences, whole.sequences)
        assert all(torch.equal(a, b) for a, b in zip(rest.scores, whole.scores[10:], strict=True))
    # the full layers shrink by 3.6x (int8) and 6.4x (int4) against float32; the sliding ones hold
    # a window of 31 tokens, kept in full precision (it is shorter than two residuals)
    assert sizes[None] / sizes[8] > 1.5 and sizes[None] / sizes[4] > 1.7 and sizes[8] > sizes[4]


@pytest.mark.parametrize("bits", [8, 4])
def test_the_prefix_store_keeps_quantized_chunks_and_hits_exactly(tmp_path: Path, bits: int) -> None:
    """Memory and directory stores: a hit continues bit for bit as the run that stored it, and a
    chat's next turn reuses the chunks decoding stored."""
    model = quantized_target("full", bits)
    prompt = torch.randint(1, VOCAB, (1, 45), generator=torch.Generator().manual_seed(9))
    for store in (PrefixStore(chunk_size=8), PrefixStore(chunk_size=8, backend=DirectoryBackend(tmp_path / "d"))):
        cold = generate(model, prompt, max_new_tokens=20, output_scores=True, prefix_store=store)
        hit = generate(model, prompt, max_new_tokens=20, output_scores=True, prefix_store=store)
        assert store.stats.tokens_reused == 40 and store.stats.dropped == 0
        assert all(torch.equal(a, b) for a, b in zip(hit.scores, cold.scores, strict=True))
        turn = torch.cat([hit.sequences, torch.tensor([[1, 2, 3]])], dim=1)
        generate(model, turn, max_new_tokens=4, prefix_store=store)
        assert store.stats.tokens_reused == 40 + 64


def test_transformers_models_take_quantized_caches() -> None:
    """`cache_from_config(kv_bits=8)` for a Llama (full attention) and a Gemma3 (sliding layers too):
    the logits stay within quantization error of transformers' own, and rollback works through
    transformers' forward."""
    pytest.importorskip("transformers", minversion="5.24")
    from test_transformers_models import Stepper, hf_cache, prompt, tiny_model

    from kvcache.integrations.transformers import cache_from_config, wrap_model

    for kind, kinds in (("llama", {QuantizedLayer}), ("gemma3", {QuantizedLayer, QuantizedSlidingWindowLayer})):
        model, source = tiny_model(kind), prompt(length=40)
        cache = cache_from_config(model.config, kv_bits=8, group_size=32)
        assert {type(layer) for layer in cache} == kinds
        ours, theirs = Stepper(model, cache, source), Stepper(model, hf_cache(model), source)
        ours(source)
        theirs(source)
        ours.cache.activate_past_recording()
        step = torch.randint(3, 128, (2, 3), generator=torch.Generator().manual_seed(1))
        ours(step)
        ours.cache.crop(-3)
        for i in range(4):
            token = step[:, i % 3 : i % 3 + 1]
            torch.testing.assert_close(ours(token), theirs(token), atol=0.05, rtol=0)
        wrapped = wrap_model(model, kv_bits=4)
        assert all(type(layer) in kinds for layer in wrapped.new_cache())


def _one_forward_against_steps(model, cache_of, ids: torch.Tensor, monkeypatch=None) -> float:
    """The largest logit difference between `ids` fed in one forward and one token at a time."""
    whole = model(ids, cache=cache_of())
    cache = cache_of()
    steps = torch.cat([model(ids[:, i : i + 1], cache=cache) for i in range(ids.shape[1])], dim=1)
    return (whole - steps).abs().max().item()


def _int4_model(kind: str):
    """The bundled model ("decoder") or a tiny transformers Llama ("transformers"), float64, with
    int4 caches: the model, a maker of its caches, and its vocabulary size."""
    if kind == "decoder":
        model = load_default_model(dtype=torch.float64)[0]
        model.kv_bits = 4
        return model, model.new_cache, model.vocab_size
    pytest.importorskip("transformers", minversion="5.24")
    from test_transformers_models import tiny_model

    from kvcache.integrations.transformers import cache_from_config, wrap_model

    model = wrap_model(tiny_model("llama").double())
    return model, (lambda: cache_from_config(model.config, kv_bits=4)), 128


@pytest.mark.parametrize("kind", ["decoder", "transformers"])
def test_a_forward_sees_what_single_steps_see_quantized(kind: str, monkeypatch) -> None:
    """A forward into a quantized cache is computed in pieces that never cross a block boundary
    (`Cache.forward_segments`), so its logits are a recomputation of one-token steps (float64: the
    same values up to the reduction order of batched matmuls), however the prompt is grouped. Without
    the pieces, the queries after a boundary would see the block before it in full precision where
    a step sees it quantized: a difference of the size of the quantization error."""
    model, cache_of, vocab = _int4_model(kind)
    ids = torch.randint(3, vocab, (1, 50), generator=torch.Generator().manual_seed(2))
    assert cache_of().forward_segments(50) == [16, 16, 16, 2]
    for bad in (-1, 1.5, "3"):
        with pytest.raises(CacheInputError):
            cache_of().forward_segments(bad)
    assert _one_forward_against_steps(model, cache_of, ids) < 1e-9
    monkeypatch.setattr(Cache, "forward_segments", lambda self, length: [length])
    assert _one_forward_against_steps(model, cache_of, ids) > 1e-4


@pytest.mark.parametrize("kind", ["decoder", "transformers"])
def test_logits_to_keep_over_pieces_returns_the_tail(kind: str) -> None:
    """A forward cut in pieces (`Cache.forward_segments`) with `logits_to_keep=k` returns the last
    k positions' logits, however many pieces they span, and fills the cache as a forward without it
    (a next step's logits are equal). Float64: the head over fewer rows sums alike to 1e-12."""
    model, cache_of, vocab = _int4_model(kind)
    ids = torch.randint(3, vocab, (1, 50), generator=torch.Generator().manual_seed(3))
    step = torch.tensor([[5]])
    with torch.no_grad():
        full_cache = cache_of()
        full = model(ids, cache=full_cache)
        after_full = model(step, cache=full_cache)
        for keep in (1, 2, 17, 34, 50):
            cache = cache_of()
            kept = model(ids, cache=cache, logits_to_keep=keep)
            assert kept.shape == (1, keep, vocab)
            assert torch.allclose(kept, full[:, -keep:], rtol=0, atol=1e-12), keep
            assert torch.equal(model(step, cache=cache), after_full), keep
        fresh = cache_of()
        with pytest.raises(CacheInputError, match="logits_to_keep"):
            model(ids, cache=fresh, logits_to_keep=-2)
        assert fresh.get_seq_length() == 0


def test_the_command_line_quantizes_with_kv_bits(tmp_path: Path) -> None:
    def run(*args: str) -> str:
        argv = [sys.executable, "-m", "kvcache", "generate", "The value of the ", "--temperature", "0",
                "--max-new-tokens", "30", *args]  # fmt: skip
        done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        return done.stdout

    saved = tmp_path / "p.safetensors"
    run("--kv-bits", "4", "--max-new-tokens", "0", "--save-cache", str(saved))
    assert run("--kv-bits", "4", "--cache", str(saved)) == run("--kv-bits", "4")
    assert load_cache(saved).layers[0].bits == 4


def test_bad_quantization_arguments_are_clear_errors() -> None:
    for kwargs in ({"kv_bits": 3}, {"kv_bits": 8, "group_size": 48}, {"kv_bits": True}):
        with pytest.raises(CacheInputError):
            DynamicCache(["full_attention"], **kwargs)
    lazy = DynamicCache(kv_bits=4)
    lazy.update(torch.randn(1, 2, 5, 64), torch.randn(1, 2, 5, 64), 1)
    assert [type(layer) for layer in lazy] == [QuantizedLayer, QuantizedLayer] and lazy.layers[0].bits == 4
    with pytest.raises(CacheInputError, match="multiple"):
        QuantizedLayer(8, 64).update(torch.randn(1, 2, 3, 96), torch.randn(1, 2, 3, 96))


@pytest.mark.parametrize("groups", [("channel", "channel"), ("channel", "token"), ("token", "token")])
@pytest.mark.parametrize("kind", ["full", "sliding"])
def test_a_forward_across_blocks_at_once_computes_what_one_forward_per_block_computes(kind: str, groups, monkeypatch):
    """One row into a quantized cache: a forward spanning several blocks is computed at once (each
    quantized layer's `update_blocks`, `blocks_bias`: every query sees the blocks before its own
    dequantized and its own block in full precision) instead of one forward per block. Float64,
    prompts split anywhere, while recording (a verify forward) and after a crop: the logits agree
    to 1e-12 (the reduction order of wider matmuls), the codes the layers hold are equal, and no
    forward is cut in pieces (a window of 4 tokens, narrower than a block, included)."""
    model = make_target(kind).double()
    key_groups, value_groups = groups
    window = 4 if kind == "sliding" else None

    def new_cache() -> Cache:
        groups = {"key_groups": key_groups, "value_groups": value_groups}
        if window:
            return Cache([QuantizedSlidingWindowLayer(window, 4, 32, **groups) for _ in range(2)])
        return Cache([QuantizedLayer(4, 32, **groups) for _ in range(2)])

    ids = torch.randint(3, VOCAB, (1, 120), generator=torch.Generator().manual_seed(4)).tolist()[0]

    def run(split: list[int]) -> tuple[torch.Tensor, Cache]:
        cache, start, out = new_cache(), 0, []
        with torch.no_grad():
            for i, n in enumerate(split):
                if i == len(split) - 1:  # the last forward is recorded, then cropped back: a verify forward
                    cache.activate_past_recording()
                out.append(model(torch.tensor([ids[start : start + n]]), cache=cache,
                                 position_ids=torch.arange(start, start + n)[None]))  # fmt: skip
                start += n
            cache.crop(-7)
            cache.crop(0)
            out.append(model(torch.tensor([[ids[0]]]), cache=cache, position_ids=torch.tensor([[start - 7]])))
        return torch.cat(out, 1), cache

    import kvcache.models.decoder as decoder

    for split in ([120], [5, 60, 55], [16, 33, 1, 70], [40, 40, 40]):
        model.blocks_at_once = False
        by_blocks, blocks_cache = run(split)
        model.blocks_at_once = True
        with monkeypatch.context() as patch:
            patch.setattr(decoder, "in_pieces", lambda *a, **k: pytest.fail("a forward was cut in pieces"))
            at_once, once_cache = run(split)
        assert torch.allclose(at_once, by_blocks, rtol=0, atol=1e-12), split
        for ours, theirs in zip(once_cache.layers, blocks_cache.layers, strict=True):
            assert ours.state.keys() == theirs.state.keys()
            assert all(torch.equal(ours.state[name], theirs.state[name]) for name in ours.state), split


def test_update_blocks_takes_one_row_and_changes_nothing_otherwise() -> None:
    layer = QuantizedLayer(4, 32)
    layer.update(torch.randn(2, 1, 20, 8), torch.randn(2, 1, 20, 8))
    before = {name: t.clone() for name, t in layer.state.items()}
    with pytest.raises(CacheInputError, match="one row"):
        layer.update_blocks(torch.randn(2, 1, 5, 8), torch.randn(2, 1, 5, 8))
    assert all(torch.equal(layer.state[name], t) for name, t in before.items())
    assert not Cache([layer]).in_one_forward(2, None)
