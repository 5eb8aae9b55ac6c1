"""The engine's decode step with speculation: every row drafts (by prompt lookup in its own text,
or with the server's draft model and a draft cache of its own), all rows are verified in one
forward, and each row is cropped by its own count.

With prompt lookup or suffix drafting (drafters that say which match a draft continues), the
engine's `DraftGate` chooses how many of the offered draft tokens the batch feeds (one width for
all rows, none where no width pays: `DraftGate.batch_width`), judging drafts by their match
length, as `speculative_generate`'s default schedule does for one sequence; a draft model's
drafts are fed whole. A row's draft stops at its next chunk boundary, so a row's kept tokens land on every boundary
exactly and the prefix store can take the state there (a step past a boundary would leave no
state at it), and at its next quantized block boundary (a verify forward's queries then see what
single steps would see quantized: `Cache.forward_segments`). Rows with shorter drafts are padded
with their own last token, never accepted; a model that `packs_rows` leaves those fillers out of its
linear layers (`tokens_per_row`), and the gate prices such a forward by the tokens it computes.
The acceptance rule is the speculative-decoding one (`kvcache.generation.speculative`): greedy rows
keep the drafts the target's argmax agrees with, sampling rows follow the speculative-sampling rule,
so the output is the target's own either way (for lookup drafts, a seeded row's very tokens).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from ..generation.draft_schedule import packed_tokens
from ..generation.drafters import Draft, Drafter, ModelDrafter, PromptLookupDrafter
from ..generation.prediction import PREDICTED_MATCH, PredictionDrafter
from ..generation.suffix import SuffixDrafter
from ..generation.switches import holds_recurrent_states
from ..generation.verifier import Verifier
from .row_tokens import ban_early_ends

NO_DRAFT = Draft([])


def _greedy(draft: Draft, choice: list[int]) -> tuple[int, list[int]]:
    """`Verifier.verify` of a greedy row, from the target's argmax at each of its positions."""
    accepted = 0
    while accepted < len(draft.tokens) and draft.tokens[accepted] == choice[accepted]:
        accepted += 1
    return accepted, [*draft.tokens[:accepted], choice[accepted]]


def _cut(draft: Draft, n: int) -> Draft:
    if len(draft.tokens) <= n:
        return draft
    return Draft(draft.tokens[:n], None if draft.probs is None else draft.probs[:n], draft.match)


def new_drafter(engine: Any, request: Any) -> Drafter:
    """A request's drafter, started on its prompt: the server's kind (a draft model, suffix
    drafting or prompt lookup), behind the request's predicted output where it sent one."""
    if engine.draft_model is not None:
        drafter: Drafter = ModelDrafter(engine.draft_model)
    else:
        drafter = SuffixDrafter(engine.suffix_corpus) if engine.suffix_corpus is not None else PromptLookupDrafter()
    if request.prediction:
        drafter = PredictionDrafter(request.prediction, drafter)
    drafter.start(request.prompt, device=engine.device)
    return drafter


