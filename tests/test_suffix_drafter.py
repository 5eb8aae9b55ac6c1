"""`SuffixDrafter` / `SuffixCorpus`: drafting from what followed the current context in earlier
requests. Greedy output equals plain decoding (one row, a ragged batch, a hybrid model whose
recurrent state is rolled back exactly); what earlier requests taught makes later drafts
accepted; the corpus's counts equal a naive recount of the sequences it still holds, within its
token budget."""

from __future__ import annotations

import random
from collections import Counter
from typing import Any

import pytest
import torch
from test_speculative import make_target, plain_greedy

from kvcache import GenerationError
from kvcache.generation import DraftGate, ModelDrafter, generate, speculative_generate
from kvcache.generation.suffix import SuffixCorpus, SuffixDrafter

pytestmark = pytest.mark.usefixtures("one_thread")

NEW = 24


@pytest.fixture(scope="module")
def targets():
    return {kind: make_target(kind) for kind in ("full", "sliding", "hybrid")}


@pytest.mark.parametrize("kind", ["full", "sliding", "hybrid"])
def test_a_repeated_request_is_drafted_from_the_first_and_stays_exact(targets, kind: str) -> None:
    """Two requests with one prompt: the second's answer is the first's, so nearly every draft of
    the second request is accepted; both equal plain greedy decoding (caches included)."""
    target = targets[kind]
    prompt = torch.tensor([[5, 1, 9, 2, 7, 3, 3, 8]])
    expected, expected_cache = plain_greedy(target, prompt, NEW)
    corpus = SuffixCorpus()
    outs = []
    for _ in range(2):
        out = speculative_generate(target, SuffixDrafter(corpus), prompt, num_draft_tokens=6, max_new_tokens=NEW,
                                   draft_schedule="constant")  # fmt: skip
        assert out.sequences[0].tolist() == expected
        outs.append(out)
        corpus.add(out.sequences[0].tolist())  # what a server does when a request finishes
    assert len(corpus) == 2
    second = outs[1]
    assert sum(second.accepted_per_step) >= NEW - 6  # what the first answer taught
    assert second.target_forwards < NEW / 2
    from test_speculative import assert_same_cache

    assert_same_cache(second.cache, expected_cache)


def test_a_batch_shares_the_corpus_and_equals_batched_greedy(targets) -> None:
    target = targets["hybrid"]
    prompt = torch.tensor([[0, 0, 5, 1, 9, 2, 7], [4, 4, 6, 1, 9, 2, 7]])
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1], [1] * 7])
    want = generate(target, prompt, attention_mask=mask, max_new_tokens=NEW, eos_token_id=[])
    corpus = SuffixCorpus()
    real = torch.cat([mask, torch.ones(2, NEW, dtype=mask.dtype)], dim=1).bool()
    for row, keep in zip(want.sequences, real, strict=True):  # earlier requests answered these prompts
        corpus.add(row[keep].tolist())
    got = speculative_generate(target, SuffixDrafter(corpus), prompt, attention_mask=mask, max_new_tokens=NEW,
                               eos_token_id=[])  # fmt: skip
    assert torch.equal(got.sequences, want.sequences)
    assert all(rate > 0.5 for rate in got.acceptance_rates)  # each row drafted from its earlier answer
    assert len(corpus) == 2  # the rows drafted from one shared corpus, not copies of it


