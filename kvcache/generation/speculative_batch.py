"""Speculative decoding of a batch: every row drafts, is verified and rolled back by its own count.

All rows go through one target forward per step. A row with fewer draft tokens than the longest
is padded with filler tokens (it proposes them, they are never accepted), so the forward has one
length; after verification the cache drops, per row, exactly what that row did not keep
(`Cache.crop` with one count per row), and rows then hold different numbers of tokens. The
attention of every row sees exactly its own tokens: positions come from each row's own count and
the models mask each row's queries by its own length (`get_seq_lengths`).

Recurrent layers can only land inside a forward where every token's state was recorded, so a
target (or draft model) with recurrent layers needs `set_return_intermediate_states` (its states
handed over) or `set_per_token_recurrence` (transformers mixers run one token at a time).
Finished rows (eos, `max_new_tokens`) leave the batch (`batch_select_indices`), so the rest never
computes for them.

How many tokens a row drafts: by default, for greedy rows with a drafter that is not a model
(prompt lookup, suffix drafting), one width for the batch that the rows' matches pay for in
measured tokens per second (`DraftGate.batch_width`, none where no width does, one-token shadow
proposals keeping the acceptance current), as a server's batches draft; otherwise each row's own
length, grown while its drafts are accepted whole and shrunk when they are not (`DraftLength`).
"""

from __future__ import annotations

import contextlib
import copy
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import GenerationError
from .batch_runner import BatchModelDrafter, BatchRunner, needs_row_states
from .draft_schedule import DraftGate, DraftLength, packed_tokens
from .drafters import Draft, Drafter, ModelDrafter, check_draft
from .inputs import check_mask, check_token_list
from .switches import row_states


@dataclass
class BatchSpeculativeOutput:
    """What batched `speculative_generate` produced, per row.

    `sequences` `[batch, prompt + longest output]`: the (left-padded) prompt, then each row's new
    tokens, then `pad_token_id` once the row stopped. `new_tokens[b]` are row b's new tokens.
    Per row and verification step: `proposed_per_step[b]` draft tokens proposed (fillers not
    counted), `accepted_per_step[b]` of them accepted, `emitted_per_step[b]` tokens appended.
    `target_forwards` / `draft_forwards` count batched model calls. No cache is returned: rows
    leave the batch as they finish.
    """

    sequences: torch.Tensor
    new_tokens: list[list[int]]
    target_forwards: int
    draft_forwards: int
    proposed_per_step: list[list[int]] = field(default_factory=list)
    accepted_per_step: list[list[int]] = field(default_factory=list)
    emitted_per_step: list[list[int]] = field(default_factory=list)

    @property
    def num_new_tokens(self) -> list[int]:
        return [len(t) for t in self.new_tokens]

    @property
    def acceptance_rates(self) -> list[float]:
        """Per row: accepted / proposed draft tokens (0.0 when nothing was proposed)."""
        return [sum(a) / sum(p) if sum(p) else 0.0 for a, p in zip(self.accepted_per_step, self.proposed_per_step,
                                                                     strict=True)]  # fmt: skip

    @property
    def acceptance_rate(self) -> float:
        proposed = sum(map(sum, self.proposed_per_step))
        return sum(map(sum, self.accepted_per_step)) / proposed if proposed else 0.0

    @property
    def tokens_per_target_forward(self) -> float:
        return sum(self.num_new_tokens) / self.target_forwards if self.target_forwards else 0.0


