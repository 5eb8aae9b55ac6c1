"""`kvcache.generation.generate`: deferred and immediate stop checks agree exactly (sequences,
scores, streamed tokens, returned caches, continuations) on every reference model kind; results
match a cache-free recomputation; continuing a returned cache equals one long call."""

from __future__ import annotations

import pytest
import torch

from kvcache.generation import TokenCollector, generate
from kvcache.models import (
    DecoderConfig,
    DecoderLM,
    EncoderDecoderConfig,
    EncoderDecoderLM,
    HybridConfig,
    HybridLM,
)

VOCAB = 24


pytestmark = pytest.mark.usefixtures("one_thread")


def _decoder() -> DecoderLM:
    torch.manual_seed(0)
    config = DecoderConfig(vocab_size=VOCAB, layer_types=["full_attention", "sliding_attention"], sliding_window=4)
    return DecoderLM(config).eval()


def _hybrid() -> HybridLM:
    torch.manual_seed(1)
    return HybridLM(HybridConfig(vocab_size=VOCAB, sliding_window=4)).eval()


def _encoder_decoder() -> EncoderDecoderLM:
    torch.manual_seed(2)
    return EncoderDecoderLM(EncoderDecoderConfig(vocab_size=VOCAB, decoder_start_token_id=1, sliding_window=4)).eval()


MODELS = {"decoder": _decoder(), "hybrid": _hybrid(), "encoder_decoder": _encoder_decoder()}


