"""How many tokens a speculative step drafts next, and whether drafting pays at all."""

from __future__ import annotations

import bisect
import math
import statistics
from collections import deque


class DraftLength:
    """How many tokens to draft next: `maximum` always, or adapted to how the last drafts fared."""

    def __init__(self, maximum: int, *, adaptive: bool) -> None:
        self.maximum, self.adaptive, self.current = maximum, adaptive, maximum

    def update(self, proposed: int, accepted: int) -> None:
        if self.adaptive and proposed:
            step = 2 if accepted == proposed else -1
            self.current = max(1, min(self.maximum, self.current + step))


class ForwardCost:
    """Seconds of a target forward by the number of tokens it feeds: the median of the last few
    measured per count (a shared machine's hiccups do not move it, and it follows a growing
    context), a straight line through the nearest measured counts between and beyond them, and
    (while only one count is measured) the same cost for every count: an optimistic guess, so an
    unmeasured draft length gets tried once rather than never."""

    RECENT = 7

    def __init__(self) -> None:
        self._samples: dict[int, deque[float]] = {}  # tokens fed -> the last RECENT seconds
        self._median: dict[int, float] = {}  # tokens fed -> the median of those
        self._counts: list[int] = []  # the measured counts, ascending

    def add(self, tokens: int, seconds: float) -> None:
        samples = self._samples.get(tokens)
        if samples is None:
            samples = self._samples[tokens] = deque(maxlen=self.RECENT)
            self._counts = sorted(self._samples)
        samples.append(seconds)
        self._median[tokens] = statistics.median(samples)

    def measured(self, tokens: int) -> bool:
        return tokens in self._median

    def __call__(self, tokens: int) -> float | None:
        """Estimated seconds of a forward of `tokens` tokens; None before any measurement."""
        known = self._median.get(tokens)
        if known is not None:
            return known
        counts = self._counts
        if len(counts) < 2:
            return self._median[counts[0]] if counts else None
        at = bisect.bisect(counts, tokens)  # the nearest on each side, else the two nearest on one
        lo, hi = counts[min(max(at - 1, 0), len(counts) - 2)], counts[min(max(at, 1), len(counts) - 1)]
        low, high = self._median[lo], self._median[hi]
        return max(low + (high - low) / (hi - lo) * (tokens - lo), 0.0)


