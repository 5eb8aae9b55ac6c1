"""`DraftGate`, the default schedule's choice of how many tokens to draft (none included), driven by
synthetic step costs and acceptance: it stops drafting where drafts cost more per token than plain
steps, keeps drafting the most where they pay, comes back when shadow proposals say the drafts got
good, charges a re-feeding target for what a rejection costs it, and asks an expensive drafter
for shadows only now and then. `ForwardCost` estimates forwards of unmeasured lengths."""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable

import pytest

from kvcache.generation.draft_schedule import DraftAudit, DraftGate, packed_tokens
from kvcache.generation.forward_cost import ForwardCost


def drive(gate: DraftGate, steps: int, per_token: float, rate: float, seed: int = 0,
          draft_cost: float = 0.0, refeeds: bool = False, forward: Callable[[int], float] | None = None,
          slowdown: Callable[[int], float] = lambda step: 1.0) -> list[int]:  # fmt: skip
    """`steps` steps of a target whose forward with k draft tokens costs `forward(k)` seconds
    (default `1 + per_token * k`), times `slowdown(i)` at step i (a machine whose speed drifts),
    and a drafter right with probability `rate` per token (`draft_cost` seconds per proposed
    token); returns the draft length chosen at each step."""
    forward = forward or (lambda k: 1 + per_token * k)
    coins = random.Random(seed)
    chosen = []
    for step in range(steps):
        k = gate.budget(4)
        chosen.append(k)
        asked = k or int(gate.shadow())
        accepted = 0
        while accepted < asked and coins.random() < rate:
            accepted += 1
        gate.record(1 + k, slowdown(step) * forward(k), asked, accepted, draft_cost * asked,
                    refed=refeeds and k > 0 and accepted < k, shadow=not k)  # fmt: skip
    return chosen


def test_poor_drafts_are_not_tried_when_the_first_shadows_are_wrong() -> None:
    """The acceptance prior weighs half a judged token: a wrong first shadow proposal puts it
    below what a one-token draft must earn even at a plain step's price, so drafts that are
    nearly never right cost nothing but the shadows (and a probe, should a shadow be lucky)."""
    chosen = drive(DraftGate(4), 300, per_token=0.5, rate=0.03)
    drafting = [i for i, k in enumerate(chosen) if k]
    assert chosen[0] == 0 and len(drafting) <= 3
    assert all(b - a > ForwardCost.QUIET for a, b in itertools.pairwise(drafting))


def test_poor_drafts_after_a_lucky_start_are_turned_off_after_a_few_steps() -> None:
    gate = DraftGate(4)
    assert drive(gate, 2, per_token=0.5, rate=1.0) == [0, 1]  # a right first shadow: drafting starts
    chosen = drive(gate, 300, per_token=0.5, rate=0.03)
    drafting = [i for i, k in enumerate(chosen) if k]
    # a short exploration, then a probe now and then: never two within `QUIET` steps
    assert drafting and drafting[0] < 5 and len(drafting) <= 6
    assert all(b - a > ForwardCost.QUIET for a, b in itertools.pairwise(drafting))
    wasted = sum(0.5 * k for k in chosen)  # what drafting cost beyond plain steps (it gained ~nothing)
    assert wasted / len(chosen) < 0.02


def test_good_drafts_draft_the_most_every_step() -> None:
    """After a plain step, drafts of 1 and 3 tokens (each accepted whole lets the next grow by
    two), then the most every step."""
    chosen = drive(DraftGate(4), 200, per_token=0.1, rate=1.0)
    assert chosen[:3] == [0, 1, 3] and all(k == 4 for k in chosen[3:])