def speculative_step(engine: Any, predicted_only: bool = False) -> None:
    """One decode step of every row with drafts (`predicted_only`: only rows with a predicted
    output draft; the batch is past the rows the server drafts for)."""
    rows, cache, gate = engine._rows, engine._cache, engine.draft_gate
    started = time.perf_counter()
    # Sampling rows draft too: the gate's drafts are point masses, verified by the row's own draws
    # in turn (`Verifier.verify`), so a seeded row's tokens are those of plain steps, seed for seed,
    # however much timing lets it draft.
    asked = [engine.speculative if r.prediction or not predicted_only else 0 for r in rows]
    if gate is not None and not gate.worth_asking(len(rows), engine.speculative):
        # no width could pay: a few rows (in turn) are asked for one token, judged as shadows
        shadows, first = gate.shadow_rows(len(rows)), engine.shadow_turn
        engine.shadow_turn = first + shadows
        asked = [min(most, int((b - first) % len(rows) < shadows)) for b, most in enumerate(asked)]
    asked = [0 if r.constraint is not None else most for r, most in zip(rows, asked, strict=True)]  # never drafts
    offered, verifiers = [], []
    for request, most in zip(rows, asked, strict=True):
        to_boundary = engine.draft_step - request.session.length % engine.draft_step
        budget = min(most, request.max_tokens - len(request.tokens) - 1, to_boundary - 1)
        sequence = request.prompt + request.tokens
        verifier = Verifier(request.sampling, request.generator)  # a draft model picks as the row samples
        verifiers.append(verifier)
        offered.append(request.drafter.propose(sequence, budget, verifier.pick) if budget > 0 else NO_DRAFT)
    if predicted_only:  # past the rows the server drafts for: predictions' drafts alone, mostly right ones
        offered = [d if d.match >= PREDICTED_MATCH and not r.drafter.doubtful else NO_DRAFT
                   for d, r in zip(offered, rows, strict=True)]  # fmt: skip
    drafts = offered
    if gate is not None:  # as many draft tokens per row as the rows' matches pay for, in one width
        most = gate.batch_width([(len(d.tokens), d.match) for d in offered], engine.speculative)
        drafts = [_cut(d, most) for d in offered]
    width = 1 + max(len(d.tokens) for d in drafts)
    counts = [1 + len(d.tokens) for d in drafts]
    packed = engine.packs_rows and width > 1  # each row computes its own tokens, not the rectangle
    fed = packed_tokens(counts) if packed else width  # what the gate prices the forward as
    # what the next turn's prefill budget leaves for these rows: their draft tokens, per row
    engine.draft_width = -(-(fed - 1) // len(rows)) if packed else width - 1
    drafted = time.perf_counter()
    padded = [[r.pending, *d.tokens, *[r.pending] * (width - 1 - len(d.tokens))]
              for r, d in zip(rows, drafts, strict=True)]
    ids = torch.tensor(padded, dtype=torch.long, device=engine.device)
    if width > 1:
        cache.activate_past_recording()
    packing = {"tokens_per_row": counts} if packed else {}
    logits = engine.model(ids, cache=cache, **engine.row_inputs(width), **packing)
    ban_early_ends(rows, logits, engine.eos)  # (a row short of its min_tokens: its end tokens are rejected)
    choices = logits.argmax(-1).tolist()  # every greedy row's choices in one host transfer
    verdicts = [(0, [engine._choose(rows[b], logits[b, :1])]) if rows[b].constraint is not None  # (no draft)
                else _greedy(draft, choices[b]) if verifier.sampling.argmax_only
                else verifier.verify(draft, logits[b, : len(draft.tokens) + 1], rows[b].counts, rows[b].prompt_seen)
                for b, (verifier, draft) in enumerate(zip(verifiers, drafts, strict=True))]  # fmt: skip
    verified, taken = sum(len(d.tokens) for d in drafts), sum(accepted for accepted, _ in verdicts)
    engine.drafts = [engine.drafts[0] + verified, engine.drafts[1] + taken]  # (relayed by an engine process)
    engine.metrics.add_drafts(verified, taken)
    if width > 1:
        drops = [width - 1 - accepted for accepted, _ in verdicts]
        if any(drops):
            cache.crop([-d for d in drops])
        cache.crop(0)
    if gate is not None:
        judged = [(len(d.tokens), accepted, d.match) if d.tokens  # a row's shadow: its first offered token
                  else (min(len(o.tokens), 1), int(bool(o.tokens) and o.tokens[0] == emitted[0]), o.match)
                  for d, o, (accepted, emitted) in zip(drafts, offered, verdicts, strict=True)]  # fmt: skip
        gate.record_batch(width - 1, time.perf_counter() - drafted, judged, sum(len(e) for _, e in verdicts),
                          drafted - started, sum(len(o.tokens) for o in offered), fed)  # fmt: skip
    keep = []
    for b, (request, draft, (accepted, emitted)) in enumerate(zip(rows, drafts, verdicts, strict=True)):
        request.session.advance([request.pending, *draft.tokens[:accepted]], engine.row_capture(b))
        for j, token in enumerate(emitted):  # token j was chosen from the verify forward's position j
            engine._emit(request, token, logits[b, j])
            if request.finish_reason is not None:
                break
        if type(request.drafter).accept is not Drafter.accept:  # a draft model drops what was rejected
            request.drafter.accept(request.prompt + request.tokens)
        if request.finish_reason is None:
            keep.append(b)
    engine._keep(keep)


def _holds_recurrent_states(model: Any, device: torch.device) -> bool:
    """Whether `model`'s cache holds a recurrent state after a token (Mamba, gated delta rule):
    conv windows alone (LFM2's short convolutions) roll back token by token anyway."""
    cache = model.new_cache()
    with torch.no_grad():
        model(torch.zeros(1, 1, dtype=torch.long, device=device), cache=cache,
              position_ids=torch.zeros(1, 1, dtype=torch.long, device=device))  # fmt: skip
    return holds_recurrent_states(cache)


def can_speculate(model: Any, device: torch.device) -> bool:
    """Whether a verify forward's rejected tokens can be rolled back: the model hands kvcache its
    recurrent states token by token, or holds none (attention, conv windows)."""
    from ..generation.switches import row_states

    return row_states(model, None)[0] or not _holds_recurrent_states(model, device)