class DraftGate:
    """How many tokens the next step drafts, chosen by expected tokens per second, measured in
    this run (the default schedule for greedy decoding).

    A draft of k tokens, each right with probability a given the ones before, emits
    `1 + a + ... + a^k` tokens for a forward of `k` more tokens (plus the drafter's own work, and
    on a target that cannot crop inside a forward, accepted tokens fed again next step). The gate
    measures what forwards cost by the tokens they feed (`ForwardCost`), what the drafter costs
    per proposed token, and the acceptance `a` (a decayed count of draft tokens accepted against
    those judged, starting from one of each), and drafts the k that maximizes tokens per second,
    or none when no k beats a plain step. While not drafting, a drafter cheap enough is asked for
    a one-token "shadow" proposal before each plain step (every few steps otherwise) and judged
    against the token the target then emits, so the acceptance stays current without a verify
    forward; a shift in it (text that starts repeating) turns drafting back on. The decisions depend
    on timing, so they differ between runs; greedy output does not depend on them.
    """

    #: Decay of the acceptance counts per judged token (a long memory: one unlucky draft is not
    #: evidence), and the prior they start from (half a token accepted of one judged).
    ACCEPT_DECAY, PRIOR = 0.97, 0.5
    #: Shadow proposals may cost at most this fraction of a plain step's time, amortized.
    SHADOW_BUDGET = 0.02
    #: A draft must beat a plain step by this factor: the estimates are noisy, and a draft that
    #: would win by less risks more than it gains.
    MARGIN = 1.05

    def __init__(self, maximum: int) -> None:
        self.maximum = maximum
        self.cost = ForwardCost()
        self.accepted, self.judged = self.PRIOR, 2 * self.PRIOR
        self.draft_seconds = 0.0  # decayed seconds and tokens of the drafter's proposals
        self.draft_tokens = 0.0
        self.refeeds = False  # the target re-feeds accepted tokens after a rejection
        self._since_shadow = 0
        # Drafts start at one token and may grow by two after each draft accepted whole: finding
        # out that drafts lose then costs one token's verify, and good drafts reach full length
        # in a few steps.
        self.ramp = 1

    @property
    def acceptance(self) -> float:
        return self.accepted / self.judged

    def _drafter_cost(self) -> float:
        return self.draft_seconds / self.draft_tokens if self.draft_tokens else 0.0

    def budget(self, allowed: int, pending: int = 0) -> int:
        """Draft tokens for the next step, at most `allowed`, when `pending` kept tokens must be fed
        in front of it anyway: 0 until a plain step has been measured."""
        allowed = min(allowed, self.ramp)
        if allowed <= 0:
            return 0
        plain = self.cost(1 + pending)
        if plain is None:
            return 0
        a = min(self.acceptance, 0.999)
        slope = self._slope() if self.refeeds else 0.0
        drafter = self._drafter_cost()
        best, best_rate = 0, self.MARGIN / max(plain, 1e-9)
        tokens = refed = 0.0
        for k in range(1, allowed + 1):
            tokens += a**k  # the step emits 1 + a + ... + a^k tokens, expected
            # on a re-feeding target, j accepted then a rejection leaves this forward's p + 1 + j
            # kept tokens to be fed again next step (here the term of j = k - 1)
            refed += a ** (k - 1) * (1 - a) * (pending + k)
            seconds = self.cost(1 + pending + k) + k * drafter + slope * refed  # type: ignore[operator]
            if (1 + tokens) / seconds > best_rate:
                best, best_rate = k, (1 + tokens) / seconds
        return best

    def _slope(self) -> float:
        """Seconds per extra token fed in a forward, from the cost curve (0 while unknown)."""
        one, more = self.cost(1), self.cost(1 + self.maximum)
        return 0.0 if one is None or more is None else max(more - one, 0.0) / self.maximum

    def shadow(self) -> bool:
        """Whether to ask the drafter for a one-token proposal before this plain step (judged
        against the token the target emits): always for a drafter whose proposals are cheap, else
        every few steps so that shadows cost `SHADOW_BUDGET` of plain steps' time."""
        plain = self.cost(1)
        if plain is None or not self.draft_tokens:
            return True
        every = math.ceil(self._drafter_cost() / (self.SHADOW_BUDGET * plain))
        self._since_shadow += 1
        if self._since_shadow >= every:
            self._since_shadow = 0
            return True
        return False

    def record(self, fed: int, forward_seconds: float, proposed: int = 0, accepted: int = 0,
               draft_seconds: float = 0.0, refed: bool = False, shadow: bool = False) -> None:  # fmt: skip
        """A step's forward of `fed` tokens and its seconds; `proposed` draft tokens of which
        `accepted` were right, and what proposing cost (`shadow`: judged, not fed); `refed`: the
        target re-fed accepted tokens (it cannot crop inside a forward)."""
        self.cost.add(fed, forward_seconds)
        if proposed and not shadow and accepted == proposed:
            self.ramp = min(self.maximum, self.ramp + 2)
        if proposed:
            self.draft_seconds = self.draft_seconds * 0.8 + draft_seconds
            self.draft_tokens = self.draft_tokens * 0.8 + proposed
            judged = accepted + (accepted < proposed)  # the tokens up to and with the first wrong one
            decay = self.ACCEPT_DECAY**judged
            self.accepted = self.accepted * decay + accepted
            self.judged = self.judged * decay + judged
        self.refeeds |= refed
