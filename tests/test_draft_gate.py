"""`DraftGate`, the default schedule's decision whether to draft at all, driven by synthetic step
costs: it turns drafting off when drafts cost more per token than plain steps, probes with one
token after a gap that doubles while probes lose, turns drafting back on when a probe pays, and
keeps drafting where drafts pay."""

from __future__ import annotations

from kvcache.generation.draft_schedule import DraftGate

PLAIN_STEP = 1.0


def run(gate: DraftGate, steps: int, draft_cost: float, tokens_when_drafting: int) -> list[int]:
    """Drive `gate` for `steps` steps; each drafting step costs `draft_cost` and emits
    `tokens_when_drafting`; return the budget granted at each step (4 wanted)."""
    budgets = []
    for _ in range(steps):
        budget = gate.budget(4)
        budgets.append(budget)
        if budget:
            gate.record(True, draft_cost, tokens_when_drafting)
        else:
            gate.record(False, PLAIN_STEP, 1)
    return budgets


def test_poor_drafts_are_turned_off_and_probed_ever_more_rarely() -> None:
    budgets = run(DraftGate(), 400, draft_cost=2.0, tokens_when_drafting=1)
    assert budgets[0] == 4 and budgets[1] == 0  # a first draft, then a plain step to compare
    drafting = [i for i, b in enumerate(budgets) if b]
    assert len(drafting) <= 16  # of 400 steps: the few it takes to decide, then probes
    probes = [budgets[i] for i in drafting[6:]]
    assert probes and set(probes) == {1}  # probes draft one token: the cheapest verify
    gaps = [b - a for a, b in zip(drafting[6::2], drafting[8::2], strict=False)]
    assert gaps == sorted(gaps) and gaps[-1] > 2 * gaps[0]  # the gap grows while probes lose
    wasted = sum(2.0 - 1.0 for b in budgets if b)  # what drafting cost beyond plain steps
    assert wasted / len(budgets) < 0.05


def test_good_drafts_keep_drafting_with_a_rare_plain_step() -> None:
    budgets = run(DraftGate(), 300, draft_cost=1.5, tokens_when_drafting=4)
    assert budgets[1] == 0 and sum(b == 0 for b in budgets) <= 2 + 300 // DraftGate.REFRESH
    assert all(b == 4 for i, b in enumerate(budgets[2:50]))


def test_a_probe_that_pays_turns_drafting_back_on() -> None:
    gate = DraftGate()
    run(gate, 60, draft_cost=2.0, tokens_when_drafting=1)
    assert not gate.drafting
    budgets = run(gate, 200, draft_cost=1.2, tokens_when_drafting=3)  # the drafts got good
    assert gate.drafting and budgets[-1] == 4
