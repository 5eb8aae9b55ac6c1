"""How many tokens a speculative step drafts next, and whether drafting pays at all."""

from __future__ import annotations

import math

from .forward_cost import ForwardCost


class DraftLength:
    """How many tokens to draft next: `maximum` always, or adapted to how the last drafts fared."""

    def __init__(self, maximum: int, *, adaptive: bool) -> None:
        self.maximum, self.adaptive, self.current = maximum, adaptive, maximum

    def update(self, proposed: int, accepted: int) -> None:
        if self.adaptive and proposed:
            step = 2 if accepted == proposed else -1
            self.current = max(1, min(self.maximum, self.current + step))


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


def packed_tokens(counts: list[int]) -> int:
    """What a packed forward feeding `counts` tokens per row (each row's pending token and its
    draft) is priced as in a batch's cost model: one plus the draft tokens of all its rows. A row's
    draft costs what its tokens cost, whichever rows feed them: one row drafting 6 tokens in a
    batch of 8 is priced as 7, as one row of a batch of 1 drafting 6 would be, and measured so."""
    return 1 + sum(counts) - len(counts)


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
    #: A match length's own acceptance (for drafters that say which match a draft continues) starts
    #: from the overall one, weighing this many judged tokens.
    MATCH_PRIOR_WEIGHT = 2.0

    def __init__(self, maximum: int, *, packed: bool = False) -> None:
        """`packed`: a batch's verify forward computes each row's own draft, not the widest
        (`batch_width`)."""
        self.maximum, self.packed = maximum, packed
        self.cost = ForwardCost()
        self.accepted, self.judged = self.PRIOR_ACCEPTANCE * self.PRIOR_WEIGHT, self.PRIOR_WEIGHT
        self.draft_seconds = 0.0  # decayed seconds and tokens of the drafter's proposals
        self.draft_tokens = 0.0
        self.refeeds = False  # the target re-feeds accepted tokens after a rejection
        self._since_shadow = 0
        self._shadow_credit = 0.0  # a batch's shadow proposals owed, in rows (`shadow_rows`)
        self._batch_costs: dict[int, ForwardCost] = {}  # batches' cost models, by size (`batch_cost`)
        # Drafts start at one token and may grow by two after each draft accepted whole: finding
        # out that drafts lose then costs one token's verify, and good drafts reach full length
        # in a few steps.
        self.ramp = 1
        self._forgotten = 0  # the cost model's count of forgotten prices, as last seen
        self.audit = DraftAudit()
        self._by_match: dict[int, list[float]] = {}  # match length -> decayed [accepted, judged]

    @property
    def acceptance(self) -> float:
        return self.accepted / self.judged

    def acceptance_at(self, match: int) -> float:
        """The acceptance of drafts that continue a match of `match` tokens (0: of any draft).

        A suffix or n-gram drafter's long match (text seen before, followed by one token every
        time) is right far more often than a short one (common words): judged apart, a repeat is
        drafted at once in a run whose drafts mostly fail, and a run of repeats does not make the
        gate draft from short matches."""
        held = self._by_match.get(match) if match else None
        if held is None:
            return self.acceptance
        weight = self.MATCH_PRIOR_WEIGHT
        return (held[0] + weight * self.acceptance) / (held[1] + weight)

    @property
    def best_acceptance(self) -> float:
        """The highest acceptance of any match length (a proposal is worth asking for only if it pays)."""
        return max([self.acceptance_at(m) for m in self._by_match], default=self.acceptance) if self._by_match \
            else self.acceptance  # fmt: skip

    def _drafter_cost(self) -> float:
        return self.draft_seconds / self.draft_tokens if self.draft_tokens else 0.0

    def budget(self, allowed: int, pending: int = 0, match: int = 0, acceptance: float | None = None) -> int:
        """Draft tokens for the next step, at most `allowed`, when `pending` kept tokens must be fed
        in front of it anyway: 0 until a plain step has been measured. `match`: the match length
        the proposal continues (its acceptance is judged apart), or `acceptance` given outright."""
        if self.cost.forgotten != self._forgotten:  # prices forgotten: probe from one token again
            self._forgotten, self.ramp = self.cost.forgotten, 1
        allowed = 0 if self.audit.paused else min(allowed, self.ramp)
        a = min(self.acceptance_at(match) if acceptance is None else acceptance, 0.999)
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
               draft_seconds: float = 0.0, refed: bool = False, shadow: bool = False, match: int = 0,
               drafted: int | None = None) -> None:  # fmt: skip
        """A step's forward of `fed` tokens and its seconds; `proposed` draft tokens of which
        `accepted` were right, and what proposing `drafted` tokens (default `proposed`) cost
        (`shadow`: judged, not fed); `refed`: the target re-fed accepted tokens (it cannot crop
        inside a forward); `match`: the match length the draft continued (0: not said)."""
        drafting = bool(proposed) and not shadow
        self._measured(fed, forward_seconds, 1 + accepted * drafting, draft_seconds * drafting,
                       whole=drafting and accepted == proposed)  # fmt: skip
        if proposed:
            self._drafter_spent(draft_seconds, proposed if drafted is None else max(drafted, proposed))
            self._judge(proposed, accepted, match)
        self.refeeds |= refed

    def _measured(self, fed: int, forward_seconds: float, emitted: float, draft_seconds: float, whole: bool,
                  cost: ForwardCost | None = None) -> None:  # fmt: skip
        """A forward of `fed` tokens (per row) that emitted `emitted` tokens (per row); `whole`: a
        draft accepted whole (the next may grow); `cost`: the cost model it is measured in (default
        the single sequence's)."""
        cost = self.cost if cost is None else cost
        cost.add(fed, forward_seconds)
        self.audit.add(fed == 1, fed == 1 and not cost.leaving, emitted, forward_seconds + draft_seconds,
                       cost.reference)  # fmt: skip
        if whole:
            self.ramp = min(self.maximum, self.ramp + 2)

    def _drafter_spent(self, seconds: float, tokens: int) -> None:
        self.draft_seconds = self.draft_seconds * 0.8 + seconds
        self.draft_tokens = self.draft_tokens * 0.8 + tokens

    def _judge(self, proposed: int, accepted: int, match: int) -> None:
        """`accepted` of `proposed` draft tokens were right (a draft that continued a `match`)."""
        judged = accepted + (accepted < proposed)  # the tokens up to and with the first wrong one
        decay = self.ACCEPT_DECAY**judged
        if match:
            held = self._by_match.setdefault(match, [0.0, 0.0])
            held[0], held[1] = held[0] * decay + accepted, held[1] * decay + judged
        self.accepted = self.accepted * decay + accepted
        self.judged = self.judged * decay + judged

    # --------------------------------------------------------------------------- batches
    def batch_width(self, rows: list[tuple[int, int]], allowed: int, acceptance: float | None = None) -> int:
        """Draft tokens per row for a batch's next verify forward, every row's draft cut to it and
        shorter ones padded (a batch feeds one width): `rows` gives each row's offered draft as
        `(tokens, match)`. The width whose expected tokens per second, summed over the rows, is the
        highest; 0 when none beats plain steps by `MARGIN` (or while audited losses pause).
        `acceptance`: one for every row, instead of each match length's. A `packed` gate's
        forwards compute each row's own tokens only (a model that `packs_rows`), so a width costs
        what the draft tokens it feeds cost (`packed_tokens`), not the padded rectangle. Whether to
        draft is decided by the best width the offered drafts allow; the width fed is then at most
        the ramp (`budget`'s: a first try costs one token), which grows as drafts are accepted whole
        (a width of one token may not pay where the whole does: one row of eight drafting)."""
        most = max((n for n, _ in rows), default=0)
        allowed = 0 if self.audit.paused else min(allowed, most)
        cost = self.batch_cost(len(rows))
        plain = cost(1)
        if allowed <= 0 or plain is None:
            return 0
        # rows alike (offered tokens, acceptance) priced together: a step's pricing is O(width x kinds)
        kinds: dict[tuple[int, float], int] = {}
        for n, match in rows:
            key = (n, min(self.acceptance_at(match) if acceptance is None else acceptance, 0.999))
            kinds[key] = kinds.get(key, 0) + 1
        groups = sorted(([n, a, count, 1.0] for (n, a), count in kinds.items()), reverse=True)  # [n, a, rows, a^k]
        best, best_rate = 0, self.MARGIN * len(rows) / max(plain, 1e-9)
        emitted, fed, drafting = float(len(rows)), 1, len(groups)
        for k in range(1, allowed + 1):
            while groups[drafting - 1][0] < k:  # (allowed <= the most offered: some group drafts)
                drafting -= 1
            for group in groups[:drafting]:
                group[3] *= group[1]
                emitted += group[2] * group[3]
                fed += group[2]  # packed: every row still drafting feeds one more token
            rate = emitted / cost(fed if self.packed else 1 + k)  # type: ignore[operator]
            if rate > best_rate:
                best, best_rate = k, rate
        anchor_every = ForwardCost.QUIET if cost.anchored else ForwardCost.ANCHOR
        close = best and best_rate * plain < self.REFRESH * self.MARGIN * len(rows)
        if close and (cost.since_plain >= anchor_every or cost.leaving):
            return 0
        return min(best, self.ramp)

    def batch_cost(self, rows: int) -> ForwardCost:
        """The cost model of batches of about `rows` rows (1, 2-3, 4-7, ...: one per power of two).
        What a wider forward costs over a plain step depends on the batch: for one row of a small
        model, a forward's fixed cost dominates (9 tokens measured 1.2x one); for 32 rows its
        arithmetic does (3 tokens a row measured 2x one)."""
        return self._batch_costs.setdefault(max(rows, 1).bit_length(), ForwardCost())

    def worth_asking(self, rows: int, allowed: int) -> bool:
        """Whether a batch of `rows` could draft at all: some width pays at the best acceptance
        any match length has earned (else only shadows are asked for, `shadow_rows`)."""
        return self.batch_width([(allowed, 0)] * rows, allowed, acceptance=self.best_acceptance) > 0

    def shadow_rows(self, rows: int) -> int:
        """How many of a batch's `rows` are asked for a one-token shadow proposal at this plain step,
        so that shadows cost `SHADOW_BUDGET` of plain steps' time (all rows until the drafter's cost
        is measured; a fraction of a row carries over to the next step)."""
        plain = self.batch_cost(rows)(1)
        if plain is None or not self.draft_tokens:
            return rows
        self._shadow_credit += self.SHADOW_BUDGET * plain / max(self._drafter_cost(), 1e-9)
        asked = min(int(self._shadow_credit), rows)
        self._shadow_credit = min(self._shadow_credit - asked, 1.0)
        return asked

    def record_batch(self, width: int, forward_seconds: float, judged: list[tuple[int, int, int]], emitted: int,
                     draft_seconds: float, drafted: int, fed: int | None = None) -> None:  # fmt: skip
        """A batch's verify forward of `width` draft tokens per row (0: a plain step) and its
        seconds; `judged`: each row's `(proposed, accepted, match)` (shadows included: a plain
        step's offered first tokens), `emitted` tokens in all, and proposing `drafted` tokens took
        `draft_seconds`; `fed`: the tokens per row it is priced as (a packed forward's
        `packed_tokens`; default `1 + width`)."""
        rows = max(len(judged), 1)
        whole = bool(width) and any(p and a == p for p, a, _ in judged)  # a row's draft was right: may grow
        self._measured(fed or 1 + width, forward_seconds, emitted / rows, draft_seconds if width else 0.0, whole,
                       self.batch_cost(len(judged)))  # fmt: skip
        if drafted:
            self._drafter_spent(draft_seconds, drafted)
        for proposed, accepted, match in judged:
            if proposed:
                self._judge(proposed, accepted, match)
