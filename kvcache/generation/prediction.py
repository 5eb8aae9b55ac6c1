"""Predicted outputs (OpenAI's `prediction`): a text the answer is expected to largely repeat (a
file being edited, a document being revised) drafts the answer, and the target verifies it.

`PredictionTrack` follows where the answer is in the predicted tokens: each answer token that is
the next predicted one moves it on. One that is not (the answer inserted, dropped or changed
something) moves it after the nearest later occurrence of the answer's last three, two or one
tokens (the nearest of the three; a single token only within `NEAR` tokens: a common token far
ahead is noise); with none later, after the nearest earlier occurrence of the last three or two
(the answer repeats itself); else it stays (an insertion: the prediction picks up again after
it). A wrong guess is corrected by the next tokens. The predicted tokens it counts as taken have
increasing positions, so they are a common subsequence of prediction and answer: OpenAI's
accepted prediction tokens. Following costs O(1) per answer token that follows the prediction and
at most O(`SCAN`) per one that does not (an index of each token's positions, built once: about a
millisecond for 8k tokens, where one of every n-gram took 7-100 ms on the engine thread).

`PredictionDrafter` drafts the prediction's next tokens from there, unless another drafter
(prompt lookup; a draft model, which says no match) continues a longer match than the answer's
latest run of predicted tokens, or this prediction's drafts were mostly wrong so far (a record of
each draft against what the answer then did), or the prediction has nothing left. Measured on the
bundled model (24 rewrite requests, one schedule per contender across them): against prompt
lookup alone, 1.76x with the answer predicted, 1.27x with every eighth word changed, 0.995x with
unrelated text (0.62x before the record: a prediction drafted wherever one token matched by chance). Drafts are point
masses verified like any other, so the answer is the target's own, token for token.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence

import torch

from ..cache import Cache
from .drafters import Draft, Drafter, DraftPicker

#: `Draft.match` of a prediction's drafts, plus the answer tokens just before that followed the
#: prediction in a row (at most `RUN_CAP`): the schedule judges each apart (from lookups' too), so
#: a prediction the answer keeps to drafts long, one it just left (or never took) hardly at all.
PREDICTED_MATCH = 1 << 20
RUN_CAP = 16
#: A single token re-aligns the track only this close ahead (a common token far ahead is noise).
NEAR = 16
#: The most positions of a token a re-alignment looks at each way from the cursor.
SCAN = 512
#: Past the answer's start, the prediction drafts once this many answer tokens in a row followed it.
MIN_RUN = 1


class PredictionTrack:
    """Where an answer is in a predicted token list (see the module's docstring)."""

    def __init__(self, predicted: Sequence[int]) -> None:
        self.predicted = [int(t) for t in predicted]
        self.cursor = 0  # the predicted token the answer's next token is expected to be
        self.taken = 0  # answer tokens counted as predicted ones (at increasing positions)
        self.followed = 0  # answer tokens followed so far
        self.run = 0  # the last answer tokens that followed the prediction in a row (to the cursor)
        self._last_taken = -1  # the position of the last predicted token counted
        self._at: dict[int, list[int]] = {}  # token -> its positions in the prediction, in order
        for position, token in enumerate(self.predicted):
            self._at.setdefault(token, []).append(position)

    def follow(self, answer: Sequence[int]) -> None:
        """Catch up with `answer` (the answer so far: what was followed before, and more)."""
        for end in range(self.followed, len(answer)):
            token = int(answer[end])
            at = self.cursor if self.cursor < len(self.predicted) and self.predicted[self.cursor] == token else None
            self.run = self.run + 1 if at is not None else 0
            if at is None:
                at, self.run = self._realigned(answer, end)
            if at is None:
                continue
            self.cursor = at + 1
            if at > self._last_taken:
                self.taken, self._last_taken = self.taken + 1, at
        self.followed = len(answer)

    def _realigned(self, answer: Sequence[int], end: int) -> tuple[int | None, int]:
        """Where in the prediction the answer's token `end` (not the one expected) stands, if found,
        and how many answer tokens that found. The candidates are the token's positions, nearest
        first, at most `SCAN` of them each way (a bound on a very common token's cost)."""
        positions = self._at.get(int(answer[end]), [])
        i = bisect_left(positions, self.cursor)
        later, earlier = [], []
        for n in (3, 2, 1):
            if end + 1 < n:
                continue
            gram = [int(t) for t in answer[end + 1 - n : end + 1]]
            ahead = next((e for e in positions[i : i + SCAN]
                          if self.predicted[max(e + 1 - n, 0) : e + 1] == gram), None)  # fmt: skip
            if ahead is not None and (n > 1 or ahead - self.cursor < NEAR):
                later.append((ahead - self.cursor, -n, ahead))
            behind = next((e for e in reversed(positions[max(i - SCAN, 0) : i]) if n > 1
                           and self.predicted[max(e + 1 - n, 0) : e + 1] == gram), None)  # fmt: skip
            if behind is not None:
                earlier.append((self.cursor - behind, -n, behind))
        found = min(later) if later else min(earlier) if earlier else None
        return (None, 0) if found is None else (found[2], -found[1])

    def next_tokens(self, count: int) -> list[int]:
        """Up to `count` predicted tokens from the cursor on."""
        return self.predicted[self.cursor : self.cursor + max(count, 0)]


class PredictionDrafter(Drafter):
    """Drafts a request's predicted tokens where the answer is in them, else asks `fallback`."""

    def __init__(self, predicted: Sequence[int], fallback: Drafter | None = None) -> None:
        self.track = PredictionTrack(predicted)
        self.fallback = fallback
        self.reports_match = fallback is None or fallback.reports_match
        self.samples = fallback is not None and fallback.samples
        self._prompt_length = 0
        # how right this prediction's drafts were: predicted tokens the answer took of those judged
        # (a prior of one in two), and the last draft, not yet judged: (answer length, its tokens)
        self.right, self.judged = self.PRIOR_RIGHT, 2 * self.PRIOR_RIGHT
        self._last: tuple[int, list[int]] | None = None

    #: The prior weight of the drafts' record (half of it right).
    PRIOR_RIGHT = 1.0

    @property
    def doubtful(self) -> bool:
        """Whether most of this prediction's drafts were wrong so far."""
        return 2 * self.right < self.judged

    @property
    def forwards(self) -> int:  # type: ignore[override]
        return self.fallback.forwards if self.fallback is not None else 0

    @property
    def cache(self) -> Cache | None:
        return self.fallback.cache if self.fallback is not None else None

    def start(self, prompt: Sequence[int], *, device: torch.device, **encoder: torch.Tensor | None) -> None:
        self._prompt_length = len(prompt)
        if self.fallback is not None:
            self.fallback.start(prompt, device=device, **encoder)

    def propose(self, sequence: Sequence[int], num_tokens: int, pick: DraftPicker) -> Draft:
        if num_tokens <= 0:
            return Draft([])
        answer = sequence[self._prompt_length :]
        self.track.follow(answer)
        self._judge(answer)
        # from the answer's start, or where its last token was a predicted one (after a token the
        # prediction lacks, its next tokens are rarely the answer's)
        following = self.track.followed == 0 or self.track.run >= MIN_RUN
        predicted = self.track.next_tokens(num_tokens) if following else []
        fallback = self.fallback
        # not deep in the prediction: a lookup's draft where it continues a longer match, or where
        # this prediction's drafts were mostly wrong (a model's drafts, which cost a forward and
        # say no match, only where the prediction has none)
        if fallback is not None and (not predicted or (fallback.reports_match and self.track.run < RUN_CAP)):
            other = fallback.propose(sequence, num_tokens, pick)
            if other.tokens and (not predicted or self.doubtful or other.match > self.track.run):
                return other
        if not predicted:
            return Draft([])
        self._last = (len(answer), predicted)
        return Draft(predicted, match=PREDICTED_MATCH + min(self.track.run, RUN_CAP))

    def _judge(self, answer: Sequence[int]) -> None:
        """Score the last prediction draft against what the answer did after it."""
        if self._last is None:
            return
        at, drafted = self._last
        took = answer[at : at + len(drafted)]
        right = next((i for i, (a, b) in enumerate(zip(took, drafted, strict=False)) if a != b), len(took))
        self.right += right
        self.judged += right + (right < len(took))  # (the first wrong token, where there was one)
        self._last = None

    def accept(self, sequence: Sequence[int]) -> str:
        return self.fallback.accept(sequence) if self.fallback is not None else Drafter.accept(self, sequence)


def prediction_usage(predicted: Sequence[int], answer: Sequence[int]) -> dict[str, int]:
    """OpenAI's `completion_tokens_details` of a predicted answer: the predicted tokens that
    appeared in it (as `PredictionTrack` follows it) and those that did not."""
    track = PredictionTrack(predicted)
    track.follow(answer)
    return {"accepted_prediction_tokens": track.taken, "rejected_prediction_tokens": len(predicted) - track.taken}
