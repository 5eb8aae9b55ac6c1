"""Speculative decoding (`kvcache.generation.speculative`): greedy output and caches identical to
plain greedy decoding for every reference model kind, k and draft quality; the sampling rule's
output distribution against the exact target distribution; the prompt-lookup drafter; errors."""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st
from test_prefill_blocks import Recording

from kvcache import Cache, DynamicLayer, GenerationError
from kvcache.generation import (
    Draft,
    Drafter,
    ModelDrafter,
    PromptLookupDrafter,
    generate,
    speculative_generate,
)
from kvcache.generation.speculative_runner import POSITION_BLOCK, ModelRunner
from kvcache.layers.recurrent import RecurrentLayer
from kvcache.models.decoder import DecoderConfig, DecoderLM
from kvcache.models.encoder_decoder import EncoderDecoderConfig, EncoderDecoderLM
from kvcache.models.hybrid import HybridConfig, HybridLM

VOCAB = 24
NEW_TOKENS = 20


pytestmark = pytest.mark.usefixtures("one_thread")


# ------------------------------------------------------------------------------------ models
def _sharpen(model: torch.nn.Module) -> torch.nn.Module:
    """float64 and larger weights: peaked logits, so greedy never hinges on a near-tie."""
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.mul_(12)
    return model.double().eval()