def test_a_gate_carried_across_requests_keeps_what_it_measured(targets) -> None:
    """`draft_schedule=DraftGate(k)` is the adaptive schedule carried from call to call (as the
    corpus is): every run stays exact, and the gate's measurements accumulate across them. Calls it
    cannot serve are refused before any work, the gate untouched."""
    target = targets["full"]
    prompt = torch.tensor([[5, 1, 9, 2, 7, 3, 3, 8]])
    expected, _ = plain_greedy(target, prompt, NEW)
    corpus, gate = SuffixCorpus(), DraftGate(6)
    recorded: list[int] = []  # steps the gate measured, per run
    plain_record = gate.record

    def record(*args: Any, **kwargs: Any) -> None:
        recorded[-1] += 1
        plain_record(*args, **kwargs)

    gate.record = record  # type: ignore[method-assign]
    for _ in range(3):
        recorded.append(0)
        out = speculative_generate(target, SuffixDrafter(corpus), prompt, num_draft_tokens=6, max_new_tokens=NEW,
                                   draft_schedule=gate)  # fmt: skip
        assert out.sequences[0].tolist() == expected
        corpus.add(out.sequences[0].tolist())
    assert all(recorded), recorded  # one gate measured every step of all three runs
    clocks = [(gate.cost.clock, gate.judged)]
    batch = {"input_ids": prompt.repeat(2, 1), "attention_mask": torch.ones(2, prompt.shape[1], dtype=torch.long)}
    sampled = {"do_sample": True, "temperature": 1.5}
    for drafter, bad in ((SuffixDrafter(corpus), {"num_draft_tokens": 4}), (SuffixDrafter(corpus), batch),
                         (ModelDrafter(target), sampled)):  # a draft model that samples draws from the generator
        kwargs = {"input_ids": prompt, "num_draft_tokens": 6, "max_new_tokens": 4, **bad}
        with pytest.raises(GenerationError, match="DraftGate"):
            speculative_generate(target, drafter, draft_schedule=gate, **kwargs)
        assert (gate.cost.clock, gate.judged) == clocks[-1]
    # suffix drafts are point masses: a sampled run keeps the gate, and returns plain sampling's tokens
    plain = generate(target, prompt, max_new_tokens=NEW, generator=torch.Generator().manual_seed(3), **sampled)
    out = speculative_generate(target, SuffixDrafter(corpus), prompt, num_draft_tokens=6, max_new_tokens=NEW,
                               draft_schedule=gate, generator=torch.Generator().manual_seed(3), **sampled)  # fmt: skip
    assert torch.equal(out.sequences, plain.sequences)
    assert gate.cost.clock > clocks[-1][0]


def test_no_repetition_drafts_nothing_and_stays_exact(targets) -> None:
    target = targets["full"]
    prompt = torch.tensor([[5, 1, 9, 2, 7]])
    expected, _ = plain_greedy(target, prompt, NEW)
    out = speculative_generate(target, SuffixDrafter(SuffixCorpus(), min_match=8), prompt, max_new_tokens=NEW)
    assert out.sequences[0].tolist() == expected
    assert sum(out.proposed_per_step) == 0


@pytest.mark.parametrize("prompts", [False, True])
def test_the_corpus_counts_equal_a_recount_within_its_budget(prompts: bool) -> None:
    """Fed (prompt, answer) sequences, the corpus counts what followed each context of 1 to 3 tokens
    in the answers (contexts reaching back into the prompt), or everywhere with `prompts=True`, over
    the most recently fed sequences, and holds an answer with its prompt's last 3 tokens (or the whole
    sequence) within its budget of 200 tokens."""
    rng = random.Random(0)
    corpus = SuffixCorpus(max_depth=3, max_tokens=200, prompts=prompts)
    fed = []
    for _ in range(60):
        seq = [rng.randrange(6) for _ in range(rng.randrange(2, 30))]
        prompt_length = rng.randrange(len(seq) + 1)
        corpus.add(seq, prompt_length)
        counted = max(1, 0 if prompts else prompt_length)
        if counted < len(seq):  # a prompt without an answer teaches nothing: not held
            fed.append((seq, counted))
    assert 0 < corpus.tokens <= 200
    held = fed[len(fed) - len(corpus) :]  # the most recently fed, in order
    assert sum(len(seq) - max(counted - 3, 0) for seq, counted in held) == corpus.tokens
    naive: dict[tuple, Counter] = {}
    for seq, counted in held:
        for end in range(counted, len(seq)):
            for n in range(1, min(3, end) + 1):
                naive.setdefault(tuple(seq[end - n : end]), Counter())[seq[end]] += 1
    assert len(corpus._counts.counts) == len(naive)  # nothing left behind by forgotten sequences
    for context, counts in naive.items():
        assert corpus.get(context) == dict(counts), context


def test_a_drafter_feeds_its_answer_when_it_finishes() -> None:
    """`finish` (or the next `start`) feeds the sequence the drafter followed: with the default
    corpus, what followed in the answer, its contexts reaching into the prompt's end."""
    corpus = SuffixCorpus(max_depth=2)
    drafter = SuffixDrafter(corpus)
    drafter.start([1, 2, 3, 4], device=torch.device("cpu"))
    drafter.propose([1, 2, 3, 4, 5, 6], 2, lambda logits: (0, None))  # two tokens answered
    drafter.start([9, 9], device=torch.device("cpu"))  # a new request: the previous one is fed
    assert len(corpus) == 1 and corpus.tokens == 4  # the answer and the prompt's last 2 tokens
    assert corpus.get((4,)) == {5: 1} and corpus.get((3, 4)) == {5: 1} and corpus.get((5,)) == {6: 1}
    assert corpus.get((2,)) is None and corpus.get((1, 2)) is None  # the prompt's own continuations
    drafter.finish()
    assert len(corpus) == 1 and corpus.get((9,)) is None  # nothing answered: nothing counted nor held


