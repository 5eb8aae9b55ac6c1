"""Drafting from what followed the current context before, in earlier requests and in this one.

`SuffixCorpus` keeps, for every context of 1 to `max_depth` tokens that occurred in the sequences
it was fed, how often each token followed it: a suffix trie cut at depth `max_depth`, stored flat
(one dict entry per context, keyed by the context's tokens). Feeding a sequence costs
O(length x depth); whole sequences are forgotten least recently fed first once the corpus holds
more than `max_tokens` tokens, so memory stays within a budget. A `SuffixDrafter` looks up the
longest suffix of the current sequence the corpus (or the sequence itself) has seen, proposes the
most frequent continuation, and goes on from the proposal while the continuation stays likely
enough: the draft is as long as the match is confident, and a proposal costs O(draft length x
depth) whatever the corpus size. Several drafters (one per request or batch row) share one corpus.

A match deeper than `max_depth` matters most where an answer begins: its first tokens follow the
prompt's last few tokens, which many prompts share ("Call: "), while what the answer depends on
lies further back. So the corpus also keys each answer by its prompt's last `answer_context`
tokens (SuffixDecoding's tree holds whole prompts and answers, so its deepest match finds the
same), and a request whose prompt ends as an earlier one did first follows that answer, as long
as what it decodes agrees with it; then the counts take over. Requests in flight together count
as earlier ones for each other: a drafter that starts while another decodes an answer to the same
prompt ending follows that answer as far as it has got (a server's concurrent clients often send
the same call; a corpus fed only when requests finish would make each wait for its own answer).
"""

from __future__ import annotations

import copy
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import torch

from ..errors import GenerationError
from .continuation_counts import Context, ContinuationCounts
from .drafters import Draft, Drafter, DraftPicker

#: Answers kept per prompt ending (the most recent), for `SuffixCorpus.answers_after`.
ANSWERS_PER_PROMPT = 4


