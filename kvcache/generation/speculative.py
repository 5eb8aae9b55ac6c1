"""Speculative decoding with exact rollback of both caches, for every model and layer kind.

A drafter proposes k tokens; the target verifies them in one forward; the longest accepted prefix
plus one token from the target are kept, and both caches are cropped back to exactly the kept
tokens and committed. With greedy decoding the output is the target's own greedy output; with
sampling the standard speculative-sampling rule (Leviathan et al. 2023, Chen et al. 2023) keeps the
output distribution equal to the target's. Drafts that are point masses (prompt lookup, suffix
drafting) are verified by drawing the target's own token at each position in turn and keeping the
draft while they agree: for a point mass that is the same rule (a draft token is kept with
probability p(x); a rejection's token follows p without x), and it draws exactly what plain
sampling draws, so a seeded sampled run of one sequence returns plain sampling's tokens, seed for
seed (a batch shares its generator, drawn in another order than plain batched steps draw it: the
same distribution, other draws).

Recurrent layers can be cropped inside the verify forward only when the model handed the cache the
per-token intermediate states (the reference models' `set_return_intermediate_states`, wrapped
transformers Mamba2 / Qwen3-Next through `set_per_token_recurrence`); otherwise the target is
cropped to the start of the verify forward and the accepted tokens are fed again, in front of the
next verify forward (so a rejection costs no forward of its own; when many such tokens pile up,
one plain step feeds them). `SpeculativeOutput` says which ran. With greedy decoding or
point-mass drafts and `draft_schedule="adaptive"` (the default) each step drafts the number of tokens, none included,
that the run's own measurements say gives the most tokens per second (`DraftGate`); a step that
drafts nothing is not recorded for rollback, so it costs what a plain decoding step costs.

A batch (several rows, or a left-padded one) goes through `speculative_batch`: rows accept
different numbers of tokens and the caches are cropped per row.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch

from ..cache import Cache
from ..errors import GenerationError
from .draft_schedule import DraftGate, DraftLength
from .drafters import Draft, Drafter, ModelDrafter, check_draft
from .inputs import (
    check_cache,
    check_generator,
    check_ids,
    check_int,
    check_mask,
    check_model,
    check_token_list,
    model_default,
    probe_cache,
)
from .sampling import Sampling
from .speculative_batch import BatchSpeculativeOutput, speculate_batch
from .speculative_runner import NO_ROLLBACK, REFEED, ModelRunner
from .switches import intermediate_states_switch
from .verifier import Verifier


@dataclass
class SpeculativeOutput:
    """What `speculative_generate` produced, and how the speculation went.

    `cache` is the target's cache holding every token of `sequences` but the last (as after plain
    decoding); `draft_cache` the draft model's (None for model-free drafters). Per verification
    step: `proposed_per_step` draft tokens proposed, `accepted_per_step` of them accepted,
    `emitted_per_step` tokens appended (accepted ones plus the target's own, cut at eos and
    `max_new_tokens`). `target_rollback_paths` counts the steps by how the target cache was cut back:
    "none" (nothing to drop), "crop" (one exact crop; for recurrent layers this needs intermediate
    states) or "refeed" (crop to the step start and feed the accepted tokens again).
    """

    sequences: torch.Tensor
    cache: Cache
    draft_cache: Cache | None
    target_forwards: int
    draft_forwards: int
    proposed_per_step: list[int] = field(default_factory=list)
    accepted_per_step: list[int] = field(default_factory=list)
    emitted_per_step: list[int] = field(default_factory=list)
    target_rollback_paths: Counter[str] = field(default_factory=Counter)
    draft_rollback_paths: Counter[str] = field(default_factory=Counter)

    @property
    def num_new_tokens(self) -> int:
        return sum(self.emitted_per_step)

    @property
    def acceptance_rate(self) -> float:
        """Accepted / proposed draft tokens (0.0 when nothing was proposed)."""
        proposed = sum(self.proposed_per_step)
        return sum(self.accepted_per_step) / proposed if proposed else 0.0

    @property
    def tokens_per_target_forward(self) -> float:
        return self.num_new_tokens / self.target_forwards if self.target_forwards else 0.0

    @property
    def rollback_path(self) -> str:
        """How the target was rolled back: "refeed" if it ever had to re-feed, else "crop" if it
        cropped, else "none"."""
        for path in (REFEED, "crop"):
            if self.target_rollback_paths[path]:
                return path
        return NO_ROLLBACK


def speculative_generate(
    target: Any,
    draft: Any,
    input_ids: torch.Tensor,
    *,
    num_draft_tokens: int = 4,
    max_new_tokens: int,
    min_new_tokens: int = 0,
    eos_token_id: int | list[int] | None = None,
    attention_mask: torch.Tensor | None = None,
    do_sample: bool = False,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    min_p: float = 0.0,
    repetition_penalty: float = 1.0,
    generator: torch.Generator | None = None,
    intermediate_states: bool | None = None,
    cache: Cache | None = None,
    draft_cache: Cache | None = None,
    draft_schedule: str | DraftGate = "adaptive",
    prefix_store: Any = None,
    pad_token_id: int | None = None,
) -> SpeculativeOutput | BatchSpeculativeOutput:
    """Decode `max_new_tokens` tokens (fewer at eos) from `target`, drafting with `draft`.

    `target` is a `CausalLM` (`input_ids` is the prompt) or an `EncoderDecoderLM` (`input_ids` is
    the encoder input; decoding starts from `decoder_start_token_id`). `draft` is a `Drafter`
    (e.g. `PromptLookupDrafter()`) or a draft model of the same kind and vocabulary, which is wrapped
    in a `ModelDrafter`. Each step proposes up to `num_draft_tokens` tokens and verifies them in one
    target forward. Greedy (`do_sample=False`) returns exactly the target's greedy output; sampling
    returns a sample of the target's own (temperature / top-k / top-p processed) distribution, and
    with a drafter that does not sample (prompt lookup, suffix drafting: `Drafter.samples` False)
    exactly the tokens `generate` samples with the same generator state. `repetition_penalty` is
    `generate`'s, applied at every verified position (a draft's own earlier tokens count there), as
    `min_new_tokens` is (no end token verified before that many new tokens);
    each row of a batch is penalized for its own tokens alone (padding is none of them).
    `intermediate_states`: have a model with `set_return_intermediate_states` hand its per-token
    recurrent states to the cache during verification, so rejected tokens are cropped in place;
    None = whenever the target supports it; False = never (rollback re-feeds the accepted tokens).
    A batch (`input_ids` `[batch, seq]` left-padded with `attention_mask`; for encoder-decoder
    targets the encoder input and its mask) decodes every row at once, each row accepting its own
    number of draft tokens and stopping at its own eos or `max_new_tokens` (then `pad_token_id`,
    default the first eos id); it returns a `BatchSpeculativeOutput` with per-row statistics.
    Greedy batches return, row for row, what batched greedy `generate` returns. Recurrent layers
    (target or draft model) must record every token's state there: `set_return_intermediate_states`
    (reference models) or `set_per_token_recurrence` (wrapped transformers Mamba2 / Qwen3-Next);
    `cache`, `draft_cache` and `prefix_store` are for batch size 1.
    `cache` / `draft_cache` continue existing caches of the target / the draft model (a loaded prompt
    cache, or the `cache` and `draft_cache` a previous call returned), as `generate` does: pass the
    whole sequence so far as `input_ids`; what a cache already holds is skipped. Decoder-only
    targets; each cache is checked against its model before any work.
    `draft_schedule`: "acceptance" (start at `num_draft_tokens`, at most that many; down by one
    after a rejection, never below 1, up by two after a fully accepted draft); "adaptive" (the
    default: for greedy decoding, each step drafts the length from 0 to `num_draft_tokens` with
    the most expected tokens per second, from what forwards, the drafter and its acceptance cost
    and earned so far in the run, the acceptance kept current by one-token shadow proposals while
    not drafting; sampling with a draft model uses "acceptance", which keeps seeded runs
    reproducible, and so do batches that sample or draft with a model, row by row; a greedy batch
    with another drafter feeds one width for all its rows, chosen so, as a server's batches do);
    "constant" (always `num_draft_tokens`). Greedy
    output does not depend on it, nor does sampled output with drafts that are point masses.
    A `DraftGate(num_draft_tokens)` is "adaptive" carried from call to call: what earlier runs
    measured (forward costs, acceptance, the draft length reached) decides this run's first steps,
    instead of a fresh start that probes from plain steps and one-token drafts; pass one per agent
    session or server, as `SuffixDrafter`'s corpus is (single-row runs, greedy or with a drafter
    that does not sample).
    `prefix_store`: the target starts from the prompt's longest stored prefix, as in `generate`.
    """
    encoder_decoder = check_model(target)
    drafter = _as_drafter(target, draft, encoder_decoder)
    input_ids = check_ids("input_ids", input_ids, int(target.vocab_size))
    batched = _is_batch(input_ids, attention_mask)
    check_int("num_draft_tokens", num_draft_tokens, minimum=1)
    check_int("max_new_tokens", max_new_tokens, minimum=1)
    check_int("min_new_tokens", min_new_tokens, minimum=0)
    carried = draft_schedule if isinstance(draft_schedule, DraftGate) else None
    if carried is not None:
        sampled_drafts = do_sample and drafter.samples
        if carried.maximum != num_draft_tokens or sampled_drafts or batched:
            raise GenerationError(
                f"a DraftGate carried across calls serves single-row runs of its own maximum, greedy or with a "
                f"drafter that does not sample: it drafts up to {carried.maximum} tokens, this call asks for "
                f"{num_draft_tokens}{', samples drafts' if sampled_drafts else ''}{', is a batch' if batched else ''}",
                param="draft_schedule",
            )
        draft_schedule = "adaptive"
    elif draft_schedule not in SCHEDULES:
        names = ", ".join(map(repr, SCHEDULES))
        raise GenerationError(
            f"draft_schedule must be one of {names} or a DraftGate, got {draft_schedule!r}", param="draft_schedule"
        )
    eos_token_id = model_default(target, "eos_token_id", eos_token_id)
    pad_token_id = model_default(target, "pad_token_id", pad_token_id)
    eos = frozenset(check_token_list("eos_token_id", eos_token_id, int(target.vocab_size)))
    device = input_ids.device
    check_generator(generator, device)
    verifier = Verifier(Sampling(do_sample, temperature, top_k, top_p, min_p, repetition_penalty=repetition_penalty),
                        generator, ends=eos, min_new_tokens=min_new_tokens)  # fmt: skip
    use_intermediate = intermediate_states_switch(target, intermediate_states)
    if batched:
        return speculate_batch(target, drafter, verifier, input_ids, attention_mask, encoder_decoder,
                               num_draft_tokens, draft_schedule, max_new_tokens, eos, pad_token_id,
                               intermediate_states, (cache, draft_cache, prefix_store))  # fmt: skip
    _check_given_caches(target, drafter, input_ids, cache, draft_cache, encoder_decoder)
    if prefix_store is not None:
        from ..store import prefill_for_generation

        cache = prefill_for_generation(prefix_store, target, input_ids, attention_mask, cache, encoder_decoder)[0]

    runner = ModelRunner(
        target,
        device=device,
        encoder_input_ids=input_ids if encoder_decoder else None,
        encoder_attention_mask=attention_mask if encoder_decoder else None,
        cache=cache,
    )
    if encoder_decoder:
        sequence = [int(target.decoder_start_token_id)]
        drafter.start(sequence, device=device, encoder_input_ids=input_ids, encoder_attention_mask=attention_mask)
    else:
        sequence = input_ids[0].tolist()
        if draft_cache is not None:
            drafter.start(sequence, device=device, cache=draft_cache)  # type: ignore[call-arg]
        else:
            drafter.start(sequence, device=device)
    # timing decides when to draft, so a run whose drafts draw from the generator would consume it
    # differently from one run to the next: it keeps the reproducible schedule
    timed = draft_schedule == "adaptive" and not (do_sample and drafter.samples)
    gate = carried or (DraftGate(num_draft_tokens) if timed else None)
    # the gate measures a plain step before any draft, so the prefill may as well give the first token
    first = runner.prefill(sequence, whole=gate is not None)
    restore = use_intermediate(True)
    try:
        schedule = DraftLength(num_draft_tokens, adaptive=draft_schedule != "constant")
        with torch.no_grad():  # one scope for the whole loop: the runners' own ones then cost nothing
            out = _decode(runner, drafter, verifier, sequence, schedule, max_new_tokens, eos, gate, first)
    finally:
        restore()
    out.sequences = torch.tensor([sequence], dtype=torch.long, device=device)
    return out


#: The `draft_schedule` values `speculative_generate` takes.
SCHEDULES = ("adaptive", "acceptance", "constant")
#: How many kept-but-unfed tokens (per draft token allowed) a target that cannot crop inside a
#: forward carries in front of its verify forwards before one plain step feeds them. A plain step
#: forgoes one step of speculation; more pending tokens make each forward longer. At 4, forwards
#: per token stay within 1.1x of the crop path's (tests/test_speculative.py).
PENDING_PER_DRAFT_TOKEN = 4
#: A step that drafts nothing.
NO_DRAFT = Draft([])


def _decode(
    runner: ModelRunner,
    drafter: Drafter,
    verifier: Verifier,
    sequence: list[int],
    schedule: DraftLength,
    max_new_tokens: int,
    eos: frozenset[int],
    gate: DraftGate | None = None,
    first: torch.Tensor | None = None,
) -> SpeculativeOutput:
    """The draft / verify / roll back loop; extends `sequence` in place. `first`: the logits of the
    sequence's last token when the prefill fed it (the first token then costs no forward of its
    own, as in `generate`). A step that drafts nothing costs little more than a forward: this loop
    runs once per token where drafting does not pay."""
    out = SpeculativeOutput(
        sequences=torch.empty(0), cache=runner.cache, draft_cache=None, target_forwards=0, draft_forwards=0
    )
    generated = 0
    seen = None  # the sequence's tokens (`[vocab]` bool), for a repetition penalty
    if verifier.sampling.penalized:
        seen = torch.zeros(runner.vocab_size, dtype=torch.bool, device=runner.device)
        seen[torch.tensor(sequence, device=runner.device)] = True

    def emit(new_tokens: list[int], proposed: int, accepted: int) -> bool:
        """Append the step's tokens (cut at `max_new_tokens` and eos); whether it ended the run."""
        nonlocal generated
        new_tokens = new_tokens[: max_new_tokens - generated]
        hit_eos = bool(eos) and not eos.isdisjoint(new_tokens)
        if hit_eos:
            new_tokens = new_tokens[: next(i for i, t in enumerate(new_tokens) if t in eos) + 1]
        sequence.extend(new_tokens)
        generated += len(new_tokens)
        if seen is not None and new_tokens:
            seen[torch.tensor(new_tokens, device=seen.device)] = True
        out.proposed_per_step.append(proposed)
        out.accepted_per_step.append(accepted)
        out.emitted_per_step.append(len(new_tokens))
        return hit_eos or generated >= max_new_tokens

    done = False
    if first is not None:
        verifier.ban(first[None], 0)
        done = emit(verifier.verify(Draft([]), first[None], None, seen)[1], 0, 0)
        out.draft_rollback_paths[drafter.accept(sequence)] += 1
    while not done:
        # Kept tokens a deferred re-feed left out of the target's cache go in front of this forward.
        # A fully accepted draft leaves the cache whole again; once PENDING_PER_DRAFT_TOKEN per draft
        # token pile up, a plain step (no draft, nothing to roll back) feeds them.
        pending = len(sequence) - 1 - len(runner.tokens)
        allowed = min(schedule.maximum if gate else schedule.current, max_new_tokens - generated - 1)
        if pending >= PENDING_PER_DRAFT_TOKEN * schedule.maximum:
            allowed = 0
        sized = gate is not None and drafter.reports_match  # the draft sized by its own match, once proposed
        if gate is None:
            budget = asked = allowed
        elif sized:
            asked = allowed if gate.budget(allowed, pending, acceptance=gate.best_acceptance) else 0
        else:
            budget = gate.budget(allowed, pending)
            asked = budget
        if gate is not None and not asked:
            asked = int(allowed > 0 and gate.shadow())  # a shadow: judged, not fed
        started = time.perf_counter()
        proposal = NO_DRAFT
        if asked:
            proposal = check_draft(drafter.propose(sequence, asked, verifier.pick), asked, runner.vocab_size)
        drafted = time.perf_counter()
        offered = len(proposal.tokens)
        if sized:
            budget = gate.budget(min(allowed, offered), pending, match=proposal.match) if offered else 0  # type: ignore[union-attr]
            if 0 < budget < offered:
                probs = None if proposal.probs is None else proposal.probs[:budget]
                proposal = Draft(proposal.tokens[:budget], probs, proposal.match)
        fed = proposal.tokens if budget else []
        logits = runner.feed(sequence[len(runner.tokens) :] + fed, rollback=bool(fed))
        if pending:
            logits = logits[pending:]
        verifier.ban(logits, generated)  # (a short answer's end tokens, at the positions before min_new_tokens)
        accepted, new_tokens = verifier.verify(proposal if budget else NO_DRAFT, logits, None, seen)
        if not budget and proposal.tokens:  # the shadow proposal, judged against the target's token
            accepted = int(proposal.tokens[0] == new_tokens[0])
        schedule.update(len(fed), accepted)
        done = emit(new_tokens, len(fed), accepted if budget else 0)
        path = runner.truncate(len(sequence) - 1, defer_refeed=True)
        out.target_rollback_paths[path] += 1
        verified = time.perf_counter()
        out.draft_rollback_paths[drafter.accept(sequence)] += 1
        if gate is not None:
            draft_seconds = drafted - started + time.perf_counter() - verified
            judged = len(fed) if budget else min(offered, 1)  # a shadow: its first token
            gate.record(pending + 1 + len(fed), verified - drafted, judged, accepted, draft_seconds,
                        refed=path == REFEED, shadow=not budget, match=proposal.match, drafted=offered)  # fmt: skip
    if len(runner.tokens) < len(sequence) - 1:  # the returned cache holds every token but the last
        runner.feed(sequence[len(runner.tokens) : -1], rollback=False)
        runner.truncate(len(sequence) - 1)

    out.target_forwards = runner.forwards
    out.draft_forwards = drafter.forwards
    out.draft_cache = drafter.cache
    return out


