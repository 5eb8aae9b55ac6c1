"""A newcomer's prefill in the server: its prefix-store lookup, then its prompt in blocks as large
as the engine's token budget allows.

The block a forward feeds is independent of the store's chunk size: chunks are where states are
kept, blocks are how much is computed at once. A block that does not finish the prompt ends on a
chunk boundary, and is at most the layers' `prefill_span` long, so that every boundary it passed
can still be captured from the cache after the forward (full attention keeps every token; a
sliding window records the block, keeping its tokens until they are taken; a recurrent state
exists only at the block's end, so models with one feed a chunk per block, several newcomers per
engine turn). Each boundary goes to the
store (`StoreSession.fed`), its encoding and writing on the store's background writer.

Newcomers whose whole prompt is computed in one block and that found nothing in the store are
prefilled together (`feed_together`): one forward of their prompts left-padded to the longest, as
the running batch pads its rows, instead of one forward each. A forward costs far more than its
tokens on a small batch (a 15-token prompt alone costs about what 32 decode rows do), so a burst
of newcomers gets its first tokens in one forward's time. Newcomers that continue cached prefixes
(a shared system prompt found in the store) are prefilled together too (`feed_past_together`):
their caches stacked, the rests of their prompts right-padded. Models that cannot be padded
(recurrent states) feed newcomers in lockstep instead (`feed_lockstep`): those holding as many
tokens whose next blocks are alike share one forward, no padding, rows at the same positions.
"""

from __future__ import annotations

import traceback
from typing import Any

import torch

from ..cache import Cache
from ..layers.dynamic import DynamicLayer
from ..layers.empty import EmptyLayer
from ..layers.hybrid import HybridLayer
from ..layers.recurrent import RecurrentLayer
from ..layers.sliding import SlidingWindowLayer
from ..protocol import last_logits, takes_logits_to_keep
from ..store.payloads import capture_back, prefill_span
from ..store.quant_payloads import quantized_capturable
from . import rows as batch_rows
from .logprobs import score_prompts

#: Tokens the first waiting prompt may be fed in one block while no row decodes or waits to join:
#: the budget bounds how long running rows wait for a step, and then none wait. A cold 1,000-token
#: prompt in one forward instead of four of 256 tokens: 0.9-1.1x a prefill without a store
#: against 1.3-1.4x (benchmarks/serve.py, the cold-prompt table).
IDLE_STEP_TOKENS = 2048


def block_limit(model: Any, chunk: int) -> int:
    """The longest prefill block for `model`'s cache layers with store chunks of `chunk` tokens."""
    return min(prefill_span(layer, chunk) for layer in model.new_cache())


def start(engine: Any, request: Any) -> None:
    """Look `request`'s prompt up in the store: its cache starts from the longest stored prefix
    that leaves at least one prompt token to feed (the first token's logits come from it)."""
    chunk = engine.store.chunk_size
    if engine.identity is None:  # once per server: the served model does not change while it serves
        engine.identity = engine.store.identity(engine.model)
    request.session = engine.store.session(engine.model, engine.identity)
    limit = (len(request.prompt) - 1) // chunk * chunk
    request.cached_tokens, request.cache = request.session.lookup(request.prompt, max_tokens=limit)
    engine.metrics.prefix_lookups.inc()
    if request.cached_tokens:
        engine.metrics.prefix_hits.inc()
        engine.metrics.tokens_reused.inc(request.cached_tokens)


def next_block(engine: Any, request: Any, budget: int) -> int:
    """How many tokens `request`'s next prefill block feeds with `budget`: the rest of its prompt,
    or up to the last chunk boundary the budget and the layers' span reach (0: none reached)."""
    chunk, held = engine.store.chunk_size, request.session.length
    rest = len(request.prompt) - held
    n = min(rest, budget, engine.block_limit)
    if n < rest:
        n = (held + n) // chunk * chunk - held
    return max(n, 0)