def make_target(kind: str, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    small = {"vocab_size": VOCAB, "hidden_size": 16, "intermediate_size": 32, "num_heads": 2, "num_kv_heads": 1}
    if kind == "full":
        return _sharpen(DecoderLM(DecoderConfig(**small, layer_types=["full_attention"] * 2)))
    if kind == "sliding":  # window 4, far shorter than the text: rollback must bring evicted tokens back
        return _sharpen(DecoderLM(DecoderConfig(**small, layer_types=["sliding_attention"] * 2, sliding_window=4)))
    if kind.startswith("hybrid"):
        config = HybridConfig(**small, recurrent_heads=1, recurrent_key_dim=8, recurrent_value_dim=8, sliding_window=4)
        return _sharpen(HybridLM(config))
    if kind == "encoder_decoder":
        return _sharpen(EncoderDecoderLM(EncoderDecoderConfig(**small, encoder_layers=1, sliding_window=4)))
    raise AssertionError(kind)


class SteeredDraft:
    """A copy of the target whose greedy choice is moved off the target's at chosen positions:
    "always" agrees with the target, "never" disagrees everywhere, "sometimes" at every third
    position. Its cache is a real cache of the target's kind, so draft rollback is exercised."""

    def __init__(self, target: torch.nn.Module, agree: str) -> None:
        self.model = copy.deepcopy(target)
        self.agree = agree
        self.vocab_size = target.vocab_size
        self.is_encoder_decoder = getattr(target, "is_encoder_decoder", False)
        if self.is_encoder_decoder:
            self.decoder_start_token_id = target.decoder_start_token_id
            self.encode = self.model.encode
        self.new_cache = self.model.new_cache

    def __call__(self, input_ids: torch.Tensor, **kwargs) -> torch.Tensor:
        logits = self.model(input_ids, **kwargs)
        if self.agree == "always":
            return logits
        shifted = logits.roll(1, dims=-1)  # argmax moves to argmax + 1: never the target's token
        if self.agree == "never":
            return shifted
        move = (kwargs["position_ids"] % 3 == 0)[..., None]
        return torch.where(move, shifted, logits)


def plain_greedy(model, input_ids: torch.Tensor, new_tokens: int, eos: int | None = None):
    """The target's own greedy decoding, one token per forward; the cache ends holding all tokens
    but the last (like generation does)."""
    cache = model.new_cache()
    kwargs = {}
    if getattr(model, "is_encoder_decoder", False):
        kwargs["encoder_hidden_states"] = model.encode(input_ids)
        sequence = [model.decoder_start_token_id]
    else:
        sequence = input_ids[0].tolist()
    with torch.no_grad():
        logits = model(torch.tensor([sequence]), cache=cache, **kwargs)[0, -1]
        for i in range(new_tokens):
            token = int(logits.float().argmax())
            sequence.append(token)
            if token == eos or i + 1 == new_tokens:
                break
            logits = model(torch.tensor([[token]]), cache=cache, **kwargs)[0, -1]
    return sequence, cache


def prefilled_cache(model, input_ids: torch.Tensor, tokens: list[int]):
    """A fresh cache of `model` fed `tokens` in one forward."""
    cache = model.new_cache()
    kwargs = {"encoder_hidden_states": model.encode(input_ids)} if getattr(model, "is_encoder_decoder", False) else {}
    with torch.no_grad():
        model(torch.tensor([tokens]), cache=cache, **kwargs)
    return cache


def _layers(cache) -> list:
    if hasattr(cache, "self_attention_cache"):
        return list(cache.self_attention_cache) + list(cache.cross_attention_cache)
    return list(cache)


def assert_same_cache(actual, expected) -> None:
    """Same layers, same token counts, same held tensors, and no rollback history left over (the
    speculative caches are committed). Tensors are compared up to round-off, because verifying k
    tokens in one forward rounds differently than k single-token forwards (the reference models'
    RMSNorm computes in float32 even for float64 weights)."""
    got, want = _layers(actual), _layers(expected)
    assert [type(layer) for layer in got] == [type(layer) for layer in want]
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        if a.has_attention:
            assert a.get_seq_length() == b.get_seq_length(), f"layer {i}"
        sa, sb = a.state, b.state
        assert sorted(sa) == sorted(sb), f"layer {i}: {sorted(sa)} vs {sorted(sb)}"
        for name in sa:
            torch.testing.assert_close(sa[name], sb[name], rtol=1e-5, atol=1e-5, msg=f"layer {i} {name}")


# --------------------------------------------------------------------------- greedy identity
KINDS = ["full", "sliding", "hybrid", "hybrid_refeed", "encoder_decoder"]


@pytest.fixture(scope="module")
def targets():
    return {kind: make_target(kind) for kind in KINDS}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("agree", ["always", "never", "sometimes"])
@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_greedy_output_and_caches_equal_plain_decoding(targets, kind, agree, k):
    target = targets[kind]
    torch.manual_seed(7)
    prompt = torch.randint(1, VOCAB, (1, 6))
    expected, expected_cache = plain_greedy(target, prompt, NEW_TOKENS)
    drafter = ModelDrafter(SteeredDraft(target, agree))
    out = speculative_generate(
        target,
        drafter,
        prompt,
        num_draft_tokens=k,
        max_new_tokens=NEW_TOKENS,
        intermediate_states=False if kind == "hybrid_refeed" else None,
        draft_schedule="acceptance",  # the step counts below assume it (the default also times steps)
    )
    assert out.sequences[0].tolist() == expected
    assert_same_cache(out.cache, expected_cache)
    # The draft cache holds exactly the tokens it says, as one prefill of them would.
    assert out.draft_cache is drafter.cache
    held = drafter.cached_tokens
    assert held == expected[: len(held)] and len(held) >= len(expected) - 3
    assert_same_cache(out.draft_cache, prefilled_cache(drafter.model.model, prompt, held))

    assert not out.draft_rollback_paths["refeed"]  # the draft only ever crops to its step boundaries

    proposed, accepted = out.proposed_per_step, out.accepted_per_step
    assert out.num_new_tokens == NEW_TOKENS
    # One target forward per step: a rejection the cache cannot crop is re-fed in front of the next
    # step's forward, and a re-feed still pending at the end costs one last forward.
    assert len(proposed) <= out.target_forwards <= len(proposed) + (kind == "hybrid_refeed")
    assert all(0 <= a <= p <= k for a, p in zip(accepted, proposed, strict=True))
    if agree == "always":
        assert accepted == proposed
        assert len(proposed) == -(-NEW_TOKENS // (k + 1))  # k + 1 tokens per target forward
    elif agree == "never":
        assert not any(accepted) and len(proposed) == NEW_TOKENS
    else:
        assert any(a < p for a, p in zip(accepted, proposed, strict=True))
        if k > 1:
            assert any(a > 0 for a in accepted)
    partial = any(a < p for a, p in zip(accepted, proposed, strict=True))
    if kind == "hybrid_refeed":
        assert out.rollback_path == ("refeed" if partial else "none")
    elif partial:
        assert out.rollback_path == "crop" and not out.target_rollback_paths["refeed"]


@pytest.mark.parametrize("agree", ["never", "sometimes", "always"])
@pytest.mark.parametrize("schedule", ["acceptance", "constant"])
def test_without_intermediate_states_target_forwards_are_those_of_the_crop_path(targets, agree, schedule):
    """A recurrent target that hands no intermediate states (rollback by re-feeding) needs no more
    target forwards per token than the same target cropping in place, within 10% (plus the one
    forward a re-feed pending at the end costs). Schedules that do not time steps: the default one
    may stop drafting in one run and not the other (here the draft model is the target itself, so
    drafting hardly pays), which says nothing about rollback."""
    target = targets["hybrid"]
    prompt = torch.randint(1, VOCAB, (1, 6), generator=torch.Generator().manual_seed(3))
    runs = {
        mode: speculative_generate(
            target, ModelDrafter(SteeredDraft(target, agree)), prompt, num_draft_tokens=4,
            max_new_tokens=40, intermediate_states=mode, draft_schedule=schedule,
        )
        for mode in (True, False)
    }
    assert runs[True].sequences.tolist() == runs[False].sequences.tolist()
    assert runs[False].target_forwards <= 1.1 * runs[True].target_forwards + 1
    if agree != "always":
        assert runs[False].target_rollback_paths["refeed"] and not runs[True].target_rollback_paths["refeed"]


def test_acceptance_schedule_shrinks_drafts_that_fail_and_keeps_those_that_pass(targets):
    target = targets["full"]
    prompt = torch.randint(1, VOCAB, (1, 6), generator=torch.Generator().manual_seed(4))
    never = speculative_generate(target, ModelDrafter(SteeredDraft(target, "never")), prompt,
                                 num_draft_tokens=6, max_new_tokens=20, draft_schedule="acceptance")  # fmt: skip
    assert never.proposed_per_step[:6] == [6, 5, 4, 3, 2, 1] and set(never.proposed_per_step[6:-1]) == {1}
    always = speculative_generate(target, ModelDrafter(SteeredDraft(target, "always")), prompt,
                                  num_draft_tokens=6, max_new_tokens=20, draft_schedule="acceptance")  # fmt: skip
    assert always.proposed_per_step[:2] == [6, 6] and always.accepted_per_step == always.proposed_per_step
    constant = speculative_generate(target, ModelDrafter(SteeredDraft(target, "never")), prompt,
                                    num_draft_tokens=6, max_new_tokens=20, draft_schedule="constant")  # fmt: skip
    assert set(constant.proposed_per_step[:-6]) == {6}  # the last steps draft less: max_new_tokens
    timed = speculative_generate(target, ModelDrafter(SteeredDraft(target, "never")), prompt,
                                 num_draft_tokens=6, max_new_tokens=20)  # fmt: skip  (the default: timed)
    assert timed.proposed_per_step[1] == 0  # one plain step early on, to compare drafting against
    assert never.sequences.tolist() == always.sequences.tolist() == constant.sequences.tolist()
    assert timed.sequences.tolist() == never.sequences.tolist()
    with pytest.raises(GenerationError, match="draft_schedule"):
        speculative_generate(target, PromptLookupDrafter(), prompt, max_new_tokens=2, draft_schedule="fast")


@pytest.mark.parametrize("kind", ["full", "sliding", "hybrid", "encoder_decoder"])
def test_matches_the_package_generate(targets, kind):
    """The reference for "the target's own greedy decoding" is also `kvcache.generation.generate`."""
    target = targets[kind]
    prompt = torch.tensor([[2, 11, 4, 19, 8]])
    plain = generate(target, prompt, max_new_tokens=NEW_TOKENS)
    out = speculative_generate(
        target, SteeredDraft(target, "sometimes"), prompt, num_draft_tokens=3, max_new_tokens=NEW_TOKENS
    )
    assert torch.equal(out.sequences, plain.sequences)
    assert_same_cache(out.cache, plain.cache)


@pytest.mark.parametrize("kind", ["sliding", "hybrid", "encoder_decoder"])
def test_default_schedule_takes_the_first_token_from_the_prefill_as_generate_does(targets, kind):
    """The timed schedule measures a plain step before it drafts, so its prefill feeds the whole
    prompt and the first token costs no forward of its own: the same forward `generate` runs, so a
    one-token run leaves the very tensors `generate` leaves (bitwise: same kernels, same shapes)."""
    target = targets[kind]
    prompt = torch.tensor([[2, 11, 4, 19, 8, 3]])
    plain = generate(target, prompt, max_new_tokens=1)
    out = speculative_generate(target, PromptLookupDrafter(), prompt, max_new_tokens=1)
    assert torch.equal(out.sequences, plain.sequences)
    assert out.target_forwards == 0 and out.emitted_per_step == [1] and out.proposed_per_step == [0]
    for got, want in zip(_layers(out.cache), _layers(plain.cache), strict=True):
        assert sorted(got.state) == sorted(want.state)
        assert all(torch.equal(got.state[name], want.state[name]) for name in got.state)
    timed = speculative_generate(target, PromptLookupDrafter(), prompt, max_new_tokens=6)
    constant = speculative_generate(target, PromptLookupDrafter(), prompt, max_new_tokens=6, draft_schedule="constant")
    # one forward per step but the first (the constant schedule's first step feeds the prompt's last token)
    assert timed.target_forwards == len(timed.emitted_per_step) - 1
    assert constant.target_forwards == len(constant.emitted_per_step)
    assert torch.equal(timed.sequences, constant.sequences)


@pytest.mark.parametrize("schedule", ["adaptive", "constant"])
def test_the_prompt_forward_computes_the_head_on_one_position(targets, schedule):
    """The prompt's forward asks for its last position's logits only (`logits_to_keep=1`: the
    adaptive schedule takes the first token from it, the constant one none); verify forwards ask
    for every position. The tokens are `generate`'s."""
    target = Recording(targets["sliding"])
    prompt = torch.tensor([[2, 11, 4, 19, 8, 3, 2, 11, 4]])
    plain = generate(targets["sliding"], prompt, max_new_tokens=8)
    out = speculative_generate(target, PromptLookupDrafter(), prompt, num_draft_tokens=3, max_new_tokens=8,
                               draft_schedule=schedule)  # fmt: skip
    assert torch.equal(out.sequences, plain.sequences)
    fed = prompt.shape[1] - (schedule == "constant")  # the constant schedule feeds the last token with its draft
    assert target.asked[0] == (fed, 1)
    assert len(target.asked) > 1 and all(keep == 0 for _, keep in target.asked[1:])


def test_a_batch_prompt_forward_computes_the_head_on_one_position(targets):
    """Batched speculation's prompt forward (rows left-padded) asks for one position too; the rows'
    tokens are each prompt's own greedy decoding."""
    target = Recording(targets["sliding"])
    prompts = [[2, 11, 4, 19, 8, 3, 2, 11, 4], [5, 6, 7, 5, 6]]
    out = speculative_generate(target, PromptLookupDrafter(), torch.tensor([prompts[0], [0] * 4 + prompts[1]]),
                               attention_mask=torch.tensor([[1] * 9, [0] * 4 + [1] * 5]), num_draft_tokens=3,
                               max_new_tokens=8)  # fmt: skip
    for row, prompt in zip(out.sequences.tolist(), prompts, strict=True):
        alone = generate(targets["sliding"], torch.tensor([prompt]), max_new_tokens=8).sequences[0].tolist()
        assert row[-8:] == alone[-8:]
    assert target.asked[0] == (8, 1)
    assert all(keep == 0 for _, keep in target.asked[1:])


@pytest.mark.parametrize("kind", ["sliding", "hybrid", "encoder_decoder"])
def test_prompt_lookup_drafter_keeps_greedy_output(targets, kind):
    target = targets[kind]
    prompt = torch.tensor([[3, 4, 5, 6, 3, 4, 5, 6, 3, 4]])
    expected, expected_cache = plain_greedy(target, prompt, NEW_TOKENS)
    for k in (1, 3, 8):
        out = speculative_generate(target, PromptLookupDrafter(), prompt, num_draft_tokens=k, max_new_tokens=NEW_TOKENS)
        assert out.sequences[0].tolist() == expected
        assert out.draft_cache is None and out.draft_forwards == 0
        assert_same_cache(out.cache, expected_cache)
        assert sum(out.proposed_per_step) > 0


@pytest.mark.parametrize("kind", ["full", "hybrid", "encoder_decoder"])
def test_eos_stops_where_plain_decoding_stops(targets, kind):
    target = targets[kind]
    prompt = torch.tensor([[5, 1, 9, 2, 7]])
    reference, _ = plain_greedy(target, prompt, NEW_TOKENS)
    start = 1 if kind == "encoder_decoder" else prompt.shape[1]
    eos = reference[start + 6]  # a token first produced somewhere in the output
    expected, expected_cache = plain_greedy(target, prompt, NEW_TOKENS, eos=eos)
    assert expected[-1] == eos and len(expected) < len(reference) + 1
    for agree in ("always", "sometimes"):
        draft = SteeredDraft(target, agree)
        out = speculative_generate(
            target, draft, prompt, num_draft_tokens=4, max_new_tokens=NEW_TOKENS, eos_token_id=[eos]
        )
        assert out.sequences[0].tolist() == expected
        assert_same_cache(out.cache, expected_cache)


@pytest.mark.parametrize("kind", ["sliding", "hybrid", "hybrid_refeed"])
def test_one_token_prompt_rolls_back_into_the_empty_cache(targets, kind):
    """No prefill: the first verify forward starts from an empty (recording) cache, and a rejection
    there rolls the recurrent layers back to (or re-feeds from) nothing."""
    target = targets[kind]
    prompt = torch.tensor([[13]])
    expected, expected_cache = plain_greedy(target, prompt, 12)
    out = speculative_generate(
        target,
        SteeredDraft(target, "sometimes"),
        prompt,
        num_draft_tokens=4,
        max_new_tokens=12,
        intermediate_states=False if kind == "hybrid_refeed" else None,
    )
    assert out.sequences[0].tolist() == expected
    assert_same_cache(out.cache, expected_cache)


def test_max_new_tokens_cuts_inside_an_accepted_run(targets):
    target = targets["full"]
    prompt = torch.tensor([[1, 2, 3]])
    for n in (1, 2, 5, 9):
        expected, expected_cache = plain_greedy(target, prompt, n)
        out = speculative_generate(target, SteeredDraft(target, "always"), prompt, num_draft_tokens=8, max_new_tokens=n)
        assert out.sequences[0].tolist() == expected
        assert out.num_new_tokens == n and max(out.proposed_per_step) <= n - 1
        assert_same_cache(out.cache, expected_cache)


def test_intermediate_states_switch_is_restored(targets):
    target = targets["hybrid"]
    flags = [m.return_intermediate_states for m in target.modules() if hasattr(m, "return_intermediate_states")]
    assert flags and not any(flags)
    speculative_generate(target, SteeredDraft(target, "sometimes"), torch.tensor([[1, 2]]), max_new_tokens=6)
    assert not any(m.return_intermediate_states for m in target.modules() if hasattr(m, "return_intermediate_states"))


def test_statistics(targets):
    target = targets["full"]
    out = speculative_generate(
        target, SteeredDraft(target, "always"), torch.tensor([[1, 2, 3]]), num_draft_tokens=3, max_new_tokens=12,
        draft_schedule="acceptance",
    )
    assert out.proposed_per_step == out.accepted_per_step == [3, 3, 3]
    assert out.emitted_per_step == [4, 4, 4] and out.num_new_tokens == 12
    assert out.target_forwards == 3 and out.acceptance_rate == 1.0 and out.tokens_per_target_forward == 4.0
    assert out.draft_forwards == sum(out.proposed_per_step)


# ------------------------------------------------------------------------- prompt lookup unit
def _propose(drafter: PromptLookupDrafter, seq: list[int], k: int) -> list[int]:
    return drafter.propose(seq, k, lambda logits: (0, None)).tokens


def test_prompt_lookup_proposals():
    drafter = PromptLookupDrafter(max_ngram_size=3, min_ngram_size=1)
    drafter.start([1], device=torch.device("cpu"))
    # "7 8 9" occurred twice before: the earliest occurrence's continuation is proposed.
    assert _propose(drafter, [7, 8, 9, 1, 2, 3, 7, 8, 9, 4, 7, 8, 9], 3) == [1, 2, 3]
    assert _propose(drafter, [7, 8, 9, 1, 2, 3, 7, 8, 9], 8) == [1, 2, 3, 7, 8, 9]  # runs into the suffix itself
    # No 3-gram or 2-gram match: falls back to the 1-gram "5". A draft says the n-gram it matched.
    assert _propose(drafter, [5, 6, 1, 2, 5], 2) == [6, 1]
    assert drafter.propose([5, 6, 1, 2, 5], 2, lambda logits: (0, None)).match == 1
    assert drafter.propose([7, 8, 9, 1, 7, 8, 9], 2, lambda logits: (0, None)).match == 3
    assert _propose(drafter, [1, 2, 3, 4], 4) == []  # no match at all
    assert _propose(drafter, [4], 4) == []
    assert _propose(PromptLookupDrafter(3, 2), [5, 6, 1, 2, 5], 2) == []  # 1-grams not allowed
    # Encoder-decoder: the encoder input is searched after the decoder sequence.
    drafter.start([0], device=torch.device("cpu"), encoder_input_ids=torch.tensor([[10, 11, 12, 13, 14]]))
    assert _propose(drafter, [0, 11, 12], 2) == [13, 14]
    with pytest.raises(GenerationError, match="min_ngram_size"):
        PromptLookupDrafter(max_ngram_size=1, min_ngram_size=2)
    with pytest.raises(GenerationError, match="max_ngram_size"):
        PromptLookupDrafter(max_ngram_size=0)


def _scan_continuation(text: list[int], max_n: int, min_n: int, k: int) -> list[int]:
    """The naive reference: scan the whole text for the earliest earlier occurrence of its suffix."""
    for n in range(min(max_n, len(text) - 1), min_n - 1, -1):
        pattern = text[-n:]
        for start in range(len(text) - n):  # an occurrence followed by at least one token
            if text[start : start + n] == pattern:
                return text[start + n : start + n + k]
    return []


@given(
    tokens=st.lists(st.integers(0, 3), min_size=1, max_size=60),
    growth=st.lists(st.integers(1, 5), min_size=1, max_size=20),
    sizes=st.sampled_from([(3, 1), (2, 2), (4, 2)]),
)
def test_incremental_ngram_index_proposes_what_a_full_scan_finds(tokens, growth, sizes) -> None:
    """The drafter's index, grown step by step (and reset when the sequence is not an extension),
    proposes exactly what scanning the whole sequence would."""
    drafter = PromptLookupDrafter(*sizes)
    drafter.start(tokens[:1], device=torch.device("cpu"))
    length = 1
    for n in growth:
        length = min(len(tokens), length + n)
        seq = tokens[:length]
        assert _propose(drafter, seq, 4) == _scan_continuation(seq, *sizes, 4)
    other = [3, 2, 1, 0, 3, 2]  # not an extension: the index starts over
    assert _propose(drafter, other, 4) == _scan_continuation(other, *sizes, 4)


# ------------------------------------------------------------------------------------ errors
class _GreedyDrafter(Drafter):
    def __init__(self, tokens: list[int]) -> None:
        self.tokens = tokens

    def propose(self, sequence, num_tokens, pick):
        return Draft(self.tokens)


def test_bad_inputs_raise_generation_errors(targets):
    target, prompt = targets["full"], torch.tensor([[1, 2, 3]])
    cases = [
        ({"input_ids": prompt.repeat(2, 1), "cache": target.new_cache()}, "batch size 1"),
        ({"num_draft_tokens": 0}, "num_draft_tokens"),
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"input_ids": torch.tensor([[1, VOCAB]])}, "outside"),
        ({"attention_mask": torch.tensor([[1, 1, 0]])}, "attention_mask"),  # right padding
        ({"draft": targets["encoder_decoder"]}, "same kind"),
        ({"draft": DecoderLM(DecoderConfig(vocab_size=VOCAB + 1))}, "vocabulary"),
        ({"intermediate_states": True}, "set_return_intermediate_states"),
        ({"draft": _GreedyDrafter([1] * 9), "num_draft_tokens": 2}, "more than"),
        ({"draft": _GreedyDrafter([VOCAB]), "num_draft_tokens": 2}, "outside"),
        ({"do_sample": True, "temperature": 0.0}, "temperature"),
        ({"eos_token_id": -1}, "eos_token_id"),
    ]
    for overrides, message in cases:
        kwargs = {"input_ids": prompt, "draft": PromptLookupDrafter(), "max_new_tokens": 4, **overrides}
        draft = kwargs.pop("draft")
        with pytest.raises(GenerationError, match=message):
            speculative_generate(target, draft, **kwargs)