def test_bad_corpus_arguments_are_refused_and_change_nothing() -> None:
    corpus = SuffixCorpus(max_depth=3)
    corpus.add([1, 2, 3, 4], 2)
    before = (dict(corpus._counts.counts), corpus.tokens, len(corpus))
    for bad in (-1, True, 1.5, "2", None):
        with pytest.raises(GenerationError, match="prompt_length"):
            corpus.add([5, 6, 7], bad)
    assert (dict(corpus._counts.counts), corpus.tokens, len(corpus)) == before
    with pytest.raises(GenerationError, match="prompts"):
        SuffixCorpus(prompts="yes")  # type: ignore[arg-type]


def test_proposals_follow_the_most_frequent_continuation() -> None:
    corpus = SuffixCorpus(max_depth=4)
    for _ in range(3):
        corpus.add([1, 2, 3, 4, 5])
    corpus.add([1, 2, 3, 9, 9])
    drafter = SuffixDrafter(corpus, min_share=0.5, per_match=2)  # a match of 2 tokens: up to 4 drafted
    drafter.start([7, 1, 2], device=torch.device("cpu"))
    assert drafter.propose([7, 1, 2], 5, lambda logits: (0, None)).tokens == [3, 4, 5]
    assert drafter.propose([7, 1, 2], 1, lambda logits: (0, None)).tokens == [3]
    strict = SuffixDrafter(corpus, min_share=0.9)  # 3 of 4 times is not enough for it
    strict.start([1, 2, 3], device=torch.device("cpu"))
    assert strict.propose([1, 2, 3], 3, lambda logits: (0, None)).tokens == []


def _naive_draft(fed: list[list[int]], sequence: list[int], k: int, depth: int, min_match: int,
                 min_share: float, per_match: float = 1e9) -> tuple[list[int], int]:
    """The drafting rule recomputed from the raw token lists: for each drafted token, scan every
    context length from the longest down, count what followed it in the fed sequences and in the
    sequence itself (its last occurrence, which nothing follows yet, excluded). With the draft, the
    length of the match its first token continued (0: no draft)."""
    seq, out, match = list(sequence), [], 0
    while len(out) < k:
        context, choice = seq[-depth:], None
        for n in range(len(context), min_match - 1, -1):
            key, counts = context[-n:], Counter()
            for source in [*fed, sequence]:  # the drafter's own table is the sequence before drafting
                for end in range(n, len(source)):
                    if source[end - n : end] == key:
                        counts[source[end]] += 1
            if counts:
                token, count = max(counts.items(), key=lambda item: (item[1], -item[0]))
                choice = token if count >= min_share * sum(counts.values()) else None
                if not out:
                    k, match = (k if n >= depth else min(k, max(1, int(per_match * n)))), n
                break
        if choice is None:
            break
        out.append(choice)
        seq.append(choice)
    return out, match if out else 0


def test_proposals_equal_a_naive_scan_of_the_fed_sequences() -> None:
    """The drafter's longest-match search (one lookup while a draft follows the corpus, a binary
    search otherwise) finds what scanning every context length over the raw lists finds."""
    rng = random.Random(3)
    for trial in range(60):
        depth, alphabet = rng.choice([3, 4, 8]), rng.choice([3, 5, 12])
        corpus = SuffixCorpus(max_depth=depth)
        fed = [[rng.randrange(alphabet) for _ in range(rng.randrange(2, 40))] for _ in range(rng.randrange(1, 6))]
        for seq in fed:
            corpus.add(seq)
        min_match, min_share = rng.choice([1, 2]), rng.choice([0.0, 0.3, 0.6])
        per_match = rng.choice([0.5, 1.0, 1e9])
        drafter = SuffixDrafter(corpus, min_match=min_match, min_share=min_share, per_match=per_match)
        sequence = [rng.randrange(alphabet) for _ in range(rng.randrange(1, 20))]
        drafter.start(sequence, device=torch.device("cpu"))
        k = rng.randrange(1, 12)
        got = drafter.propose(sequence, k, lambda logits: (0, None))
        assert (got.tokens, got.match) == _naive_draft(fed, sequence, k, depth, min_match, min_share, per_match), trial


def test_bad_parameters_are_package_errors() -> None:
    for bad in ({"max_depth": 0}, {"max_tokens": -1}, {"max_depth": 2.5}):
        with pytest.raises(GenerationError):
            SuffixCorpus(**bad)
    with pytest.raises(GenerationError):
        SuffixDrafter(min_share=1.5)
    with pytest.raises(GenerationError):
        SuffixDrafter(min_match=0)
    for bad in (0, -1.0, True, "2"):
        with pytest.raises(GenerationError, match="per_match"):
            SuffixDrafter(per_match=bad)