def speculate_batch(
    target: Any, drafter: Drafter, verifier: Any, input_ids: torch.Tensor, attention_mask: Any,
    encoder_decoder: bool, num_draft_tokens: int, draft_schedule: str, max_new_tokens: int, eos: frozenset[int],
    pad_token_id: Any, intermediate_states: bool | None, single_only: tuple,
) -> BatchSpeculativeOutput:  # fmt: skip
    """`speculative_generate` on a batch: checks of what only batch size 1 takes, then `decode_batch`."""
    for given, name in zip(single_only, ("cache", "draft_cache", "prefix_store"), strict=True):
        if given is not None:
            raise GenerationError(f"{name}= is for batch size 1; this batch has {input_ids.shape[0]} row(s)")
    pad = check_token_list("pad_token_id", pad_token_id, int(target.vocab_size)) or sorted(eos)[:1] or [0]
    if len(pad) != 1:
        raise GenerationError(f"pad_token_id must be one id, got {pad_token_id!r}")
    for model, who in ((target, "target"), (getattr(drafter, "model", None), "draft model")):
        refusal = getattr(model, "ragged_refusal", None)
        if refusal:  # found before any forward: nothing computed, nothing to undo
            raise GenerationError(f"batched speculative decoding crops rows by different counts, which the {who} "
                                  f"cannot mask: {refusal}; speculate one row at a time")  # fmt: skip
    draft_rows, draft_switch = False, None
    if isinstance(drafter, ModelDrafter):
        draft_rows, draft_switch = row_states(drafter.model, None)
    target_rows, switch = row_states(target, intermediate_states)
    return decode_batch(
        target, drafter, verifier, input_ids, check_mask(attention_mask, input_ids), encoder_decoder=encoder_decoder,
        num_draft_tokens=num_draft_tokens, adaptive=draft_schedule != "constant", timed=draft_schedule == "adaptive",
        max_new_tokens=max_new_tokens,
        eos=eos, pad_token_id=pad[0], switch=switch, target_row_states=target_rows,
        draft_switch=draft_switch, draft_row_states=draft_rows,
    )  # fmt: skip


