"""How many tokens a speculative step drafts next, and whether drafting pays at all."""

from __future__ import annotations


class DraftLength:
    """How many tokens to draft next: `maximum` always, or adapted to how the last drafts fared."""

    def __init__(self, maximum: int, *, adaptive: bool) -> None:
        self.maximum, self.adaptive, self.current = maximum, adaptive, maximum

    def update(self, proposed: int, accepted: int) -> None:
        if self.adaptive and proposed:
            step = 2 if accepted == proposed else -1
            self.current = max(1, min(self.maximum, self.current + step))


class _Rate:
    """Seconds per emitted token over recent steps: a step's cost follows the recent steps (it
    changes with the context), its tokens a longer stretch of them (a draft's luck varies from step
    to step far more than what a forward costs)."""

    COST_DECAY, TOKEN_DECAY = 0.85, 0.95

    def __init__(self) -> None:
        self.seconds = self.cost_steps = 0.0
        self.tokens = self.token_steps = 0.0

    def add(self, seconds: float, tokens: int) -> None:
        self.seconds = self.seconds * self.COST_DECAY + seconds
        self.cost_steps = self.cost_steps * self.COST_DECAY + 1
        self.tokens = self.tokens * self.TOKEN_DECAY + tokens
        self.token_steps = self.token_steps * self.TOKEN_DECAY + 1

    @property
    def per_token(self) -> float:
        if not self.tokens:
            return float("inf")
        return (self.seconds / self.cost_steps) / (self.tokens / self.token_steps)


class DraftGate:
    """Whether the next step drafts, decided by what drafting and plain steps have cost per
    emitted token, measured in this run.

    A draft that is mostly rejected costs a longer verify forward (and the drafter's own work) for
    about one token, so a speculative run with poor drafts is slower than plain decoding. The gate
    turns drafting off while its measured cost per token is above a plain step's, and probes it
    again now and then (`PROBE_STEPS` steps drafting one token, after `MIN_GAP` plain steps, the
    gap doubling up to `MAX_GAP` while probes keep losing), so a run with poor drafts loses a few percent at
    most, and one whose drafts turn good starts drafting again. A plain step is re-measured every
    `REFRESH` drafting steps (costs change as the context grows). The decisions depend on timing,
    so they differ between runs; greedy output does not depend on them.
    """

    PROBE_STEPS, MIN_GAP, MAX_GAP, REFRESH = 2, 16, 256, 64
    #: Tokens (decayed) drafting steps must have emitted before a verdict against drafting: one
    #: unlucky draft is not evidence.
    EVIDENCE = 4.0

    def __init__(self) -> None:
        self.plain, self.draft = _Rate(), _Rate()
        self.drafting = True
        self.gap = self.MIN_GAP
        self.plain_left = 0  # plain steps until the next probe (not drafting)
        self.probe_left = 0  # drafting steps left in the current probe
        self.since_plain = 0  # drafting steps since the last plain one

    def budget(self, wanted: int) -> int:
        """How many tokens the next step may draft, of the `wanted` the draft length allows: none
        while drafting does not pay, one in a probe (the cheapest verify forward that measures)."""
        if self.draft.tokens and not self.plain.tokens:
            return 0  # one plain step early on, to have something to compare against
        if self.drafting:
            return wanted if self.since_plain < self.REFRESH else 0
        return min(wanted, 1) if self.probe_left > 0 else 0

    def record(self, drafted: bool, seconds: float, tokens: int, *, refeed: bool = False) -> None:
        """A step's wall time and emitted tokens, `drafted` or plain; a plain step that also fed
        tokens re-fed after a rejection (`refeed`) is part of drafting's cost."""
        if refeed and not drafted:
            self.draft.add(seconds, tokens)
            return
        (self.draft if drafted else self.plain).add(seconds, tokens)
        self.since_plain = self.since_plain + 1 if drafted else 0
        if not (self.plain.tokens and self.draft.tokens):
            return
        pays = self.draft.per_token < self.plain.per_token
        if self.drafting:
            if not pays and self.draft.tokens >= self.EVIDENCE:
                self.drafting, self.plain_left = False, self.gap
            return
        if drafted:
            self.probe_left -= 1
            if self.probe_left <= 0:
                if pays:
                    self.drafting, self.gap = True, self.MIN_GAP
                else:
                    self.gap = min(2 * self.gap, self.MAX_GAP)
                    self.plain_left = self.gap
            return
        self.plain_left -= 1
        if self.plain_left <= 0:
            self.probe_left = self.PROBE_STEPS
            self.draft = _Rate()  # a probe is judged on its own steps