def _check_positive(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise GenerationError(f"{name} must be a positive int, got {value!r}")
    return value


class SuffixCorpus:
    """Continuation counts over the sequences fed to it (previous requests' answers, and their
    prompts with `prompts=True`), at most `max_tokens` tokens of them (the least recently fed
    sequences are forgotten first). Memory: about 0.7 KB per token held at depth 8
    (`benchmarks/suffix.py`), 70 MB by default.

    By default only what followed in answers is counted (a context may reach back into its prompt's
    last `max_depth` tokens, so an answer's first tokens are drafted from how its prompt ended), as
    SuffixDecoding's global tree holds outputs only: the drafter reads the current prompt itself,
    and counting every prompt again costs most of the feeding (an agent's prompts are several times
    its answers) for drafts of prompt text that answers rarely repeat (`benchmarks/suffix.py`)."""

    def __init__(self, max_depth: int = 8, max_tokens: int = 100_000, *, prompts: bool = False,
                 answer_context: int = 256) -> None:  # fmt: skip
        self.max_depth = _check_positive("max_depth", max_depth)
        self.max_tokens = _check_positive("max_tokens", max_tokens)
        self.answer_context = _check_positive("answer_context", answer_context)
        if not isinstance(prompts, bool):
            raise GenerationError(f"prompts must be True or False, got {prompts!r}")
        self.prompts = prompts
        self._counts = ContinuationCounts(max_depth)
        self._sequences: OrderedDict[int, tuple[list[int], int]] = OrderedDict()
        # hash of a prompt's last `answer_context` tokens -> {sequence id: where its answer starts in it}
        self._answers: dict[int, dict[int, int]] = {}
        self._answer_key: dict[int, int] = {}  # sequence id -> its prompt's key there
        # prompt key -> the drafters decoding an answer to a prompt ending so now (`SuffixDrafter.start`)
        self._live: dict[int, weakref.WeakSet[SuffixDrafter]] = {}
        self._next_id = 0
        self.tokens = 0

    def __len__(self) -> int:
        """Sequences held."""
        return len(self._sequences)

    def add(self, tokens: Sequence[int], prompt_length: int = 0) -> None:
        """Feed one sequence (a finished request's prompt, its first `prompt_length` tokens, and its
        answer); forget the oldest ones past the budget. What followed inside the prompt is counted
        only with `prompts=True`: otherwise the corpus keeps the answer and the `max_depth` prompt
        tokens before it."""
        if isinstance(prompt_length, bool) or not isinstance(prompt_length, int) or prompt_length < 0:
            raise GenerationError(f"prompt_length must be a non-negative int, got {prompt_length!r}")
        counted = 0 if self.prompts else min(prompt_length, len(tokens))
        first = max(counted - self.max_depth, len(tokens) - self.max_tokens, 0)
        kept, counted = [int(t) for t in tokens[first:]], max(counted - first, 1)
        if len(kept) <= counted:
            return
        self._counts.add(kept, start=counted)
        self._sequences[self._next_id] = kept, counted
        if 0 < prompt_length < len(tokens) and first <= prompt_length:
            tail = [int(t) for t in tokens[max(prompt_length - self.answer_context, 0) : prompt_length]]
            self._index_answer(self._next_id, tail, prompt_length - first)
        self._next_id += 1
        self.tokens += len(kept)
        while self.tokens > self.max_tokens:
            oldest_id, (oldest, start) = self._sequences.popitem(last=False)
            self._counts.add(oldest, start=start, sign=-1)
            self._forget_answer(oldest_id)
            self.tokens -= len(oldest)

    def _prompt_key(self, prompt: Sequence[int]) -> int:
        tail = prompt[-self.answer_context :]
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in tail):
            raise GenerationError(f"a prompt must be a list of token ids, got {list(tail)[:8]!r}"[:200])
        return hash(tuple(tail))

    def _index_answer(self, sequence_id: int, prompt: Sequence[int], answer_start: int) -> None:
        key = self._prompt_key(prompt)
        held = self._answers.setdefault(key, {})
        held[sequence_id] = answer_start
        self._answer_key[sequence_id] = key
        if len(held) > ANSWERS_PER_PROMPT:  # the oldest answer leaves the index (its counts stay)
            self._forget_answer(next(iter(held)))

    def _forget_answer(self, sequence_id: int) -> None:
        key = self._answer_key.pop(sequence_id, None)
        if key is not None:
            held = self._answers[key]
            del held[sequence_id]
            if not held:
                del self._answers[key]

    def answers_after(self, prompt: Sequence[int]) -> list[list[int]]:
        """The answers held of earlier requests whose prompt ended with the same `answer_context`
        tokens as `prompt` (most recent first)."""
        held = self._answers.get(self._prompt_key(prompt), {})
        return [self._sequences[i][0][start:] for i, start in reversed(held.items())]

    def _enter(self, drafter: SuffixDrafter, key: int) -> list[SuffixDrafter]:
        """Register `drafter` as decoding an answer after prompt key `key`: the others already there."""
        live = self._live.setdefault(key, weakref.WeakSet())
        others = list(live)
        live.add(drafter)
        return others

    def _leave(self, drafter: SuffixDrafter, key: int | None) -> None:
        live = self._live.get(key) if key is not None else None
        if live is not None:
            live.discard(drafter)
            if not live:
                del self._live[key]

    def get(self, context: Context) -> dict[int, int] | None:
        return self._counts.get(context)

    def seen(self, context: Context) -> bool:
        return self._counts.seen(context)


class _Answer:
    """An answer a drafter follows: `tokens[start:]`, still growing while its `owner` (another
    drafter, None for a finished answer) decodes into that very list; `checked` of its tokens were
    found equal to what the follower decoded."""

    __slots__ = ("checked", "owner", "start", "tokens")

    def __init__(self, tokens: list[int], start: int, owner: SuffixDrafter | None = None) -> None:
        self.tokens, self.start, self.owner, self.checked = tokens, start, owner, 0

    @property
    def growing(self) -> bool:
        owner = self.owner
        return owner is not None and owner._key is not None and owner._tokens is self.tokens