# ------------------------------------------------------------------------------------- validation
def _as_drafter(target: Any, draft: Any, encoder_decoder: bool) -> Drafter:
    if encoder_decoder and not isinstance(getattr(target, "decoder_start_token_id", None), int):
        raise GenerationError(f"encoder-decoder target {type(target).__name__} has no int decoder_start_token_id")
    drafter = draft if isinstance(draft, Drafter) else ModelDrafter(draft)
    if isinstance(drafter, ModelDrafter):
        if check_model(drafter.model) != encoder_decoder:
            kinds = ("decoder-only", "encoder-decoder")
            raise GenerationError(
                f"the draft model is {kinds[not encoder_decoder]} but the target is {kinds[encoder_decoder]}: "
                "both must be of the same kind"
            )
        if drafter.vocab_size != int(target.vocab_size):
            raise GenerationError(
                f"draft vocabulary ({drafter.vocab_size}) differs from the target's ({target.vocab_size})"
            )
    return drafter


def _check_given_caches(
    target: Any, drafter: Drafter, input_ids: torch.Tensor, cache: Any, draft_cache: Any, encoder_decoder: bool
) -> None:
    """Caches handed in must fit their models (as `generate` checks them) and hold less than the prompt."""
    if (cache is not None or draft_cache is not None) and encoder_decoder:
        raise GenerationError("cache= / draft_cache= are for decoder-only targets")
    if draft_cache is not None and not isinstance(drafter, ModelDrafter):
        raise GenerationError(f"draft_cache= needs a draft model, but the drafter is a {type(drafter).__name__}")
    for given, model in ((cache, target), (draft_cache, getattr(drafter, "model", None))):
        if given is not None:
            check_cache(given, batch_size=1, encoder_decoder=False, source_length=input_ids.shape[1])
            probe_cache(model, given, input_ids, input_ids, False, need_rollback=False)


def _is_batch(input_ids: torch.Tensor, attention_mask: Any) -> bool:
    """Whether the batched path runs: several rows, or one row with padding (checked as
    `generate` checks a left-padding mask)."""
    mask = check_mask(attention_mask, input_ids)
    return input_ids.shape[0] > 1 or (mask is not None and not bool((mask == 1).all()))