def decode_batch(
    target: Any,
    drafter: Drafter,
    verifier: Any,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    *,
    encoder_decoder: bool,
    num_draft_tokens: int,
    adaptive: bool,
    max_new_tokens: int,
    eos: frozenset[int],
    pad_token_id: int,
    timed: bool = False,
    switch: Callable[[bool], Callable[[], None]],
    target_row_states: bool,
    draft_switch: Callable[[bool], Callable[[], None]] | None = None,
    draft_row_states: bool = False,
) -> BatchSpeculativeOutput:
    """The batched draft / verify / per-row rollback loop (see the module docstring); `timed`: the
    "adaptive" schedule, a measured width for greedy rows with a drafter that is not a model."""
    device, batch = input_ids.device, input_ids.shape[0]
    encoder: dict[str, Any] = {}
    if encoder_decoder:
        with torch.no_grad():
            encoder = {"encoder_hidden_states": target.encode(input_ids, attention_mask),
                       "encoder_attention_mask": attention_mask}  # fmt: skip
        prompts = [[int(target.decoder_start_token_id)] for _ in range(batch)]
    else:
        mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
        prompts = [row[m.bool()].tolist() for row, m in zip(input_ids.cpu(), mask.cpu(), strict=True)]
    runner = BatchRunner(target, device=device, encoder=encoder)
    model_drafter = None
    row_drafters: list[Drafter] = []
    if isinstance(drafter, ModelDrafter):
        draft_encoder = {}
        if encoder_decoder:
            with torch.no_grad():
                draft_encoder = {"encoder_hidden_states": drafter.model.encode(input_ids, attention_mask),
                                 "encoder_attention_mask": attention_mask}  # fmt: skip
        model_drafter = BatchModelDrafter(drafter, device, draft_encoder)
    else:
        row_drafters = [copy.deepcopy(drafter) for _ in range(batch)]
        for b, d in enumerate(row_drafters):
            if encoder_decoder:
                row_mask = None if attention_mask is None else attention_mask[b : b + 1]
                d.start(prompts[b], device=device, encoder_input_ids=input_ids[b : b + 1],
                        encoder_attention_mask=row_mask)  # fmt: skip
            else:
                d.start(prompts[b], device=device)

    with contextlib.ExitStack() as undo:  # undone in reverse: a model that is target and draft ends as it began
        undo.callback(switch(True))
        if draft_switch is not None:
            undo.callback(draft_switch(True))
        runner.prefill(prompts)
        needs_row_states(runner, "target", target_row_states)
        if model_drafter is not None:
            model_drafter.start(prompts)
            needs_row_states(model_drafter.runner, "draft model", draft_row_states)
        # greedy rows with lookup drafts: the batch's width chosen by measured tokens per second, as a
        # server's (greedy output does not depend on timing; sampled rows share one generator, so a
        # timed width would change which draw each row gets: they keep the reproducible schedule)
        timed = timed and model_drafter is None and not verifier.do_sample
        gate = DraftGate(num_draft_tokens, packed=runner.packs_rows) if timed else None
        out = _loop(runner, model_drafter, row_drafters, verifier, prompts, num_draft_tokens, adaptive,
                    max_new_tokens, eos, gate)  # fmt: skip
    prompt_width = input_ids.shape[1] if not encoder_decoder else 1
    prefix = input_ids if not encoder_decoder else torch.tensor([p[:1] for p in prompts], device=device)
    longest = max(len(t) for t in out.new_tokens)
    tail = torch.full((batch, longest), pad_token_id, dtype=torch.long, device=device)
    for b, tokens in enumerate(out.new_tokens):
        tail[b, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
    out.sequences = torch.cat([prefix[:, :prompt_width], tail], dim=1)
    if model_drafter is not None:
        out.draft_forwards = model_drafter.runner.forwards
    return out


def _loop(
    runner: BatchRunner,
    model_drafter: BatchModelDrafter | None,
    row_drafters: list[Drafter],
    verifier: Any,
    prompts: list[list[int]],
    num_draft_tokens: int,
    adaptive: bool,
    max_new_tokens: int,
    eos: frozenset[int],
    gate: DraftGate | None = None,
) -> BatchSpeculativeOutput:
    batch = len(prompts)
    sequences = [list(p) for p in prompts]
    new_tokens: list[list[int]] = [[] for _ in range(batch)]
    out = BatchSpeculativeOutput(
        torch.empty(0), new_tokens, 0, 0, [[] for _ in range(batch)], [[] for _ in range(batch)],
        [[] for _ in range(batch)],
    )  # fmt: skip
    schedules = [DraftLength(num_draft_tokens, adaptive=adaptive) for _ in range(batch)]
    active = list(range(batch))  # original row numbers of the rows still in the batch
    seen: list[torch.Tensor] | None = None  # each row's tokens (`[vocab]` bool), for a repetition penalty
    shadow_turn = 0  # the row the next step's shadow proposals start from (a timed gate)
    while active:
        started = time.perf_counter()
        seqs = [sequences[r] for r in active]
        asked = [num_draft_tokens if gate is not None else schedules[r].current for r in active]
        if gate is not None and not gate.worth_asking(len(active), num_draft_tokens):
            shadows, first = gate.shadow_rows(len(active)), shadow_turn  # a few rows, in turn, offer one token
            shadow_turn += shadows
            asked = [min(n, int((i - first) % len(active) < shadows)) for i, n in enumerate(asked)]
        budgets = [min(n, max_new_tokens - len(new_tokens[r]) - 1) for r, n in zip(active, asked, strict=True)]
        if model_drafter is not None:
            drafts = model_drafter.propose(seqs, budgets, verifier)
        else:
            drafts = [row_drafters[r].propose(s, n, verifier.pick) if n > 0 else Draft([])
                      for r, s, n in zip(active, seqs, budgets, strict=True)]  # fmt: skip
        drafts = offered = [check_draft(d, max(n, 0), runner.model.vocab_size)
                            for d, n in zip(drafts, budgets, strict=True)]  # fmt: skip
        if gate is not None:  # one width for the batch, as far as the rows' matches pay
            width = gate.batch_width([(len(d.tokens), d.match) for d in offered], num_draft_tokens)
            drafts = [Draft(d.tokens[:width], None if d.probs is None else d.probs[:width], d.match) for d in offered]
        drafted = time.perf_counter()
        logits = runner.feed([[s[-1], *d.tokens] for s, d in zip(seqs, drafts, strict=True)], [s[-1] for s in seqs])
        keep, finished = [], []
        if verifier.sampling.penalized and seen is None:  # (its own prompt's tokens: padding is none of them)
            seen = [torch.zeros(logits.shape[-1], dtype=torch.bool, device=logits.device) for _ in range(batch)]
            for row, prompt in zip(seen, prompts, strict=True):
                row[torch.tensor(prompt, device=logits.device)] = True
        for i, r in enumerate(active):  # (a short row's end tokens, at its positions before min_new_tokens)
            verifier.ban(logits[i], len(new_tokens[r]))
        if seen is None:
            verdicts = verifier.verify_rows(drafts, logits)  # (greedy: reads the choices to the host)
        else:  # each row penalized for its own tokens, its draft's included at each position it is checked at
            verdicts = [verifier.verify(d, logits[i, : len(d.tokens) + 1], None, seen[r])
                        for i, (r, d) in enumerate(zip(active, drafts, strict=True))]  # fmt: skip
        if gate is not None:
            _record(gate, runner, drafts, offered, verdicts, time.perf_counter() - drafted, drafted - started)
        for i, (r, draft, (accepted, emitted)) in enumerate(zip(active, drafts, verdicts, strict=True)):
            schedules[r].update(len(draft.tokens), accepted)
            emitted = emitted[: max_new_tokens - len(new_tokens[r])]
            hit = next((j for j, t in enumerate(emitted) if t in eos), None)
            if hit is not None:
                emitted = emitted[: hit + 1]
            sequences[r].extend(emitted)
            new_tokens[r].extend(emitted)
            if seen is not None and emitted:
                seen[r][torch.tensor(emitted, device=logits.device)] = True
            out.proposed_per_step[r].append(len(draft.tokens))
            out.accepted_per_step[r].append(accepted)
            out.emitted_per_step[r].append(len(emitted))
            keep.append(runner.held[i] - logits.shape[1] + 1 + accepted)  # the fed last token and accepted drafts
            if hit is not None or len(new_tokens[r]) >= max_new_tokens:
                finished.append(i)
        runner.keep(keep)
        if model_drafter is not None:
            model_drafter.accept([sequences[r] for r in active])
        else:
            for r in active:
                row_drafters[r].accept(sequences[r])
        if finished:
            staying = [i for i in range(len(active)) if i not in finished]
            active = [active[i] for i in staying]
            if staying:
                runner.select(staying)
                if model_drafter is not None:
                    model_drafter.select(staying)
    out.target_forwards = runner.forwards
    return out


def _record(gate: DraftGate, runner: BatchRunner, drafts: list[Draft], offered: list[Draft],
            verdicts: list[tuple[int, list[int]]], seconds: float, draft_seconds: float) -> None:  # fmt: skip
    """What a timed step tells the gate: the forward's seconds and what it fed, each row's draft
    and how much of it was accepted (a row that fed none: its first offered token judged against
    the token it got, a shadow)."""
    width = max(len(d.tokens) for d in drafts)
    counts = [1 + len(d.tokens) for d in drafts]
    judged = [(len(d.tokens), accepted, d.match) if d.tokens
              else (min(len(o.tokens), 1), int(bool(o.tokens) and o.tokens[0] == emitted[0]), o.match)
              for d, o, (accepted, emitted) in zip(drafts, offered, verdicts, strict=True)]  # fmt: skip
    fed = packed_tokens(counts) if runner.packs_rows and width else None
    gate.record_batch(width, seconds, judged, sum(len(e) for _, e in verdicts), draft_seconds,
                      sum(len(o.tokens) for o in offered), fed)