@pytest.mark.parametrize("depth", [1, 3, 8])
def test_counts_fed_whole_or_piece_by_piece_equal_a_recount_of_every_context(depth: int) -> None:
    """A drafter feeds its sequence a few tokens at a time (`start` past what it fed): the counts
    equal those of one feed of the whole sequence, and every context of 1 to `depth` tokens finds
    the continuations a recount of the tuples finds."""
    from kvcache.generation.continuation_counts import ContinuationCounts

    rng = random.Random(depth)
    seq = [rng.randrange(5) for _ in range(120)]
    whole, pieces = ContinuationCounts(depth), ContinuationCounts(depth)
    whole.add(seq)
    done = 0
    while done < len(seq):
        step = rng.randrange(1, 12)
        pieces.add(seq[: done + step], start=done)
        done += step
    assert whole.counts == pieces.counts
    naive: dict[tuple, Counter] = {}
    for end in range(1, len(seq)):
        for n in range(1, min(depth, end) + 1):
            naive.setdefault(tuple(seq[end - n : end]), Counter())[seq[end]] += 1
    assert len(whole.counts) == len(naive)
    assert all(whole.get(context) == dict(counted) for context, counted in naive.items())


@pytest.mark.parametrize("kind", ["full", "hybrid"])
def test_sampled_drafts_with_min_p_return_plain_samplings_tokens(targets, kind) -> None:
    """Suffix drafts are point masses verified by the row's own draws from the filtered
    distribution (temperature, top-p, min-p): the same tokens as plain sampling, seed for seed,
    while drafts are accepted (the corpus holds an earlier answer to follow)."""
    target = targets[kind]
    prompt = torch.tensor([[5, 1, 9, 2, 7, 5, 1, 9]])
    sampled = {"do_sample": True, "temperature": 1.2, "top_p": 0.95, "min_p": 0.05}
    corpus = SuffixCorpus()
    accepted = []
    for seed in (3, 3, 4):
        plain = generate(target, prompt, max_new_tokens=NEW, generator=torch.Generator().manual_seed(seed), **sampled)
        out = speculative_generate(target, SuffixDrafter(corpus), prompt, num_draft_tokens=6, max_new_tokens=NEW,
                                   generator=torch.Generator().manual_seed(seed), **sampled)  # fmt: skip
        assert torch.equal(out.sequences, plain.sequences), seed
        corpus.add(out.sequences[0].tolist())
        accepted.append(sum(out.accepted_per_step))
    assert accepted[1] > NEW // 2  # the repeated seed followed its earlier answer


def naive_answers_after(fed: list[tuple[list[int], int]], prompt: list[int], context: int) -> list[list[int]]:
    """The answers of the fed (sequence, prompt length) pairs whose prompt's last `context` tokens
    are `prompt`'s, most recent first, at most 4."""
    same = [seq[n:] for seq, n in fed if n and seq[:n][-context:] == prompt[-context:]]
    return same[::-1][:4]


def test_answers_are_found_by_how_their_prompt_ended() -> None:
    """`answers_after`: earlier answers to prompts whose last `answer_context` tokens are this
    prompt's (what came before does not matter), most recent first, four at most, none for a
    sequence fed without a prompt length, and none once the budget forgot the sequence."""
    rng = random.Random(0)
    corpus = SuffixCorpus(max_tokens=400, answer_context=5)
    fed: list[tuple[list[int], int]] = []
    endings = [[1, 2, 3, 4, 5], [1, 2, 3, 4, 6], [9, 2, 3, 4, 5]]
    for i in range(40):
        prompt = [rng.randrange(20, 40) for _ in range(rng.randrange(0, 4))] + rng.choice(endings)
        answer = [rng.randrange(40, 60) for _ in range(rng.randrange(1, 9))]
        length = 0 if i % 7 == 3 else len(prompt)
        corpus.add(prompt + answer, length)
        fed.append((prompt + answer, length))
        kept = fed[-len(corpus) :]  # the corpus forgets whole sequences, oldest first
        for ending in endings:
            asked = [33, *ending]
            assert corpus.answers_after(asked) == naive_answers_after(kept, asked, 5), (i, ending)
    assert len(corpus) < 40  # the budget forgot some: their answers went with them
    corpus.add(torch.tensor([7, 1, 2, 3, 4, 5, 41, 42]), 6)  # a tensor row, as a batch's output is
    assert corpus.answers_after([1, 2, 3, 4, 5])[0] == [41, 42]
    for bad in ("abc", [1.5, 2.0], [True]):
        with pytest.raises(GenerationError, match="token ids"):
            corpus.answers_after(bad)  # type: ignore[arg-type]
    with pytest.raises(GenerationError, match="answer_context"):
        SuffixCorpus(answer_context=0)


