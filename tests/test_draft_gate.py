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

from kvcache.generation.draft_schedule import DraftGate, ForwardCost


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


def test_poor_drafts_are_turned_off_after_a_few_steps() -> None:
    chosen = drive(DraftGate(4), 300, per_token=0.5, rate=0.03)
    assert chosen[0] == 0  # a plain step first: nothing to compare against yet
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
    cost.add(1, 2.0)
    assert cost(1) == cost(5) == 2.0  # one length measured: the same for all (optimistic)
    cost.add(5, 4.0)
    assert cost(3) == pytest.approx(3.0) and cost(9) == pytest.approx(6.0)  # between, beyond
    cost.add(3, 5.0)
    assert cost(2) == pytest.approx(3.5) and cost(4) == pytest.approx(4.5)  # the nearest on each side
    for _ in range(3):
        cost.add(1, 1.0)
    # the machine got faster: every forward so far read as a plain step of 2.0 s, and now three of
    # 1.0 s, so a plain step is 1.5 s (the median) and a 5-token forward keeps its ratio 2.0: it
    # is estimated at 3.0 s, not compared in its old seconds (4.0) with fresh ones
    assert cost(1) == pytest.approx(1.5) and cost(5) == pytest.approx(3.0) and cost(3) == pytest.approx(3.75)
    cost.add(5, 2.25)  # measured against the speed of its moment: ratio 1.5
    assert cost(5) / cost(1) == pytest.approx(1.75)  # the median of the ratios 2.0 and 1.5
    for _ in range(20):
        cost.add(1, 1.0)
    assert cost(1) == pytest.approx(1.0) and cost(5) == 1.0  # ratios not measured again are forgotten


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
    # drafting throughout, but for a plain step now and then that re-anchors the cost ratios
    assert sum(k > 0 for k in chosen[5:]) >= 0.9 * len(chosen[5:])
    assert not any(chosen[i] == chosen[i + 1] == 0 for i in range(5, len(chosen) - 1))


def test_drafts_measured_as_dear_are_tried_again_now_and_then() -> None:
    """Drafts that lose (30% right, 1.4x a plain step) on a machine slowing down 3x over the run:
    after the first few steps the gate drafts only to measure again, ever less often (after 8, 16,
    then `STALE` plain steps), so a cost measured at a bad moment cannot switch drafting off for
    good, at little cost."""
    chosen = _drive_drifting(0.3, lambda step: 1 + 2 * step / 300, 300)
    drafting = [i for i, k in enumerate(chosen) if k and i >= 10]
    gaps = [b - a for a, b in itertools.pairwise(drafting)]
    assert len(drafting) <= 12 and all(gap > ForwardCost.STALE for gap in gaps[3:])
