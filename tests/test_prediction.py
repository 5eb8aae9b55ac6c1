"""Predicted outputs: `PredictionTrack` follows an answer through a predicted text, its count of
predicted tokens taken is a common subsequence of the two (checked against the longest one,
computed by dynamic programming), and it finds every one where the answer is the prediction with
insertions and short deletions; `PredictionDrafter` drafts from it and the answer stays the
target's own greedy answer, with far fewer target forwards where the prediction is right."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_speculative import NEW_TOKENS, SteeredDraft, assert_same_cache, make_target, plain_greedy

from kvcache.generation import ModelDrafter, PredictionDrafter, PromptLookupDrafter, speculative_generate
from kvcache.generation.prediction import NEAR, PredictionTrack, prediction_usage

pytestmark = pytest.mark.usefixtures("one_thread")


def longest_common_subsequence(a: list[int], b: list[int]) -> int:
    row = [0] * (len(b) + 1)
    for x in a:
        diagonal = 0
        for j, y in enumerate(b):
            diagonal, row[j + 1] = row[j + 1], diagonal + 1 if x == y else max(row[j + 1], row[j])
    return row[-1]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 5), max_size=30), st.lists(st.integers(0, 5), max_size=30), st.integers(1, 7))
def test_taken_tokens_are_a_common_subsequence(predicted: list[int], answer: list[int], step: int) -> None:
    track = PredictionTrack(predicted)
    for end in range(0, len(answer) + step, step):  # followed in pieces, as drafts are verified
        track.follow(answer[:end])
    assert track.followed == len(answer)
    assert 0 <= track.taken <= longest_common_subsequence(predicted, answer)
    assert prediction_usage(predicted, answer) == {"accepted_prediction_tokens": track.taken,
                                                   "rejected_prediction_tokens": len(predicted) - track.taken}


@settings(max_examples=300, deadline=None)
@given(st.integers(1, 60), st.data())
def test_an_edited_prediction_is_followed_through_every_edit(size: int, data: st.DataObject) -> None:
    """Distinct predicted tokens; the answer drops fewer than `NEAR` tokens between two it keeps and
    inserts tokens the prediction lacks: every predicted token the answer kept is found."""
    predicted = list(range(size))
    answer, kept, i, gap = [], 0, 0, 0
    while i < size:
        action = data.draw(st.sampled_from(["keep", "keep", "drop", "insert"]))
        if action == "keep":
            answer.append(predicted[i])
            kept, i, gap = kept + 1, i + 1, 0
        elif action == "drop":
            if gap < NEAR - 1:
                dropped = data.draw(st.integers(1, NEAR - 1 - gap))
                i, gap = i + dropped, gap + dropped
        else:
            answer.append(1000 + data.draw(st.integers(0, 50)))
    track = PredictionTrack(predicted)
    track.follow(answer)
    assert track.taken == kept == longest_common_subsequence(predicted, answer)


@pytest.mark.parametrize("kind", ["full", "hybrid"])
def test_drafting_a_prediction_keeps_the_greedy_answer(kind: str) -> None:
    target = make_target(kind)
    prompt = torch.tensor([[3, 4, 5, 6, 7, 8]])
    expected, expected_cache = plain_greedy(target, prompt, NEW_TOKENS)
    answer = expected[prompt.shape[1] :]
    edited = [*answer[:5], answer[5] ^ 1, *answer[5:12], *answer[15:]]  # a changed token, an insertion, a cut
    cases = {"right": (answer, True), "edited": (edited, True), "unrelated": ([1, 2] * 10, False)}
    for name, (predicted, pays) in cases.items():
        out = speculative_generate(target, PredictionDrafter(predicted, PromptLookupDrafter()), prompt,
                                   num_draft_tokens=8, max_new_tokens=NEW_TOKENS, draft_schedule="constant")
        assert out.sequences[0].tolist() == expected, name
        assert_same_cache(out.cache, expected_cache)
        if pays:  # most tokens came from accepted drafts: far fewer forwards than tokens
            assert out.target_forwards <= NEW_TOKENS // 2, (name, out.target_forwards)
    # a draft model behind a prediction that runs out: its cache follows the tokens it did not draft
    drafter = PredictionDrafter(answer[:5], ModelDrafter(SteeredDraft(target, "sometimes")))
    out = speculative_generate(target, drafter, prompt, num_draft_tokens=4, max_new_tokens=NEW_TOKENS)
    assert out.sequences[0].tolist() == expected and out.draft_forwards > 0
    assert_same_cache(out.cache, expected_cache)