def test_a_repeated_prompt_follows_its_own_earlier_answer_from_the_first_token(targets) -> None:
    """Prompts that end alike ("...Call: ") but differ further back get different answers; the
    counts of the contexts the answers start from then point to the most frequent answer, not this
    prompt's. A repeated prompt drafts its own earlier answer from its first step (reported as a
    match deeper than the counts hold), and the output stays plain greedy decoding's."""
    target = targets["full"]
    tail = [7, 3, 3, 8, 2, 2, 6, 1, 9, 4]  # longer than the counts' depth of 8
    prompts = [[5, 1, *tail], [11, 12, *tail], [11, 12, *tail]]
    answers = [plain_greedy(target, torch.tensor([p]), NEW)[0][len(p) :] for p in prompts[:2]]
    assert answers[0] != answers[1]
    corpus = SuffixCorpus()
    corpus.add(prompts[1] + answers[1], len(prompts[1]))
    corpus.add(prompts[2] + answers[1], len(prompts[2]))  # the other answer, twice: the counts favour it
    corpus.add(prompts[0] + answers[0], len(prompts[0]))
    drafter = SuffixDrafter(corpus)
    drafter.start(prompts[0], device=torch.device("cpu"))
    draft = drafter.propose(prompts[0], 6, None)
    assert draft.tokens == answers[0][:6] and draft.match == corpus.max_depth + 1
    out = speculative_generate(target, SuffixDrafter(corpus), torch.tensor([prompts[0]]), num_draft_tokens=8,
                               max_new_tokens=NEW, eos_token_id=[], draft_schedule="constant")  # fmt: skip
    assert out.sequences[0].tolist()[len(prompts[0]) :] == answers[0]
    assert out.target_forwards <= -(-NEW // 9) + 1  # whole drafts accepted from the first step
    counts_only = SuffixDrafter(corpus)  # the counts alone: the answer two prompts gave
    counts_only._tokens, counts_only._prompt_length = list(prompts[0]), len(prompts[0])
    assert counts_only.propose(prompts[0], 6, None).tokens != answers[0][:6]


def test_a_drafter_follows_the_answer_another_is_decoding_to_the_same_prompt() -> None:
    """Requests in flight together: B starts while A, on a prompt ending alike, is mid-answer. B
    drafts A's answer as far as A has got (a whole-ending match), follows it as A decodes more,
    drops it when what B decodes disagrees; once they leave, a new drafter no longer sees it live,
    and after A finishes its answer is read from the corpus."""
    cpu = torch.device("cpu")
    corpus = SuffixCorpus(answer_context=4)
    prompt = [9, 8, 7, 6, 5, 4]
    answer = [20, 21, 22, 23, 24, 25, 26, 27]
    a, b = SuffixDrafter(corpus), SuffixDrafter(corpus)
    a.start(prompt, device=cpu)
    a.propose(prompt + answer[:3], 4, None)  # A has decoded three tokens
    other = [1, 2, *prompt[-4:]]  # another prompt, the same ending
    b.start(other, device=cpu)
    draft = b.propose(other, 8, None)
    assert draft.tokens == answer[:3] and draft.match == corpus.max_depth + 1
    a.propose(prompt + answer[:6], 4, None)  # A goes on: B sees the new tokens
    assert b.propose(other + answer[:2], 8, None).tokens == answer[2:6]
    assert b.propose(other + answer[:6], 8, None).tokens == []  # level with A: nothing further yet
    a.propose(prompt + answer, 4, None)
    assert b.propose(other + answer[:6], 8, None).tokens == answer[6:]  # A ahead again
    c = SuffixDrafter(corpus)
    c.start(other, device=cpu)
    assert c.propose([*other, 20, 99], 8, None).match <= corpus.max_depth  # disagreed: A dropped
    for drafter in (a, b, c):
        drafter.leave()
    d = SuffixDrafter(corpus)
    d.start(other, device=cpu)
    assert d.propose(other, 8, None).tokens == []  # they left and fed nothing: no answer to follow
    d.leave()
    a.start(prompt, device=cpu)
    a.propose(prompt + answer, 4, None)
    a.finish()  # fed to the corpus: read from there by later drafters
    e = SuffixDrafter(corpus)
    e.start(other, device=cpu)
    assert e.propose(other, 8, None).tokens == answer
    assert len(corpus._live) == 1  # e, still decoding
    e.leave()
    assert corpus._live == {}  # every drafter that left is forgotten