# ----------------------------------------------------------------------------- sampling rule
class TinyRecurrentLM:
    """A 4-token model whose next-token logits depend on the current token, the previous one (held
    in a `RecurrentLayer`) and the counts of all tokens so far (keys of a `DynamicLayer`):
    `logits_t = A[x_t] + B[x_{t-1}] + C @ counts_t / (t + 1)`. Real cache layers, so the sampling
    test also exercises recurrent rollback, with or without intermediate states."""

    vocab_size = 4

    def __init__(self, seed: int, scale: float = 1.5) -> None:
        g = torch.Generator().manual_seed(seed)
        self.a, self.b, self.c = (scale * torch.randn(4, 4, generator=g, dtype=torch.float64) for _ in range(3))
        self.intermediate = False

    def set_return_intermediate_states(self, enabled: bool) -> None:
        self.intermediate = enabled

    def new_cache(self) -> Cache:
        return Cache([RecurrentLayer(), DynamicLayer()])

    def __call__(self, input_ids, *, cache, position_ids=None, attention_mask=None):
        onehot = F.one_hot(input_ids, 4).double()  # [1, T, 4]
        prev = cache.get_recurrent_state(0)
        prev = torch.zeros(1, 4, dtype=torch.float64) if prev is None else prev
        previous = torch.cat([prev[:, None], onehot[:, :-1]], dim=1)
        keys, _ = cache.update(onehot[:, None], onehot[:, None], 1)  # [1, 1, past + T, 4]
        t = onehot.shape[1]
        counts = keys[0, 0].cumsum(0)[-t:]  # counts including each new token
        positions = torch.arange(keys.shape[2] - t + 1, keys.shape[2] + 1, dtype=torch.float64)
        extra = {"intermediate_states": onehot} if self.intermediate else {"num_tokens": t}
        cache.update_recurrent_state(onehot[:, -1], 0, **extra)
        return onehot @ self.a + previous @ self.b + (counts / positions[:, None]) @ self.c