def feed(engine: Any, request: Any, budget: int) -> tuple[int, torch.Tensor | None]:
    """Feed the next block of `request`'s prompt, at most `budget` tokens: the tokens fed, and the
    last position's logits `[1, vocab]` once the prompt is done (else None). Feeds nothing (0)
    when the budget does not reach the next chunk boundary and the prompt goes on past it."""
    session, cache, prompt = request.session, request.cache, request.prompt
    chunk = engine.store.chunk_size
    held = session.length
    n = next_block(engine, request, budget)
    if n <= 0:
        return 0, None
    end = held + n
    ids = torch.tensor([prompt[held:end]], dtype=torch.long, device=engine.device)
    positions = torch.arange(held, end, device=engine.device)[None]
    windows = [layer for layer in cache if type(layer) is SlidingWindowLayer or quantized_capturable(layer, chunk)
               ] if n > chunk else []  # fmt: skip
    for layer in windows:  # keep the block's tokens past the window (and every boundary's codes) until taken
        layer.activate_past_recording()
    logits = engine.model(ids, cache=cache, position_ids=positions, **last_logits(engine.model))
    session.fed(n, lambda s, e: [capture_back(layer, s, e, end) for layer in cache])
    for layer in windows:
        layer.record_past = False  # commit: the window evicts what it no longer needs
    return n, (logits[:, -1] if end == len(prompt) else None)


def groupable(model: Any) -> bool:
    """Whether `model`'s prompts may be prefilled together, left-padded: only where padding changes
    nothing a row keeps. Attention layers mask the pads out; a recurrent state would run over them,
    and a quantized layer's blocks sit at absolute positions that padding would shift."""
    return all(type(layer) in (DynamicLayer, SlidingWindowLayer, EmptyLayer) for layer in model.new_cache())


#: Layers whose rows of equal lengths a forward computes as each row alone: no padding is needed,
#: so recurrent states batch as well as attention does (quantized layers are batched per request).
_LOCKSTEP = (DynamicLayer, SlidingWindowLayer, EmptyLayer, RecurrentLayer)


def lockstep(model: Any) -> bool:
    """Whether newcomers of `model` that hold the same number of tokens may feed blocks of the same
    length in one forward (`feed_lockstep`): for models that cannot be padded (`groupable` is
    False: recurrent states), so that a burst of newcomers is not prefilled one forward each."""
    layers = [part for layer in model.new_cache() for part in
              ((layer.attention, layer.recurrent) if isinstance(layer, HybridLayer) else (layer,))]  # fmt: skip
    return all(type(layer) in _LOCKSTEP for layer in layers)


def lockstep_followers(engine: Any, first: Any, n: int, others: list[Any], budget: int) -> list[Any]:
    """Those of `others` (in order) whose next block is `first`'s: the same tokens held, `n` tokens
    that end their prompt or a chunk, at most one chunk (the one boundary a recurrent state gives);
    as many as `budget` leaves after `first`'s block."""
    held, chunk = first.session.length, engine.store.chunk_size
    if not engine.lockstep or not 0 < n <= chunk:
        return []
    followers = []
    for request in others:
        if len(followers) + 2 > budget // n:
            break
        rest = len(request.prompt) - held
        if request.session is not None and request.session.length == held and (
                rest == n or (rest > n and (held + n) % chunk == 0)):  # fmt: skip
            followers.append(request)
    return followers


def feed_lockstep(engine: Any, requests: list[Any], n: int) -> list[torch.Tensor | None]:
    """Feed the next `n` prompt tokens of `requests` (all holding as many tokens) in one forward of
    their stacked caches, no padding; store each one's chunk boundary. A request whose prompt is
    done gets `rows` (its row of the batch) and its last logits `[1, vocab]`; the others get a
    cache of their own back (None)."""
    held = requests[0].session.length
    end = held + n
    device = engine.device
    cache = batch_rows.stack([batch_rows.single(r.cache) for r in requests])[0] if held else engine.model.new_cache()
    ids = torch.tensor([r.prompt[held:end] for r in requests], dtype=torch.long, device=device)
    positions = torch.arange(held, end, device=device)[None].expand(len(requests), n)
    logits = engine.model(ids, cache=cache, position_ids=positions, **last_logits(engine.model))[:, -1]
    outputs: list[torch.Tensor | None] = []
    for b, request in enumerate(requests):
        request.session.fed(n, lambda s, e, b=b: batch_rows.row_payloads(cache, b, 0, s, e))
        if end == len(request.prompt):
            request.cache, request.rows = None, [batch_rows.row_state(layer, b, 0) for layer in cache]
            outputs.append(logits[b : b + 1])
        else:
            request.cache = Cache([batch_rows.row_layer(layer, b, 0) for layer in cache])
            outputs.append(None)
    return outputs


