"""How many tokens a speculative step drafts next, and whether drafting pays at all."""

from __future__ import annotations

import bisect
import math
from collections import deque


def _median(values: deque[float]) -> float:
    """The median of a few readings (once per decoding step: `statistics.median` costs more)."""
    ordered, half = sorted(values), len(values) // 2
    return ordered[half] if len(ordered) % 2 else (ordered[half - 1] + ordered[half]) / 2


class DraftLength:
    """How many tokens to draft next: `maximum` always, or adapted to how the last drafts fared."""

    def __init__(self, maximum: int, *, adaptive: bool) -> None:
        self.maximum, self.adaptive, self.current = maximum, adaptive, maximum

    def update(self, proposed: int, accepted: int) -> None:
        if self.adaptive and proposed:
            step = 2 if accepted == proposed else -1
            self.current = max(1, min(self.maximum, self.current + step))


class ForwardCost:
    """Seconds of a target forward by the number of tokens it feeds, as the machine's current
    speed times the forward's cost ratio to a one-token forward (a plain step).

    A shared machine's speed drifts by tens of percent within a second, and a context grows:
    seconds measured a few hundred steps apart do not compare. So every forward, read against the
    ratio of its length, says how fast the machine is now (`speed`, the median of the last few
    readings): a run that drafts at every step blames a slowdown on the machine, not on drafting,
    and speed cancels out of the gate's choices. A ratio itself is sampled only against plain
    steps: a forward run within `ANCHOR` forwards of one gives its seconds over the median of the
    last few "settled" plain steps' (its length's ratio: the median of its last few samples, never
    below a plain step's 1: more tokens never cost less). A settled plain step is one that follows
    another: the first of a run is a warm-up, and one right after drafting also pays for leaving it
    (measured on the benchmark's targets: 1.1x-1.3x and 1.1x-1.2x a settled one), so its excess is
    charged to the drafting forward before it; until a settled one is in, the others serve (a
    reference too slow, but far better than none). Measured against a speed that drafting forwards
    had a say in, an underestimated ratio would confirm itself: it inflates the speed those
    forwards report, which makes the next sample as low (seen: two-token forwards priced at 0.8 of
    one-token ones for a whole run, drafting at 3% acceptance). The gate re-anchors a close call
    with two plain steps now and then (`DraftGate.REFRESH`). Once no ratio has been sampled for a
    while (no drafting), all are forgotten, so lengths measured as dear at a bad moment get tried
    again: after `QUIET` anchored forwards, then twice as many each time, up to `STALE`. A length
    is priced at the most that it or any shorter length measured (more tokens never cost less, so a
    low sample cannot make a long draft look cheaper than a short one); lengths without a ratio get
    one on a straight line through the nearest that have one (a plain step's is 1), or, while none
    has one, 1: an optimistic guess, so an unmeasured length gets tried once rather than never."""

    RECENT, ANCHOR, QUIET, STALE = 7, 4, 8, 64
    SETTLED = 3  # settled plain steps a ratio sample is read against (few: the machine drifts)

    def __init__(self) -> None:
        self.clock = 0  # anchored forwards measured so far
        self._since_plain = self.ANCHOR + 1  # forwards since the last plain step
        self._previous = 0  # tokens of the last forward (0: none yet)
        self._sampled = False  # whether the last forward gave a ratio sample
        self._left = False  # whether the last forward was a plain step that is not settled
        self._speed: deque[float] = deque(maxlen=self.RECENT)  # the last readings of a plain step's seconds
        self._settled: deque[float] = deque(maxlen=self.SETTLED)  # the last settled plain steps' seconds
        self._unsettled: deque[float] = deque(maxlen=self.SETTLED)  # the others': until a settled one is in
        self.speed: float | None = None  # their median
        self._ratios: dict[int, deque[float]] = {}  # tokens fed -> its last ratios to a plain step
        self._ratio: dict[int, float] = {1: 1.0}  # tokens fed -> its ratio, as measured
        self._envelope: dict[int, float] = {1: 1.0}  # tokens fed -> the most a length up to it measured
        self._counts: list[int] = [1]  # the lengths with a ratio, ascending
        self._sampled_at = 0  # the clock at the last ratio sample
        self._quiet = self.QUIET  # anchored forwards without a ratio sample before all are forgotten
        self.forgotten = 0  # how often they were

    def add(self, tokens: int, seconds: float) -> None:
        previous, self._previous = self._previous, tokens
        sampled, self._sampled = self._sampled, False
        self._left = tokens == 1 and previous != 1
        if tokens == 1:
            self._since_plain = 0
            if previous == 1:
                self._settled.append(seconds)
            else:
                self._unsettled.append(seconds)
                if sampled and self._settled:  # leaving drafting cost this much more: charged to the forward before
                    samples = self._ratios[previous]
                    samples[-1] += max(seconds / _median(self._settled) - 1.0, 0.0)
                    self._set_ratio(previous, _median(samples))
        else:
            self._since_plain += 1
        if self._since_plain <= self.ANCHOR and self.speed:
            self.clock += 1
            if tokens != 1:
                samples = self._ratios.setdefault(tokens, deque(maxlen=self.RECENT))
                samples.append(max(seconds / _median(self._settled or self._unsettled), 1.0))
                self._set_ratio(tokens, _median(samples))
                self._sampled_at, self._sampled = self.clock, True
            elif tokens == 1 and self.clock - self._sampled_at > self._quiet and len(self._ratio) > 1:
                self._ratios.clear()
                self._ratio, self._envelope, self._counts = {1: 1.0}, {1: 1.0}, [1]
                self.forgotten += 1
                self._sampled_at, self._quiet = self.clock, min(2 * self._quiet, self.STALE)
        if tokens == 1 or self.speed:  # a longer forward first needs a plain step to compare with
            self._speed.append(seconds / self.ratio(tokens))
            self.speed = _median(self._speed)

    def _set_ratio(self, tokens: int, ratio: float) -> None:
        """A length's measured ratio; every length is then priced at the most that it or a shorter
        one measured (more tokens never cost less: a low sample must not make a longer draft look
        cheaper than a shorter one)."""
        self._ratio[tokens] = ratio
        self._counts = sorted(self._ratio)
        highest = 0.0
        for count in self._counts:
            highest = self._envelope[count] = max(highest, self._ratio[count])

    @property
    def reference(self) -> float | None:
        """Seconds of a settled plain step, the median of the last few (None before one)."""
        return _median(self._settled) if self._settled else None

    @property
    def anchored(self) -> bool:
        """Whether a settled plain step has been measured (ratios can be sampled)."""
        return bool(self._settled)

    @property
    def leaving(self) -> bool:
        """Whether the last forward was a plain step that is not settled (a run's first, or one
        right after drafting): the next plain step would be."""
        return self._left

    @property
    def since_plain(self) -> int:
        """Forwards measured since the last plain step."""
        return self._since_plain

    def __call__(self, tokens: int) -> float | None:
        """Estimated seconds of a forward of `tokens` tokens; None before a plain step is measured."""
        return None if self.speed is None else self.speed * self.ratio(tokens)

    def ratio(self, tokens: int) -> float:
        """A forward of `tokens` tokens' cost over a plain step's."""
        known = self._envelope.get(tokens)
        if known is not None:
            return known
        counts = self._counts
        if len(counts) < 2:
            return 1.0
        at = bisect.bisect(counts, tokens)  # the nearest on each side, else the two nearest on one
        lo, hi = counts[min(max(at - 1, 0), len(counts) - 2)], counts[min(max(at, 1), len(counts) - 1)]
        low, high = self._envelope[lo], self._envelope[hi]
        return max(low + (high - low) / (hi - lo) * (tokens - lo), 1.0)