def _prompt(batch: int, length: int = 9, seed: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    """Random ids with rows left-padded to different lengths (row 0 unpadded)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, VOCAB, (batch, length), generator=gen)
    mask = torch.ones(batch, length, dtype=torch.long)
    for row in range(1, batch):
        mask[row, : min(2 * row, length - 1)] = 0
    return ids.masked_fill(mask == 0, 0), mask


def layers_of(cache) -> list:
    if hasattr(cache, "self_attention_cache"):
        parts = [cache.self_attention_cache, cache.cross_attention_cache]
    else:
        parts = [cache]
    return [layer for part in parts for layer in part.layers]


def assert_caches_identical(a, b) -> None:
    """Bitwise: same layer classes, same bookkeeping (incl. recording flags), same tensors."""
    la, lb = layers_of(a), layers_of(b)
    assert [type(x) for x in la] == [type(x) for x in lb]
    for x, y in zip(la, lb, strict=True):
        assert x.meta_state == y.meta_state
        sa, sb = x.state, y.state
        assert sa.keys() == sb.keys()
        for name in sa:
            assert sa[name].dtype == sb[name].dtype and torch.equal(sa[name], sb[name]), name


def _run(model, ids, mask, *, defer, seed=None, **kwargs):
    """One generate call with a counting streamer; returns (output, streamed steps, generator)."""
    streamer = TokenCollector()
    generator = torch.Generator().manual_seed(seed) if seed is not None else None
    kwargs.setdefault("attention_mask", mask)  # the decoder's padding, or the encoder's source padding
    out = generate(model, ids, generator=generator, streamer=streamer, output_scores=True, defer_stop=defer, **kwargs)
    return out, streamer, generator


def _new_tokens(out, prompt_length: int) -> torch.Tensor:
    return out.sequences[:, prompt_length:]


def _eos_ending_every_row(model, ids, mask, steps: list[int], **kwargs) -> list[int]:
    """Eos ids that make every row stop early: row r's own token at step `steps[r]` of a run
    without eos (sampling included: pads do not change the random draws)."""
    out, _, _ = _run(model, ids, mask, defer=False, max_new_tokens=max(steps) + 1, **kwargs)
    prefix = ids.shape[1] if not getattr(model, "is_encoder_decoder", False) else 1
    new = _new_tokens(out, prefix)
    return sorted({int(new[row, step]) for row, step in enumerate(steps)})


SCENARIOS = {
    # name: (batch, generate kwargs, seed, eos steps per row or None)
    "greedy_batch_eos": (3, {}, None, [2, 4, 5]),
    "greedy_single_eos_first_step": (1, {}, None, [0]),
    "sampled_batch_eos": (3, {"do_sample": True, "temperature": 0.8, "top_k": 10, "top_p": 0.9}, 11, [3, 1, 4]),
    "sampled_max_length": (2, {"do_sample": True, "temperature": 1.3}, 12, None),
    "greedy_max_length": (2, {}, None, None),
    "penalized_greedy_batch_eos": (3, {"repetition_penalty": 1.6}, None, [2, 4, 1]),
    "penalized_sampled_max_length": (2, {"do_sample": True, "temperature": 0.9, "repetition_penalty": 1.5}, 13, None),
}


def _continue(model, out, ids, mask, *, defer, seed_state, **kwargs):
    """Generate 4 more tokens on `out.cache`, feeding the whole sequence so far (plus 2 new tokens
    for a decoder), with the generator carried over."""
    generator = None
    if seed_state is not None:
        generator = torch.Generator()
        generator.set_state(seed_state)
    streamer = TokenCollector()
    if getattr(model, "is_encoder_decoder", False):
        more = generate(model, ids, attention_mask=mask, decoder_input_ids=out.sequences, cache=out.cache,
                        max_new_tokens=4, generator=generator, streamer=streamer, output_scores=True,
                        defer_stop=defer, **kwargs)  # fmt: skip
    else:
        extra = torch.full((ids.shape[0], 2), 3, dtype=torch.long)
        seq = torch.cat([out.sequences, extra], dim=1)
        full_mask = torch.cat([mask, torch.ones(ids.shape[0], seq.shape[1] - mask.shape[1], dtype=torch.long)], dim=1)
        more = generate(model, seq, attention_mask=full_mask, cache=out.cache, max_new_tokens=4,
                        generator=generator, streamer=streamer, output_scores=True, defer_stop=defer,
                        **kwargs)  # fmt: skip
    return more, streamer


@pytest.mark.parametrize("scenario", list(SCENARIOS))
@pytest.mark.parametrize("kind", list(MODELS))
def test_deferred_and_immediate_stop_checks_agree_exactly(kind: str, scenario: str) -> None:
    model = MODELS[kind]
    batch, kwargs, seed, eos_steps = SCENARIOS[scenario]
    ids, mask = _prompt(batch)
    max_new = 12
    if eos_steps is not None:
        kwargs = {**kwargs, "eos_token_id": _eos_ending_every_row(model, ids, mask, eos_steps, seed=seed, **kwargs)}
    runs = {}
    for defer in (False, True):
        out, streamer, generator = _run(model, ids, mask, defer=defer, seed=seed, max_new_tokens=max_new, **kwargs)
        runs[defer] = (out, streamer, generator)
    (a, sa, ga), (b, sb, gb) = runs[False], runs[True]
    prefix = 1 if kind == "encoder_decoder" else ids.shape[1]
    generated = a.sequences.shape[1] - prefix
    if eos_steps is not None:
        assert generated <= max(eos_steps) + 1 < max_new  # an early eos stop: the deferred path took an extra step
    else:
        assert generated == max_new
    assert torch.equal(a.sequences, b.sequences)
    assert len(a.scores) == len(b.scores) == generated
    assert all(torch.equal(x, y) for x, y in zip(a.scores, b.scores, strict=True))
    assert sa.steps == sb.steps == _new_tokens(a, prefix).T.tolist()  # never the extra token
    assert sa.ended == sb.ended == 1
    assert_caches_identical(a.cache, b.cache)
    assert a.cache.get_seq_length() == a.sequences.shape[1] - 1  # the cache holds all but the last token
    if seed is not None:
        assert torch.equal(ga.get_state(), gb.get_state())  # the extra step's random draw was undone

    cont = {}
    for defer, (out, _, generator) in runs.items():
        state = generator.get_state() if generator is not None else None
        cont[defer] = _continue(model, out, ids, mask, defer=defer, seed_state=state, **kwargs)
    (ca, csa), (cb, csb) = cont[False], cont[True]
    assert torch.equal(ca.sequences, cb.sequences)
    assert all(torch.equal(x, y) for x, y in zip(ca.scores, cb.scores, strict=True))
    assert csa.steps == csb.steps
    assert_caches_identical(ca.cache, cb.cache)


def _naive_greedy(model, ids, mask, max_new: int, eos: list[int]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Greedy decoding by recomputing the whole sequence without any cache each step."""
    seq, full_mask = ids.clone(), mask.clone()
    unfinished = torch.ones(ids.shape[0], dtype=torch.bool)
    logits_per_step = []
    with torch.no_grad():
        for _ in range(max_new):
            logits = model(seq, attention_mask=full_mask)[:, -1].float()
            logits_per_step.append(logits)
            token = logits.argmax(-1)
            if eos:
                token = torch.where(unfinished, token, torch.tensor(eos[0]))
                unfinished &= ~torch.isin(token, torch.tensor(eos))
            seq = torch.cat([seq, token[:, None]], dim=1)
            full_mask = torch.cat([full_mask, torch.ones_like(full_mask[:, :1])], dim=1)
            if eos and not unfinished.any():
                break
    return seq, logits_per_step


@pytest.mark.parametrize("kind", ["decoder", "hybrid"])
def test_greedy_matches_cache_free_recomputation(kind: str) -> None:
    model = MODELS[kind]
    ids, mask = _prompt(3)
    eos = _eos_ending_every_row(model, ids, mask, [3, 6, 5])
    out = generate(model, ids, attention_mask=mask, max_new_tokens=10, eos_token_id=eos, output_scores=True)
    reference, logits = _naive_greedy(model, ids, mask, 10, eos)
    assert torch.equal(out.sequences, reference)
    assert len(out.scores) == len(logits)
    for got, want in zip(out.scores, logits, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_encoder_decoder_greedy_matches_cache_free_recomputation() -> None:
    model = MODELS["encoder_decoder"]
    ids, mask = _prompt(2)
    out = generate(model, ids, attention_mask=mask, max_new_tokens=8)
    with torch.no_grad():
        encoded = model.encode(ids, mask)
        seq = torch.full((2, 1), model.decoder_start_token_id)
        for _ in range(8):
            logits = model(seq, encoder_hidden_states=encoded, encoder_attention_mask=mask)[:, -1]
            seq = torch.cat([seq, logits.argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(out.sequences, seq)


@pytest.mark.parametrize("kind", list(MODELS))
@pytest.mark.parametrize("sample", [False, True])
def test_continuing_the_returned_cache_equals_one_long_call(kind: str, sample: bool) -> None:
    model = MODELS[kind]
    ids, mask = _prompt(2)
    kwargs = {"do_sample": True, "temperature": 0.9, "top_k": 12} if sample else {}
    enc_dec = kind == "encoder_decoder"
    long = generate(model, ids, attention_mask=mask, max_new_tokens=11,
                    generator=torch.Generator().manual_seed(4), **kwargs)  # fmt: skip
    generator = torch.Generator().manual_seed(4)
    first = generate(model, ids, attention_mask=mask, max_new_tokens=5, generator=generator, **kwargs)
    if enc_dec:
        second = generate(model, ids, attention_mask=mask, decoder_input_ids=first.sequences, cache=first.cache,
                          max_new_tokens=6, generator=generator, **kwargs)  # fmt: skip
    else:
        grown = torch.cat([mask, torch.ones(2, 5, dtype=torch.long)], dim=1)
        second = generate(model, first.sequences, attention_mask=grown, cache=first.cache, max_new_tokens=6,
                          generator=generator, **kwargs)  # fmt: skip
    assert torch.equal(second.sequences, long.sequences)
    assert_caches_identical(second.cache, long.cache)


def test_max_new_tokens_zero_builds_the_prompt_cache_only() -> None:
    model = MODELS["decoder"]
    ids, mask = _prompt(2)
    built = generate(model, ids, attention_mask=mask, max_new_tokens=0, output_scores=True)
    assert torch.equal(built.sequences, ids) and built.scores == ()
    assert built.cache.get_seq_length() == ids.shape[1] - 1
    resumed = generate(model, ids, attention_mask=mask, cache=built.cache, max_new_tokens=7)
    direct = generate(model, ids, attention_mask=mask, max_new_tokens=7)
    assert torch.equal(resumed.sequences, direct.sequences)


def test_finished_rows_produce_pad_and_a_row_stops_at_its_own_eos() -> None:
    model = MODELS["decoder"]
    ids, mask = _prompt(2)
    free = generate(model, ids, attention_mask=mask, max_new_tokens=8).sequences[:, ids.shape[1] :]
    eos = int(free[0, 1])
    out = generate(model, ids, attention_mask=mask, max_new_tokens=8, eos_token_id=eos, pad_token_id=2)
    new = out.sequences[:, ids.shape[1] :]
    row0 = new[0].tolist()
    stop = row0.index(eos)
    assert stop <= 1 and all(t == 2 for t in row0[stop + 1 :])
    for row in range(2):  # until its eos, every row is what it is without eos
        tokens = new[row].tolist()
        end = tokens.index(eos) + 1 if eos in tokens else len(tokens)
        assert tokens[:end] == free[row, :end].tolist()


def test_sampling_with_the_same_seed_repeats_and_another_seed_differs() -> None:
    model = MODELS["decoder"]
    ids, mask = _prompt(2)

    def sample(seed: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(seed)
        return generate(model, ids, attention_mask=mask, max_new_tokens=16, do_sample=True, generator=gen).sequences

    assert torch.equal(sample(7), sample(7))
    assert not torch.equal(sample(7), sample(8))


def test_min_p_one_samples_the_greedy_tokens_and_a_small_min_p_still_samples() -> None:
    """min_p = 1 keeps only the most likely token: sampling then returns greedy decoding's tokens
    at any temperature; a small min_p keeps the draws (another seed, other tokens)."""
    model = MODELS["decoder"]
    ids, mask = _prompt(2)
    greedy = generate(model, ids, attention_mask=mask, max_new_tokens=16).sequences

    def sample(seed: int, min_p: float) -> torch.Tensor:
        gen = torch.Generator().manual_seed(seed)
        return generate(model, ids, attention_mask=mask, max_new_tokens=16, do_sample=True, temperature=1.7,
                        min_p=min_p, generator=gen).sequences  # fmt: skip

    assert torch.equal(sample(7, 1.0), greedy) and torch.equal(sample(8, 1.0), greedy)
    assert not torch.equal(sample(7, 0.01), sample(8, 0.01))


def test_a_recording_cache_keeps_its_history_in_both_paths() -> None:
    """A cache that was recording on entry is not committed: the caller can still crop back into
    (and past) the generated tokens, identically for both stop checks."""
    model = MODELS["hybrid"]
    ids, mask = _prompt(1)
    caches = {}
    for defer in (False, True):
        cache = model.new_cache()
        built = generate(model, ids, cache=cache, max_new_tokens=0)
        built.cache.activate_past_recording()
        eos = _eos_ending_every_row(model, ids, mask, [3])
        out = generate(model, ids, cache=built.cache, max_new_tokens=10, eos_token_id=eos, defer_stop=defer)
        generated = out.sequences.shape[1] - ids.shape[1]
        assert generated < 10  # stopped early at eos: the deferred path took (and undid) an extra step
        caches[defer] = out.cache
    assert_caches_identical(caches[False], caches[True])
    for cache in caches.values():
        assert all(layer.record_past for layer in cache.layers)
        cache.crop(-generated)  # every token fed since activation (prompt's last + generated - 1) can be undone
    assert_caches_identical(caches[False], caches[True])
    assert caches[False].get_seq_length() == ids.shape[1] - 1


def test_the_deferred_path_commits_every_kept_step() -> None:
    """Rollback memory stays at about one step: the sliding layer never keeps more than its window
    plus two recorded tokens while the deferred check runs (without commits it would grow to
    window + max_new_tokens), and the returned cache is not recording."""
    model = MODELS["decoder"]
    ids, _ = _prompt(1, length=12)
    cache = model.new_cache()
    sliding = cache.layers[1]
    kept: list[int] = []

    class Watcher(TokenCollector):
        def put(self, token_ids: torch.Tensor) -> None:
            kept.append(sliding.meta_state["kept_length"])
            super().put(token_ids)

    out = generate(model, ids, cache=cache, max_new_tokens=20, streamer=Watcher(), defer_stop=True)
    assert len(kept) == 20 and max(kept) <= sliding.sliding_window - 1 + 2
    assert not any(layer.record_past for layer in out.cache.layers)
    assert sliding.meta_state["kept_length"] == sliding.sliding_window - 1


@pytest.mark.parametrize("case", range(12))
def test_random_settings_deferred_equals_immediate(case: int) -> None:
    """Random batch sizes, paddings, eos sets, sampling settings and lengths (derandomized)."""
    rng = torch.Generator().manual_seed(100 + case)
    kind = list(MODELS)[case % len(MODELS)]
    model = MODELS[kind]
    batch = int(torch.randint(1, 4, (), generator=rng))
    ids, mask = _prompt(batch, length=int(torch.randint(2, 10, (), generator=rng)), seed=case)
    eos = torch.randperm(VOCAB, generator=rng)[: int(torch.randint(3, 10, (), generator=rng))].tolist()
    sample = bool(case % 2)
    kwargs = {"eos_token_id": eos, "max_new_tokens": int(torch.randint(1, 16, (), generator=rng))}
    if sample:
        kwargs.update(do_sample=True, temperature=float(torch.empty(()).uniform_(0.5, 1.5, generator=rng)),
                      top_k=int(torch.randint(0, 8, (), generator=rng)), top_p=0.95)  # fmt: skip
    seed = case if sample else None
    (a, sa, ga), (b, sb, gb) = (_run(model, ids, mask, defer=d, seed=seed, **kwargs) for d in (False, True))
    assert torch.equal(a.sequences, b.sequences)
    assert all(torch.equal(x, y) for x, y in zip(a.scores, b.scores, strict=True)) and len(a.scores) == len(b.scores)
    assert sa.steps == sb.steps
    assert_caches_identical(a.cache, b.cache)
    if sample:
        assert torch.equal(ga.get_state(), gb.get_state())