def group_of(engine: Any, waiting: list[Any], budget: int) -> list[Any]:
    """The newcomers of `waiting` (looked up, in order of arrival) to prefill together this turn,
    as many as fit `budget` padded to the longest, the rest of whose prompt fits one block of the
    model's layers: the cold ones (nothing found in the store, nothing fed yet) where there are two
    or more, else those that continue a cached prefix. None for a model that is not `groupable`."""
    if not engine.group_prefill:
        return []
    eligible = [r for r in waiting if not r.alone and len(r.prompt) - r.session.length <= engine.block_limit]
    cold = [r for r in eligible if not r.session.length]
    group: list[Any] = []
    width = 0
    for request in cold if len(cold) > 1 else [r for r in eligible if r.session.length]:
        n = len(request.prompt) - request.session.length
        if max(width, n) * (len(group) + 1) > budget:
            break
        group.append(request)
        width = max(width, n)
    return group


def feed_group(engine: Any, requests: list[Any]) -> list[torch.Tensor]:
    """Prefill a `group_of` in one forward (`feed_together` or `feed_past_together`)."""
    return (feed_past_together if requests[0].session.length else feed_together)(engine, requests)


def feed_together(engine: Any, requests: list[Any]) -> list[torch.Tensor]:
    """Prefill the prompts of `requests` (a `group_of`) in one forward, left-padded to the
    longest; store each prompt's chunk boundaries. Each request gets `rows` (its row of the batch,
    as `rows.stack` takes it) instead of a cache of its own. Returns each one's last logits `[1, vocab]`."""
    device, prompts = engine.device, [r.prompt for r in requests]
    width = max(len(p) for p in prompts)
    pads = [width - len(p) for p in prompts]
    ids = torch.tensor([[0] * pad + p for pad, p in zip(pads, prompts, strict=True)], dtype=torch.long, device=device)
    pad_column = torch.tensor(pads, device=device)[:, None]
    positions = (torch.arange(width, device=device)[None] - pad_column).clamp(min=0)
    mask = (torch.arange(width, device=device)[None] >= pad_column).long()
    cache = engine.model.new_cache()
    windows = [layer for layer in cache if type(layer) is SlidingWindowLayer] if width > engine.store.chunk_size else []
    for layer in windows:  # keep the block's tokens past the window until its chunks are taken
        layer.activate_past_recording()
    logits = engine.model(ids, cache=cache, attention_mask=mask, position_ids=positions,
                          **last_logits(engine.model))[:, -1]  # fmt: skip
    for b, (request, pad) in enumerate(zip(requests, pads, strict=True)):
        held = len(request.prompt)
        request.session.fed(held, lambda s, e, b=b, pad=pad, held=held: batch_rows.row_payloads_back(
            cache, b, pad, s, e, held))  # fmt: skip
    for layer in windows:
        layer.record_past = False  # commit: the window evicts what it no longer needs
    for b, (request, pad) in enumerate(zip(requests, pads, strict=True)):
        request.cache, request.rows = None, [batch_rows.row_state(layer, b, pad) for layer in cache]
    return [logits[b : b + 1] for b in range(len(requests))]


def feed_past_together(engine: Any, requests: list[Any]) -> list[torch.Tensor]:
    """Prefill the rest of the prompts of `requests`, which continue cached prefixes (a store hit,
    or blocks fed earlier), in one forward instead of one each: their caches stacked as the running
    batch stacks rows (right-aligned, left padding), the rests right-padded to the longest. Each
    row's real tokens stay contiguous (a sliding window sees the distances it would alone); what a
    row's padding computes lies after its last token, where no query of the row looks, and is left
    out of its row state (and out of the computation, where the model `packs_rows`). Stores each
prompt's chunk boundaries; gives each request `rows`.
    Returns each one's last logits `[1, vocab]`."""
    device = engine.device
    cache, pads = batch_rows.stack([batch_rows.single(r.cache) for r in requests])
    past = [r.session.length for r in requests]
    rests = [r.prompt[held:] for r, held in zip(requests, past, strict=True)]
    width, physical = max(map(len, rests)), cache.get_seq_length()
    ids = torch.tensor([rest + [0] * (width - len(rest)) for rest in rests], dtype=torch.long, device=device)
    positions = torch.tensor(past, device=device)[:, None] + torch.arange(width, device=device)
    mask = (torch.arange(physical + width, device=device)[None] >= torch.tensor(pads, device=device)[:, None]).long()
    for layer in cache:
        if type(layer) is SlidingWindowLayer:  # keeps every row's tokens, whatever a longer row fed after them
            layer.activate_past_recording()
    keep = width - min(map(len, rests)) + 1  # the columns holding some row's last token
    kwargs: dict[str, Any] = {"logits_to_keep": keep} if takes_logits_to_keep(engine.model) else {}
    if engine.packs_rows and keep > 1:  # the shorter rests' padding is left out of the linear layers
        kwargs["tokens_per_row"] = [len(rest) for rest in rests]
    logits = engine.model(ids, cache=cache, attention_mask=mask, position_ids=positions, **kwargs)[:, -keep:]
    out = []
    for b, (request, pad, held) in enumerate(zip(requests, pads, past, strict=True)):
        end = held + len(rests[b])  # the row's real tokens: physical slots [pad, pad + end)
        request.session.fed(len(rests[b]), lambda s, e, b=b, pad=pad, end=end: (
            batch_rows.held_payloads(cache, b, pad, s, e) if e < end
            else batch_rows.row_payloads(cache, b, pad, s, e, pad + end)))  # fmt: skip
        request.cache, request.rows = None, [batch_rows.row_state(layer, b, pad, pad + end) for layer in cache]
        out.append(logits[b : b + 1, len(rests[b]) - 1 - (width - keep)])
    return out