class SuffixDrafter(Drafter):
    """Proposes what most often followed the longest matching suffix of the sequence so far, in
    the shared `corpus` and in the sequence itself (see the module docstring). Each proposed token
    is the most frequent continuation of the longest context (at least `min_match` tokens) that
    was seen; drafting stops where that continuation followed less than `min_share` of the times,
    and after `per_match` tokens per token of the match the draft starts from (SuffixDecoding's
    rule: a short match, common text, earns a short draft; a long one, a repeat, a long draft); a
    match of the corpus's whole `max_depth` is not limited (a repeat goes on as far as it is
    confident). Where the prompt ends as an earlier request's did, the earlier answer that agrees
    with what was decoded so far is proposed first (`SuffixCorpus.answers_after`: a match of the
    whole prompt ending, reported as `max_depth + 1`), as is the answer another drafter of the
    corpus is decoding to such a prompt, as far as it has got.
    `start` feeds the sequence a previous `start` began (its prompt and what was decoded since) to
    the corpus, so answers of earlier requests help later ones; `finish` does that explicitly."""

    reports_match = True

    def __init__(
        self,
        corpus: SuffixCorpus | None = None,
        *,
        min_match: int = 2,
        min_share: float = 0.3,
        per_match: float = 1.0,
    ) -> None:
        self.corpus = corpus if corpus is not None else SuffixCorpus()
        self.min_match = _check_positive("min_match", min_match)
        if not 0.0 <= min_share <= 1.0:
            raise GenerationError(f"min_share must be in [0, 1], got {min_share!r}")
        self.min_share = min_share
        if isinstance(per_match, bool) or not isinstance(per_match, (int, float)) or not per_match > 0:
            raise GenerationError(f"per_match must be a positive number, got {per_match!r}")
        self.per_match = float(per_match)
        self._reset_own()
        self._tokens: list[int] = []
        self._prompt_length = 0
        self._answers: list[_Answer] = []  # earlier answers to a prompt that ended as this one does
        self._key: int | None = None  # that prompt ending's key, while registered in the corpus

    def __deepcopy__(self, memo: dict[int, Any]) -> SuffixDrafter:
        """A batch copies the drafter per row: each row gets its own sequence, the corpus is shared."""
        twin = copy.copy(self)
        twin._reset_own()
        twin._tokens, twin._prompt_length = [], 0
        twin._answers, twin._key = [], None
        return twin

    def start(self, prompt: Sequence[int], *, device: torch.device, **kwargs: Any) -> None:
        self.finish()
        self._tokens = []
        self._catch_up(prompt)
        self._prompt_length = len(self._tokens)
        self._answers = [_Answer(a, 0) for a in self.corpus.answers_after(self._tokens)]
        if self._tokens:
            self._key = self.corpus._prompt_key(self._tokens)
            self._answers += [_Answer(d._tokens, d._prompt_length, d) for d in self.corpus._enter(self, self._key)]

    def finish(self) -> None:
        """Feed the sequence so far (its prompt and answer) to the corpus (once) and forget it."""
        self.leave()
        if self._tokens:
            self.corpus.add(self._tokens, self._prompt_length)
        self._tokens, self._prompt_length = [], 0
        self._reset_own()

    def leave(self) -> None:
        """Stop offering this answer to other drafters as one being decoded (its request ended;
        a server feeds the finished answer to the corpus itself)."""
        self.corpus._leave(self, self._key)
        self._key, self._answers = None, []

    def _catch_up(self, sequence: Sequence[int]) -> None:
        done = len(self._tokens)
        if len(sequence) < done or list(sequence[max(done - 1, 0) : done]) != self._tokens[max(done - 1, 0) :]:
            self.leave()
            self._reset_own()
            self._tokens, done = [], 0
            self._prompt_length = 0  # a sequence of its own: fed whole
        self._tokens.extend(int(t) for t in sequence[done:])

    def _reset_own(self) -> None:
        self._own, self._counted = ContinuationCounts(self.corpus.max_depth), 0

    def _own_counts(self) -> dict[int, int | dict[int, int]]:
        """The sequence's own continuation counts, brought up to date: counted when drafting from
        counts needs them, so a row that follows an earlier answer never counts its prompt."""
        if self._counted < len(self._tokens):
            self._own.add(self._tokens, start=max(self._counted, 1))
            self._counted = len(self._tokens)
        return self._own.counts

    def propose(self, sequence: Sequence[int], num_tokens: int, pick: DraftPicker) -> Draft:
        if num_tokens <= 0:
            return Draft([])
        self._catch_up(sequence)
        depth = self.corpus.max_depth
        following = self._earlier_answer(num_tokens)
        if following:
            return Draft(following, match=depth + 1)
        context = self._tokens[-depth:]
        drafted: list[int] = []
        longest = len(context)  # the longest seen suffix is at most this long
        limit, match = num_tokens, 0
        while len(drafted) < limit:
            n, key = self._longest_seen(context, longest)
            choice = None if n == 0 else self._most_frequent(key)
            if choice is None:
                break
            if not drafted:  # a match of the corpus's whole depth is a repeat: drafted as far as it goes
                limit = num_tokens if n >= depth else min(num_tokens, max(1, int(self.per_match * n)))
                match = n
            drafted.append(choice)
            context = [*context, choice][-depth:]
            longest = min(n + 1, len(context))  # context + choice was followed by something only if context was
        return Draft(drafted, match=match)

    def _earlier_answer(self, most: int) -> list[int]:
        """Up to `most` tokens that follow the decoded ones in the earlier answers (to a prompt that
        ended as this one) that agree with them, the most common such, [] if none: each decoded
        token is checked once per answer. An answer still being decoded is kept while it agrees,
        even while it is behind this one (it may be ahead again after a step)."""
        if not self._answers:
            return []
        ours, decoded = self._prompt_length, len(self._tokens) - self._prompt_length
        kept, votes = [], {}
        for answer in self._answers:
            upto = min(decoded, len(answer.tokens) - answer.start)
            theirs, done = answer.start, answer.checked
            if answer.tokens[theirs + done : theirs + upto] != self._tokens[ours + done : ours + upto]:
                continue
            answer.checked = upto
            if upto < decoded and not answer.growing:
                continue
            kept.append(answer)
            rest = tuple(answer.tokens[theirs + decoded : theirs + decoded + most])
            if rest:
                votes[rest] = votes.get(rest, 0) + 1
        self._answers = kept
        return list(max(votes.items(), key=lambda item: item[1])[0]) if votes else []

    def _seen(self, key: int) -> bool:
        return key in self.corpus._counts.counts or key in self._own_counts()

    def _longest_seen(self, context: list[int], at_most: int) -> tuple[int, int]:
        """The length of the longest suffix of `context` (of `min_match` to `at_most` tokens) seen as a
        context, 0 if none. A context is counted with all its suffixes, so "seen" is monotone in the
        length: one lookup when the longest is `at_most` (the usual case while a draft follows the
        corpus), a binary search of about log2(depth) lookups otherwise, whatever the corpus size.
        Returned with that context's key."""
        low, high = self.min_match, at_most
        if high < low:
            return 0, 0
        key = hash(tuple(context[-high:]))
        if self._seen(key):
            return high, key
        found, found_key = 0, 0
        high -= 1
        while low <= high:
            mid = (low + high) // 2
            key = hash(tuple(context[-mid:]))
            if self._seen(key):
                found, found_key, low = mid, key, mid + 1
            else:
                high = mid - 1
        return found, found_key

    def _most_frequent(self, key: int) -> int | None:
        """The most frequent continuation of the seen context of key `key`, if it followed at least
        `min_share` of the times (None otherwise)."""
        ours, own = self.corpus._counts.counts.get(key), self._own_counts().get(key)
        if isinstance(ours, int) and own is None:  # one token ever followed it: the usual case
            return ours & 0xFFFFFFFF
        merged: dict[int, int] = {}
        for held in (ours, own):
            table = {held & 0xFFFFFFFF: held >> 32} if isinstance(held, int) else (held or {})
            for token, count in table.items():
                merged[token] = merged.get(token, 0) + count
        if not merged:
            return None
        token, count = max(merged.items(), key=lambda item: (item[1], -item[0]))
        return token if count >= self.min_share * sum(merged.values()) else None