class DraftAudit:
    """Whether drafting paid, in the run's own seconds, as a check on the estimates that chose it.

    A stretch of drafting (with the plain step that leaves it, which costs more than a settled one)
    that ends in a settled plain step, as the gate ends its close calls, is priced: the tokens its
    steps emitted at a plain step's seconds measured on both sides of it (so the machine's drift in
    between cancels out), less the seconds its steps and proposals took. Once stretches of `JUDGED`
    steps in all are priced (a single probe is no evidence), their sum is judged: a loss pauses
    drafting for `PAUSE` steps, twice as long after each loss in a row (at most `LONGEST_PAUSE`),
    and a gain resets that. So an acceptance a lucky start inflated, or a cost ratio read at a bad
    moment, is overruled by what drafting earned; shadow proposals go on meanwhile. A stretch longer
    than `LONGEST` steps (a clear win, never interrupted) is not priced: the plain step before it is
    too long ago to compare with."""

    PAUSE, LONGEST_PAUSE, JUDGED, LONGEST = 16, 256, ForwardCost.QUIET, 2 * ForwardCost.QUIET

    def __init__(self) -> None:
        self.steps = 0  # steps recorded
        self.paused_until = 0  # the step drafting may resume at
        self.losses = 0  # judgements of a loss
        self._pause = self.PAUSE
        self._length = 0  # steps of the current stretch (0: none)
        self._emitted = self._seconds = 0.0  # its tokens and seconds
        self._before: float | None = None  # a settled plain step's seconds when it began
        self._priced = 0  # steps of the stretches priced since the last judgement
        self._gain = 0.0  # and the seconds they saved

    @property
    def paused(self) -> bool:
        return self.steps < self.paused_until

    def add(self, plain: bool, settled: bool, emitted: float, seconds: float, reference: float | None) -> None:
        """A step: `plain` (one token fed, no draft), `settled` (a plain step after a plain one),
        the tokens it emitted and its seconds (the drafter's included); `reference`: a settled
        plain step's seconds as measured before it."""
        self.steps += 1
        if not plain or (self._length and not settled):  # drafting, or leaving it
            if not self._length:
                self._before = reference
            self._length += 1
            self._emitted += emitted
            self._seconds += seconds
            return
        if not self._length:
            return
        if self._before is not None and self._length <= self.LONGEST:
            self._gain += self._emitted * (self._before + seconds) / 2 - self._seconds
            self._priced += self._length
        self._length, self._emitted, self._seconds = 0, 0.0, 0.0
        if self._priced >= self.JUDGED:
            if self._gain < 0:
                self.losses += 1
                self.paused_until = self.steps + self._pause
                self._pause = min(2 * self._pause, self.LONGEST_PAUSE)
            else:
                self._pause = self.PAUSE
            self._priced, self._gain = 0, 0.0


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
    forward; a shift in it (text that starts repeating) turns drafting back on. What drafting
    earned in seconds is audited against plain steps on both sides of it (`DraftAudit`): where the
    estimates chose drafts that lost, drafting pauses. The decisions depend on timing, so they
    differ between runs; greedy output does not depend on them.
    """

    #: Decay of the acceptance counts per judged token (a long memory: one unlucky draft is not
    #: evidence), and the prior they start from: an acceptance of 40% weighing half a judged token,
    #: so the first shadow proposal decides whether the first draft is tried (right: 80%, drafts
    #: start at once; wrong: 13%, below what one draft token must earn even at a plain step's price).
    ACCEPT_DECAY, PRIOR_ACCEPTANCE, PRIOR_WEIGHT = 0.97, 0.4, 0.5
    #: Shadow proposals may cost at most this fraction of a plain step's time, amortized.
    SHADOW_BUDGET = 0.02
    #: A draft must beat a plain step by this factor. The estimates come from a few samples of a
    #: machine whose step times can vary by 2x from one step to the next (a shared CPU), and a
    #: drafting step costs a little the estimate leaves out (recording, the crop); measured on the
    #: benchmark's targets, a gain the estimate puts under ~15% was as often a loss as a gain.
    MARGIN = 1.15
    #: While drafting wins by less than this factor over the margin, a run of drafting steps is
    #: interrupted by a plain step every `ForwardCost.QUIET` steps, so the ratios it relies on are
    #: sampled against a plain step again (a bigger win drafts on: it does not hinge on them).
    REFRESH = 1.3

    def __init__(self, maximum: int) -> None:
        self.maximum = maximum
        self.cost = ForwardCost()
        self.accepted, self.judged = self.PRIOR_ACCEPTANCE * self.PRIOR_WEIGHT, self.PRIOR_WEIGHT
        self.draft_seconds = 0.0  # decayed seconds and tokens of the drafter's proposals
        self.draft_tokens = 0.0
        self.refeeds = False  # the target re-feeds accepted tokens after a rejection
        self._since_shadow = 0
        # Drafts start at one token and may grow by two after each draft accepted whole: finding
        # out that drafts lose then costs one token's verify, and good drafts reach full length
        # in a few steps.
        self.ramp = 1
        self._forgotten = 0  # the cost model's count of forgotten prices, as last seen
        self.audit = DraftAudit()

    @property
    def acceptance(self) -> float:
        return self.accepted / self.judged

    def _drafter_cost(self) -> float:
        return self.draft_seconds / self.draft_tokens if self.draft_tokens else 0.0

    def budget(self, allowed: int, pending: int = 0) -> int:
        """Draft tokens for the next step, at most `allowed`, when `pending` kept tokens must be fed
        in front of it anyway: 0 until a plain step has been measured."""
        if self.cost.forgotten != self._forgotten:  # prices forgotten: probe from one token again
            self._forgotten, self.ramp = self.cost.forgotten, 1
        allowed = 0 if self.audit.paused else min(allowed, self.ramp)
        a = min(self.acceptance, 0.999)
        # no draft of any length emits MARGIN tokens per plain step's price, which every longer
        # forward costs at least: the common case where drafts do not pay, decided without pricing
        if allowed <= 0 or 1.0 / (1.0 - a) <= self.MARGIN:
            return 0
        plain = self.cost(1 + pending)
        if plain is None:
            return 0
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
        # a close call priced by ratios that no settled plain step anchored lately: anchor them,
        # with two plain steps (the first pays for leaving drafting); soon while none ever did
        anchor_every = ForwardCost.QUIET if self.cost.anchored else ForwardCost.ANCHOR
        close = best and best_rate * plain < self.REFRESH * self.MARGIN
        if close and (self.cost.since_plain >= anchor_every or self.cost.leaving):
            return 0
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
        drafted = bool(proposed) and not shadow
        self.audit.add(fed == 1, fed == 1 and not self.cost.leaving, 1 + accepted * drafted,
                       forward_seconds + draft_seconds * drafted, self.cost.reference)  # fmt: skip
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
