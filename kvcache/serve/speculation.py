"""The engine's decode step with speculation: every row drafts (by prompt lookup in its own text,
or with the server's draft model and a draft cache of its own), all rows are verified in one
forward, and each row is cropped by its own count.

A row's draft stops at its next chunk boundary, so a row's kept tokens land on every boundary
exactly and the prefix store can take the state there (a step past a boundary would leave no
state at it), and at its next quantized block boundary (a verify forward's queries then see what
single steps would see quantized: `Cache.forward_segments`). Rows with shorter drafts are padded
with their own last token, never accepted. The acceptance rule is the speculative-decoding one
(`kvcache.generation.speculative`): greedy rows keep the drafts the target's argmax agrees with,
sampling rows follow the speculative-sampling rule, so the output is the target's own either way.
"""

from __future__ import annotations

from typing import Any

import torch

from ..generation.drafters import Draft
from ..generation.speculative import Verifier


def speculative_step(engine: Any) -> None:
    rows, cache = engine._rows, engine._cache
    drafts, verifiers = [], []
    for request in rows:
        to_boundary = engine.draft_step - request.session.length % engine.draft_step
        budget = min(engine.speculative, request.max_tokens - len(request.tokens) - 1, to_boundary - 1)
        sequence = request.prompt + request.tokens
        verifier = Verifier(request.sampling, request.generator)  # a draft model picks as the row samples
        verifiers.append(verifier)
        drafts.append(request.drafter.propose(sequence, budget, verifier.pick) if budget > 0 else Draft([]))
    width = 1 + max(len(d.tokens) for d in drafts)
    padded = [[r.pending, *d.tokens, *[r.pending] * (width - 1 - len(d.tokens))]
              for r, d in zip(rows, drafts, strict=True)]
    ids = torch.tensor(padded, dtype=torch.long, device=engine.device)
    cache.activate_past_recording()
    logits = engine.model(ids, cache=cache, **engine.row_inputs(width))
    verdicts = [verifier.verify(draft, logits[b, : len(draft.tokens) + 1])
                for b, (verifier, draft) in enumerate(zip(verifiers, drafts, strict=True))]
    drops = [width - 1 - accepted for accepted, _ in verdicts]
    if any(drops):
        cache.crop([-d for d in drops])
    cache.crop(0)
    keep = []
    for b, (request, draft, (accepted, emitted)) in enumerate(zip(rows, drafts, verdicts, strict=True)):
        request.session.advance([request.pending, *draft.tokens[:accepted]], engine.row_capture(b))
        for token in emitted:
            engine._emit(request, token)
            if request.finish_reason is not None:
                break
        request.drafter.accept(request.prompt + request.tokens)
        if request.finish_reason is None:
            keep.append(b)
    engine._keep(keep)