def prefill_turn(engine: Any) -> None:
    """Spend this turn's budget on the waiting prompts, in order of arrival, as many as there
    are free rows for: the prompts whose rest fits one forward together first (`group_of`:
    cold ones, or ones that continue cached prefixes), then the rest one by one. The first
    prompt is fed at least one chunk, so prefills always move, and while no row decodes or
    waits to join, up to `IDLE_STEP_TOKENS` (no one waits on that forward)."""
    score_prompts(engine)
    budget = engine.max_step_tokens - len(engine._rows) * (1 + engine.draft_width)
    slots = engine.max_batch - len(engine._rows) - len(engine._ready)
    waiting = []
    for request in list(engine._prefilling)[: max(slots, 0)]:
        try:
            if request.session is None:
                start(engine, request)
            waiting.append(request)
        except Exception as exc:  # this prompt's own failure: it alone ends
            engine._drop_failed(request, exc)
    group = group_of(engine, waiting, budget)
    if len(group) > 1:
        width = max(len(r.prompt) - r.session.length for r in group)
        try:
            outputs = feed_group(engine, group)
        except Exception:  # the group's forward: each member is prefilled alone instead
            traceback.print_exc()
            for request in group:
                request.alone, request.session, request.rows = True, None, None
        else:
            budget -= len(group) * width
            waiting = [r for r in waiting if r not in group]
            for request, logits in zip(group, outputs, strict=True):
                try:
                    engine._prefilled(request, logits)
                except Exception as exc:  # its first token's sampling: it alone ends
                    engine._drop_failed(request, exc)
    position = 0
    while position < len(waiting):
        request = waiting[position]
        floor = engine.store.chunk_size if position == 0 and len(group) < 2 else 1
        if position == 0 and not engine._rows and not engine._ready:  # nobody waits on this forward
            floor = max(floor, IDLE_STEP_TOKENS)
        try:
            if request.session is None:  # (a failed group's member, looked up again)
                start(engine, request)
            n = next_block(engine, request, max(budget, floor))
            followers = lockstep_followers(engine, request, n, waiting[position + 1 :], max(budget, floor))
            if followers:
                fed = _feed_together_in_lockstep(engine, [request, *followers], n)
                waiting = [r for r in waiting if r not in followers]
            else:
                fed, logits = feed(engine, request, max(budget, floor))
                if logits is not None:
                    engine._prefilled(request, logits)
        except Exception as exc:  # this prompt's own failure: it alone ends
            engine._drop_failed(request, exc)
            position += 1
            continue
        position += 1
        budget -= fed
        if budget <= 0 or fed == 0:
            break


def _feed_together_in_lockstep(engine: Any, requests: list[Any], n: int) -> int:
    """`feed_lockstep`, then each request whose prompt is done has its first token; a failed forward
    feeds each of them alone instead. Returns the tokens fed."""
    try:
        outputs = feed_lockstep(engine, requests, n)
    except Exception:  # the group's forward: each member is fed alone instead
        traceback.print_exc()
        fed = 0
        for request in requests:
            try:
                tokens, logits = feed(engine, request, n)
                fed += tokens
                if logits is not None:
                    engine._prefilled(request, logits)
            except Exception as exc:  # this prompt's own failure: it alone ends
                engine._drop_failed(request, exc)
        return fed
    for request, logits in zip(requests, outputs, strict=True):
        if logits is not None:
            try:
                engine._prefilled(request, logits)
            except Exception as exc:  # its first token's sampling: it alone ends
                engine._drop_failed(request, exc)
    return n * len(requests)