def _processed(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """Independent temperature, then top-k, then top-p (keep a token while the mass of the tokens
    better than it is < top_p): the distribution the target samples from."""
    logits = logits / temperature
    if top_k:
        kth = logits.topk(top_k).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = logits.softmax(-1)
    if top_p < 1:
        better = torch.tensor([float(probs[probs > probs[i]].sum()) for i in range(len(probs))], dtype=probs.dtype)
        probs = torch.where(better < top_p, probs, torch.zeros_like(probs))
        probs = probs / probs.sum()
    return probs


def _exact_distribution(
    model: TinyRecurrentLM, prompt: list[int], n: int, temperature: float, top_k: int, top_p: float
) -> dict[tuple[int, ...], float]:
    """P(next n tokens = s) for every s, from fresh full-sequence forwards of each prefix."""
    probs = {}
    for seq in itertools.product(range(4), repeat=n):
        p = 1.0
        for i in range(n):
            logits = model(torch.tensor([prompt + list(seq[:i])]), cache=model.new_cache())[0, -1]
            p *= float(_processed(logits, temperature, top_k, top_p)[seq[i]])
        probs[seq] = p
    return probs


class _FixedDrafter(Drafter):
    """Deterministic proposals (a point mass), like n-gram lookup: always "2 0 1 ..."."""

    def propose(self, sequence, num_tokens, pick):
        return Draft([2, 0, 1, 3][:num_tokens])


@pytest.mark.parametrize(
    ("drafter", "temperature", "top_k", "top_p", "intermediate"),
    [("model", 1.0, 0, 1.0, True), ("model", 0.7, 3, 1.0, False), ("fixed", 1.0, 0, 0.9, True)],
)
def test_sampling_rule_matches_target_distribution(drafter, temperature, top_k, top_p, intermediate):
    """Chi-square goodness of fit of the first 3 sampled tokens (64 outcomes) over 1500 seeded runs
    against the exact target distribution, at significance 0.001. The same statistic for the
    draft's own distribution is checked to be far above the bound, so the test can fail."""
    from scipy.stats import chi2

    target, draft_model = TinyRecurrentLM(seed=1), TinyRecurrentLM(seed=2)
    target.set_return_intermediate_states(intermediate)
    prompt, n, runs = [1, 3], 3, 1500
    expected = _exact_distribution(target, prompt, n, temperature, top_k, top_p)
    generator = torch.Generator().manual_seed(1234)
    counts = dict.fromkeys(expected, 0)
    accepted = 0
    for _ in range(runs):
        out = speculative_generate(
            target,
            ModelDrafter(draft_model) if drafter == "model" else _FixedDrafter(),
            torch.tensor([prompt]),
            num_draft_tokens=2,
            max_new_tokens=n,
            do_sample=True,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            generator=generator,
            intermediate_states=None if intermediate else False,
            draft_schedule="acceptance",  # drafts at every step, so the rule is what is tested
        )
        counts[tuple(out.sequences[0, len(prompt) :].tolist())] += 1
        accepted += sum(out.accepted_per_step)
    assert 0 < accepted < runs * n  # drafts were both accepted and rejected

    # Cells with an expected count under 5 are pooled into one.
    big = [s for s, p in expected.items() if p * runs >= 5]
    small = [s for s in expected if s not in big]
    observed = [counts[s] for s in big] + [sum(counts[s] for s in small)]
    wanted = [expected[s] * runs for s in big] + [sum(expected[s] for s in small) * runs]
    if wanted[-1] == 0:
        observed, wanted = observed[:-1], wanted[:-1]
        assert sum(counts[s] for s in small) == 0  # zero-probability outcomes never appear
    statistic = sum((o - w) ** 2 / w for o, w in zip(observed, wanted, strict=True))
    bound = chi2.ppf(0.999, len(wanted) - 1)
    assert statistic < bound, f"chi2 {statistic:.1f} >= {bound:.1f}"

    if drafter == "model":  # power: sampling the draft's distribution instead would fail clearly
        draft_dist = _exact_distribution(draft_model, prompt, n, temperature, top_k, top_p)
        pooled_draft = [draft_dist[s] * runs for s in big] + [sum(draft_dist[s] for s in small) * runs]
        expected_wrong = sum((d - w) ** 2 / w for d, w in zip(pooled_draft, wanted, strict=True))
        assert expected_wrong > 5 * bound


class _Foreseeing(Drafter):
    """Point-mass drafts of a known answer, every `wrong`-th token of it changed: drafts that are
    kept in part and rejected in part, at known positions."""

    reports_match = True

    def __init__(self, answer: list[int], wrong: int) -> None:
        self.answer, self.wrong = answer, wrong

    def propose(self, sequence, num_tokens, pick):
        n = len(sequence)
        tokens = self.answer[n : n + num_tokens]
        return Draft([(t + 1) % VOCAB if (n + i) % self.wrong == 0 else t for i, t in enumerate(tokens)], match=8)


@pytest.mark.parametrize("kind", ["full", "sliding", "hybrid", "encoder_decoder"])
@pytest.mark.parametrize("schedule", ["adaptive", "acceptance", "constant"])
def test_sampling_with_point_mass_drafts_returns_plain_samplings_tokens(targets, kind, schedule):
    """A point-mass draft is verified by the target's own draw at each position in turn (kept while
    they agree), so a seeded sampled run returns the tokens `generate` samples from the same seed,
    whatever the schedule drafts. The drafts are plain sampling's own answer with every fifth token
    changed, so they are both kept and rejected. (float64 targets: a verify forward's logits and a
    one-token step's are different computations; their last-bit differences never reach a draw here.)"""
    target = targets[kind]
    prompt = torch.tensor([[3, 4, 5, 6, 3, 4, 5, 6, 3, 4]])
    kept = rejected = 0
    for seed in range(3):
        options = {"max_new_tokens": NEW_TOKENS, "do_sample": True, "temperature": 1.5}
        plain = generate(target, prompt, generator=torch.Generator().manual_seed(seed), **options)
        drafter = _Foreseeing(plain.sequences[0].tolist(), 5)
        out = speculative_generate(target, drafter, prompt, num_draft_tokens=3, draft_schedule=schedule,
                                   generator=torch.Generator().manual_seed(seed), **options)  # fmt: skip
        assert torch.equal(out.sequences, plain.sequences)
        kept += sum(out.accepted_per_step)
        rejected += sum(out.proposed_per_step) - sum(out.accepted_per_step)
    assert kept > 0 and rejected > 0


@pytest.mark.parametrize("kind", ["sliding", "hybrid"])
def test_speculative_decoding_continues_given_caches_exactly(kind: str, tmp_path) -> None:
    """`cache=` / `draft_cache=`: a second call continues the caches the first returned (or a loaded
    prompt cache) and the greedy output is one long greedy run's."""
    from kvcache import load_cache, save_cache
    from kvcache.generation import ModelDrafter, generate, speculative_generate

    target, draft = make_target(kind), make_target(kind, seed=1)  # a draft that agrees only sometimes
    prompt = torch.randint(2, VOCAB, (1, 9), generator=torch.Generator().manual_seed(1))
    whole = generate(target, prompt, max_new_tokens=16).sequences

    first = speculative_generate(target, ModelDrafter(draft), prompt, num_draft_tokens=3, max_new_tokens=8)
    second = speculative_generate(target, ModelDrafter(draft), first.sequences, num_draft_tokens=3, max_new_tokens=8,
                                  cache=first.cache, draft_cache=first.draft_cache)  # fmt: skip
    assert torch.equal(second.sequences, whole)
    assert second.cache.get_seq_length() == whole.shape[1] - 1

    built = generate(target, prompt, max_new_tokens=0)  # a saved prompt cache, loaded
    save_cache(built.cache, tmp_path / "p.safetensors")
    resumed = speculative_generate(target, ModelDrafter(draft), prompt, num_draft_tokens=3, max_new_tokens=16,
                                   cache=load_cache(tmp_path / "p.safetensors"))  # fmt: skip
    assert torch.equal(resumed.sequences, whole)

    with pytest.raises(GenerationError, match="already holds"):
        speculative_generate(target, ModelDrafter(draft), prompt[:, :3], max_new_tokens=2, cache=first.cache)
    with pytest.raises(GenerationError, match="draft model"):
        speculative_generate(target, PromptLookupDrafter(), prompt, max_new_tokens=2, draft_cache=first.draft_cache)


def test_one_token_forwards_see_the_ids_and_positions_of_their_tokens(targets):
    """One-token forwards take their ids and position ids from views made once (positions in blocks
    of `POSITION_BLOCK` from the first one-token forward): across a block's end, after a rollback
    behind a block's start and for ids not fed before, the model must see the ids and positions of
    the tokens fed, and so compute what one forward of the whole sequence computes (up to the
    round-off of one-token forwards against a long one)."""
    target = targets["full"]
    seen: list[tuple[list[int], list[int]]] = []

    class Recorder:
        vocab_size, new_cache = target.vocab_size, target.new_cache

        def __call__(self, input_ids, *, position_ids, **kwargs):
            seen.append((input_ids[0].tolist(), position_ids[0].tolist()))
            return target(input_ids, position_ids=position_ids, **kwargs)

    runner = ModelRunner(Recorder(), device=torch.device("cpu"))
    tokens = [(7 * i + 3) % VOCAB for i in range(POSITION_BLOCK + 30)]
    runner.prefill(tokens[:5], whole=True)  # the first one-token forward is at position 5
    fed, logits, positions_fed, rollbacks = 5, [], [], [POSITION_BLOCK + 18, POSITION_BLOCK + 8]
    near = range(POSITION_BLOCK - 10, POSITION_BLOCK + 30)  # the block's end (261): recorded steps only
    with torch.no_grad():
        while fed < len(tokens):
            positions_fed.append(fed)
            plain = fed % 10 == 0 and fed not in near  # a plain step commits at once
            logits.append(runner.feed(tokens[fed : fed + 1], rollback=not plain)[0])
            fed += 1
            if rollbacks and fed == rollbacks[-1]:  # back behind the block's start, then not
                rollbacks.pop()
                runner.truncate(fed - 6)
                del logits[-6:]
                fed -= 6
            elif fed % 10 == 0 and fed not in near:
                runner.truncate(fed)  # commit
        whole = target(torch.tensor([tokens]), cache=target.new_cache())[0, 5:]
    assert runner.tokens == tokens
    assert [positions for _, positions in seen[1:]] == [[at] for at in positions_fed]
    assert [ids for ids, _ in seen[1:]] == [[tokens[at]] for at in positions_fed]
    torch.testing.assert_close(torch.stack(logits), whole, rtol=1e-5, atol=1e-5)