def test_middling_drafts_on_a_cheap_target_draft_a_little() -> None:
    """At 50% every draft length pays on a target whose extra tokens cost 5% each, the third token
    the most (1.875 tokens for 1.15 of a step's cost; a fourth adds 3% of a token for 5% of a
    step): the gate drafts at (nearly) every step, mostly 2 or 3 tokens."""
    chosen = drive(DraftGate(4), 400, per_token=0.05, rate=0.5)
    settled = chosen[50:]
    # (a win this close makes the gate re-anchor its cost ratios by a plain step now and then)
    assert sum(k >= 1 for k in settled) >= 0.9 * len(settled) and sorted(settled)[len(settled) // 2] in (2, 3)


def test_drafts_that_turn_good_are_taken_up_again() -> None:
    gate = DraftGate(4)
    assert not any(drive(gate, 100, per_token=0.3, rate=0.0)[20:])
    chosen = drive(gate, 100, per_token=0.3, rate=0.95, seed=1)  # judged by shadow proposals, free of cost
    # the decayed acceptance must climb past what pays with the margin (a > 0.5 for one token here)
    assert chosen[-1] == 4 and chosen.index(1) < 30 and sum(k > 0 for k in chosen) > 70


def test_drafts_are_judged_by_the_match_they_continue() -> None:
    """A drafter whose long matches (8 tokens: text seen before) are right 95% of the time and whose
    short ones (2 tokens: common words) 10%, one long to three short: overall (about 57% of judged
    tokens) every draft would seem to pay on this cheap target, yet the short ones lose. Judged
    apart, the long matches draft (nearly) every time and the short ones (nearly) never."""
    gate, coins = DraftGate(4), random.Random(4)
    chosen: dict[int, list[int]] = {2: [], 8: []}
    for step in range(400):
        match = 8 if step % 4 == 0 else 2
        k = gate.budget(4, match=match)
        chosen[match].append(k)
        asked = k or 1  # a shadow at every plain step: a cheap drafter
        accepted = 0
        while accepted < asked and coins.random() < (0.95 if match == 8 else 0.1):
            accepted += 1
        gate.record(1 + k, 1 + 0.1 * k, asked, accepted, 0.0, shadow=not k, match=match)
    assert gate.acceptance > 0.4 and gate.acceptance_at(8) > 0.85 and gate.acceptance_at(2) < 0.3
    assert gate.best_acceptance == gate.acceptance_at(8)
    long, short = chosen[8][10:], chosen[2][30:]
    assert sum(k > 0 for k in long) >= 0.9 * len(long) and sum(k > 0 for k in short) <= 0.05 * len(short)
    assert gate.acceptance_at(5) == gate.acceptance  # a match length never judged: the overall acceptance


def test_a_batch_feeds_the_width_its_rows_matches_pay_for() -> None:
    """Eight rows offering drafts of 6 tokens, on long matches (8 tokens, right 95% of the time)
    or short ones (2 tokens, 10%); a forward feeding k draft tokens per row costs 1 + 0.15 k plain
    steps. With four rows on long matches the batch drafts, growing to the whole 6; with none, it
    takes plain steps, the rows' first offered tokens judged as shadows (a short match's drafts
    would emit 0.11 tokens more per row for 15% more time)."""
    gate, coins = DraftGate(6), random.Random(5)

    def step(matches: list[int]) -> int:
        k = gate.batch_width([(6, m) for m in matches], 6)
        judged, emitted = [], 0
        for m in matches:
            n, right = k or 1, 0  # a plain step judges the first offered token
            while right < n and coins.random() < (0.95 if m == 8 else 0.1):
                right += 1
            judged.append((n, right, m))
            emitted += 1 + (right if k else 0)
        gate.record_batch(k, 1 + 0.15 * k, judged, emitted, 0.0, 6 * len(matches))
        return k

    warm = [step([2] * 8) for _ in range(10)]
    mixed = [step([8] * 4 + [2] * 4) for _ in range(60)]
    short = [step([2] * 8) for _ in range(40)]
    assert sum(k > 0 for k in warm) <= 2 and gate.acceptance_at(8) > 0.85 and gate.acceptance_at(2) < 0.3
    assert max(mixed) == 6 and sum(k > 0 for k in mixed[10:]) >= 0.9 * len(mixed[10:])
    assert sum(k > 0 for k in short[5:]) <= 2
    assert gate.batch_width([(0, 0)] * 8, 6) == 0  # nothing offered: nothing fed


@pytest.mark.parametrize("packed", [False, True])
def test_a_packed_batch_drafts_for_the_one_row_whose_match_pays(packed: bool) -> None:
    """One row of eight offers 6-token drafts on a long match (right 95% of the time), the others
    nothing. Padded to one width, a forward costs 1 + 0.15 k plain steps: the one row's 5 more
    tokens never pay for 8 rows' 6 more each, so the batch steps plainly. Packed, a forward costs
    what its draft tokens cost (1 + 0.15 k / 8 here: one row's k tokens of a batch of 8), and
    the row drafts its whole 6 (starting from one token: the ramp), but for the plain steps that
    re-anchor a close call now and then."""
    gate, coins = DraftGate(6, packed=packed), random.Random(3)
    rows = [(6, 8)] + [(0, 0)] * 7
    chosen = []
    for _ in range(60):
        k = gate.batch_width(rows, 6)
        fed = packed_tokens([1 + min(n, k) for n, _ in rows]) if packed else 1 + k
        seconds = 1 + 0.15 * (fed - 1) / (8 if packed else 1)
        right = 0
        while right < (k or 1) and coins.random() < 0.95:
            right += 1
        judged = [(k or 1, right, 8)] + [(0, 0, 0)] * 7
        gate.record_batch(k, seconds, judged, 8 + (right if k else 0), 0.0, 6, fed if packed else None)
        chosen.append(k)
    if packed:
        assert max(chosen) == 6 and sum(k == 6 for k in chosen[20:]) >= 0.7 * len(chosen[20:]), chosen
    else:
        assert sum(k > 0 for k in chosen[10:]) <= 0.1 * len(chosen[10:]), chosen


def test_a_refeeding_target_is_charged_for_rejections() -> None:
    """Where a target re-feeds the kept tokens of a rejected step, middling drafts pay less: the
    same costs and acceptance draft less once the gate has seen a re-feed."""
    plain_crop = drive(DraftGate(4), 300, per_token=0.25, rate=0.45, seed=2)
    refeeding = drive(DraftGate(4), 300, per_token=0.25, rate=0.45, seed=2, refeeds=True)
    assert sum(refeeding[50:]) < sum(plain_crop[50:])


def test_an_expensive_drafter_is_shadowed_rarely() -> None:
    gate = DraftGate(4)
    drive(gate, 10, per_token=0.5, rate=0.0, draft_cost=0.5)  # a drafter costing half a plain step per token
    shadows = sum(gate.shadow() for _ in range(200))
    assert 1 <= shadows <= 200 * DraftGate.SHADOW_BUDGET * 2
    cheap = DraftGate(4)
    drive(cheap, 10, per_token=0.5, rate=0.0, draft_cost=1e-4)
    assert sum(cheap.shadow() for _ in range(200)) == 200


def test_forward_cost_estimates() -> None:
    cost = ForwardCost()
    assert cost(3) is None
    cost.add(1, 3.0)  # a run's first plain step: a warm-up
    assert cost.leaving and not cost.anchored
    cost.add(1, 2.0)  # after a plain step: settled
    assert cost.anchored and not cost.leaving and cost.ratio(5) == 1.0  # one length: optimistic
    cost.add(5, 4.0)
    # between a plain step and it: on the line; beyond the only drafting length: its ratio (an
    # optimistic guess, tried and measured, where the line would charge the cost every drafting
    # forward pays once to every token)
    assert cost.ratio(5) == 2.0 and cost.ratio(3) == 1.5 and cost.ratio(9) == 2.0
    cost.add(1, 2.4)  # leaving drafting cost a fifth of a plain step more: charged to that forward
    assert cost.leaving and cost.ratio(5) == pytest.approx(2.2)
    cost.add(1, 2.0)
    cost.add(3, 5.0)
    # the nearest on each side; a longer forward measured cheaper than a shorter one (5 tokens at
    # 2.2, 3 at 2.5) is priced as the shorter one: more tokens never cost less
    assert cost.ratio(3) == 2.5 and cost.ratio(2) == 1.75 and cost.ratio(4) == cost.ratio(5) == 2.5
    for _ in range(3):
        cost.add(1, 1.0)
    # the machine got faster: a forward is read against the settled plain steps of its moment
    cost.add(5, 2.25)  # measured at (2.2 + 2.25) / 2, still priced as 3 tokens' 2.5
    assert cost.ratio(5) == 2.5
    cost.add(3, 0.5)  # never below a plain step's ratio: more tokens do not cost less
    assert cost.ratio(3) == pytest.approx((2.5 + 1.0) / 2) and cost.ratio(5) == pytest.approx((2.2 + 2.25) / 2)
    # every forward read as a plain step at its length's ratio: the machine's speed now, 1.0 s
    # (the median of the last 7 readings 2.0, 2.0, 1.0, 1.0, 1.0, 0.9, 0.29)
    assert cost(1) == pytest.approx(1.0) and cost(5) == pytest.approx(2.225)
    for _ in range(20):
        cost.add(1, 1.0)
    assert cost(1) == pytest.approx(1.0) and cost(5) == 1.0  # ratios not measured again are forgotten


def test_until_a_plain_step_is_settled_ratios_are_read_against_the_others() -> None:
    """Drafting right after the first plain step (a warm-up) has no settled plain step to be read
    against: it is read against the warm-up (too slow a reference, but far better than none, which
    would leave every length priced as a plain step while drafts lose), and the settled plain
    steps take over as soon as there is one."""
    cost = ForwardCost()
    cost.add(1, 3.0)
    cost.add(4, 4.5)
    assert not cost.anchored and cost.ratio(4) == 1.5
    cost.add(1, 2.0)  # leaving drafting
    cost.add(1, 2.0)  # settled
    cost.add(4, 4.0)
    cost.add(4, 4.0)
    assert cost.anchored and cost.ratio(4) == 2.0  # the median of 1.5, 2.0 and 2.0


def test_a_ratio_is_measured_against_plain_steps_not_against_itself() -> None:
    """A slow spell ends just as drafting starts: a two-token forward (truly 1.3x a plain step)
    first reads as cheap against a speed the slow plain steps set. Measured against a speed that
    drafting forwards also report (through the very ratio being measured), that low ratio would
    confirm itself for good (seen: 0.8x all run long, drafting at 3% acceptance); measured against
    plain steps only, it comes right once a few fast plain steps are in."""
    cost = ForwardCost()
    for _ in range(ForwardCost.RECENT):
        cost.add(1, 2.0)  # the slow spell
    for step in range(120):  # then, as the gate re-anchors: two plain steps of 1.0 s, eight drafting
        cost.add(*((1, 1.0) if step % 10 < 2 else (2, 1.3)))  # forwards of 1.3 s, and so on
    assert cost.ratio(2) == pytest.approx(1.3)
    assert cost(1) == pytest.approx(1.0)


def test_a_close_call_is_anchored_by_two_plain_steps() -> None:
    """Drafts that barely pay in the estimate (a close call): every `QUIET` drafting forwards the
    gate takes two plain steps, the first paying for leaving drafting, the second a settled one
    that the ratios are read against; a clear win drafts on."""
    close = drive(DraftGate(4), 120, 0.0, 0.45, seed=5, forward=lambda k: 1.25 if k else 1.0)
    late = close[60:]  # once the acceptance estimate has settled near 45%
    assert sum(k > 0 for k in late) >= 0.6 * len(late)
    runs = [(plain, len(list(group))) for plain, group in itertools.groupby(late, key=lambda k: k == 0)]
    plain_runs = [length for plain, length in runs[1:-1] if plain]  # whole runs: not cut by the slice
    assert plain_runs and min(plain_runs) >= 2
    clear = drive(DraftGate(4), 120, 0.0, 0.9, seed=5, forward=lambda k: 1.25 if k else 1.0)
    assert sum(k == 0 for k in clear[20:]) <= 2


def _drive_drifting(rate: float, slowdown: Callable[[int], float], steps: int) -> list[int]:
    """`drive` where a draft of any length costs 1.4x a plain step (as a tiny model's forward jumps
    from one token to two, then stays flat), on a machine whose speed drifts by `slowdown`."""
    return drive(DraftGate(4), steps, 0.0, rate, seed=3, forward=lambda k: 1.4 if k else 1.0, slowdown=slowdown)


def test_a_slow_spell_while_drafting_is_blamed_on_the_machine() -> None:
    """Drafts that pay (63% right: 2.4 tokens for 1.4 steps) and a machine twice as slow for 20
    steps in the middle of them: a run that measured only drafting steps then must not take the
    slowdown for drafts gone dear (it stopped drafting for 35 steps when costs were seconds, or
    ratios to a plain cost measured before the slow spell)."""
    chosen = _drive_drifting(0.63, lambda step: 2.0 if 40 <= step < 60 else 1.0, 200)
    # drafting throughout, but for plain steps now and then (two at most) that re-anchor the ratios
    assert sum(k > 0 for k in chosen[5:]) >= 0.9 * len(chosen[5:])
    assert not any(chosen[i] == chosen[i + 1] == chosen[i + 2] == 0 for i in range(5, len(chosen) - 2))


def test_drafts_measured_as_dear_are_tried_again_now_and_then() -> None:
    """Drafts that lose (30% right, 1.4x a plain step) on a machine slowing down 3x over the run:
    after the first few steps the gate drafts only to measure again, ever less often (after 8, 16,
    then `STALE` plain steps), so a cost measured at a bad moment cannot switch drafting off for
    good, at little cost."""
    chosen = _drive_drifting(0.3, lambda step: 1 + 2 * step / 300, 300)
    drafting = [i for i, k in enumerate(chosen) if k and i >= 10]
    gaps = [b - a for a, b in itertools.pairwise(drafting)]
    assert len(drafting) <= 12 and all(gap > ForwardCost.STALE for gap in gaps[3:])


def _stretch(audit: DraftAudit, drafting: list[tuple[int, float]], leaving: float, after: float,
             before: float | None = 1.0) -> None:  # fmt: skip
    """Drafting steps `(tokens emitted, seconds)` after settled plain steps of `before` seconds,
    the plain step that leaves drafting (`leaving` seconds), then a settled one (`after`)."""
    for emitted, seconds in drafting:
        audit.add(False, False, emitted, seconds, before)
    audit.add(True, False, 1, leaving, before)
    audit.add(True, True, 1, after, before)


def test_drafting_that_lost_in_seconds_is_paused_longer_each_time() -> None:
    """Eight drafting steps of 1.3 s that emit one token each (every draft rejected), priced at
    plain steps of 1.0 s: a loss, so drafting pauses for `PAUSE` steps, then twice as long after a
    second loss in a row; a win resets the pause."""
    audit = DraftAudit()
    _stretch(audit, [(1, 1.3)] * 8, leaving=1.2, after=1.0)
    assert audit.losses == 1 and audit.paused and audit.paused_until == audit.steps + DraftAudit.PAUSE
    for _ in range(DraftAudit.PAUSE):
        audit.add(True, True, 1, 1.0, 1.0)
    assert not audit.paused
    _stretch(audit, [(1, 1.3)] * 8, leaving=1.2, after=1.0)
    assert audit.losses == 2 and audit.paused_until == audit.steps + 2 * DraftAudit.PAUSE
    audit.paused_until = audit.steps  # (as if the pause had run out)
    _stretch(audit, [(3, 1.3)] * 8, leaving=1.2, after=1.0)  # three tokens a step: a win
    assert audit.losses == 2 and not audit.paused
    _stretch(audit, [(1, 1.3)] * 8, leaving=1.2, after=1.0)
    assert audit.paused_until == audit.steps + DraftAudit.PAUSE


def test_drafting_is_priced_at_plain_steps_on_both_sides_of_it() -> None:
    """A machine slowing from 1.0 s to 2.0 s a plain step while drafting (each drafting step
    costs 1.2 plain steps of its moment and emits 1.4 tokens: a win): priced at the plain step
    before it alone, the stretch would read as a loss; priced at both sides' mean, the drift
    cancels out and it is a win."""
    audit = DraftAudit()
    speeds = [1.0 + i / 7 for i in range(8)]
    _stretch(audit, [(1.4, 1.2 * s) for s in speeds], leaving=1.1 * 2.0, after=2.0)
    emitted, seconds = 8 * 1.4 + 1, sum(1.2 * s for s in speeds) + 2.2
    assert emitted * 1.0 < seconds < emitted * 1.5  # a loss at the price before, a win at the mean
    assert audit.losses == 0 and not audit.paused


def test_only_evidence_enough_is_judged() -> None:
    """A single probe (one rejected draft) is priced but not judged until stretches of `JUDGED`
    steps in all are in; a stretch longer than `LONGEST` steps (a clear win the gate never
    interrupted) is not priced at all, its plain step before being too long ago; nor is one
    before any settled plain step."""
    audit = DraftAudit()
    for _probe in range(3):
        _stretch(audit, [(1, 1.3)], leaving=1.2, after=1.0)  # two steps priced each
        assert audit.losses == 0
    _stretch(audit, [(1, 1.3)], leaving=1.2, after=1.0)  # eight in all: judged
    assert audit.losses == 1
    long = DraftAudit()
    _stretch(long, [(1, 1.3)] * DraftAudit.LONGEST, leaving=1.2, after=1.0)
    unanchored = DraftAudit()
    _stretch(unanchored, [(1, 1.3)] * 8, leaving=1.2, after=1.0, before=None)
    assert long.losses == unanchored.losses == 0 and not long.paused and not unanchored.paused


def test_a_paused_gate_drafts_nothing_whatever_its_estimates_say() -> None:
    gate = DraftGate(4)
    drive(gate, 20, per_token=0.05, rate=1.0)
    assert gate.budget(4) == 4
    gate.audit.paused_until = gate.audit.steps + 3
    assert gate.budget(4) == 0 and gate.shadow()  # shadows go on
    drive(gate, 3, per_token=0.05, rate=1.0)
    assert gate.budget(4) == 4
