"""What a target model's forward costs by the number of tokens it feeds, as speculative
decoding's schedule measures it while it runs."""

from __future__ import annotations

import bisect
from collections import deque


def _median(values: deque[float]) -> float:
    """The median of a few readings (once per decoding step: `statistics.median` costs more)."""
    ordered, half = sorted(values), len(values) // 2
    return ordered[half] if len(ordered) % 2 else (ordered[half - 1] + ordered[half]) / 2


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
    has one, 1: an optimistic guess, so an unmeasured length gets tried once rather than never.
    Beyond the only drafting length measured, the guess is that length's ratio: the line through a
    plain step would charge every extra token with what any drafting forward costs once (recording,
    the crop; on the bundled model a 2-token forward measures 1.5x a plain step, a 9-token one 1.8x,
    where the line says 5x), and a length priced that dear is never tried to be measured."""

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
        if tokens > counts[-1] and len(counts) == 2:  # beyond the only drafting length measured
            return self._envelope[counts[-1]]
        at = bisect.bisect(counts, tokens)  # the nearest on each side, else the two nearest on one
        lo, hi = counts[min(max(at - 1, 0), len(counts) - 2)], counts[min(max(at, 1), len(counts) - 1)]
        low, high = self._envelope[lo], self._envelope[hi]
        return max(low + (high - low) / (hi - lo) * (tokens - lo), 1.0)
