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
"""

from __future__ import annotations

from typing import Any

import torch

from ..layers.sliding import SlidingWindowLayer
from ..store.payloads import capture_back, prefill_span


def block_limit(model: Any, chunk: int) -> int:
    """The longest prefill block for `model`'s cache layers with store chunks of `chunk` tokens."""
    return min(prefill_span(layer, chunk) for layer in model.new_cache())


def start(engine: Any, request: Any) -> None:
    """Look `request`'s prompt up in the store: its cache starts from the longest stored prefix
    that leaves at least one prompt token to feed (the first token's logits come from it)."""
    chunk = engine.store.chunk_size
    request.session = engine.store.session(engine.model)
    limit = (len(request.prompt) - 1) // chunk * chunk
    request.cached_tokens, request.cache = request.session.lookup(request.prompt, max_tokens=limit)
    engine.metrics.prefix_lookups.inc()
    if request.cached_tokens:
        engine.metrics.prefix_hits.inc()
        engine.metrics.tokens_reused.inc(request.cached_tokens)


def feed(engine: Any, request: Any, budget: int) -> tuple[int, torch.Tensor | None]:
    """Feed the next block of `request`'s prompt, at most `budget` tokens: the tokens fed, and the
    last position's logits `[1, vocab]` once the prompt is done (else None). Feeds nothing (0)
    when the budget does not reach the next chunk boundary and the prompt goes on past it."""
    session, cache, prompt = request.session, request.cache, request.prompt
    chunk = engine.store.chunk_size
    held = session.length
    rest = len(prompt) - held
    n = min(rest, budget, engine.block_limit)
    if n < rest:
        n = (held + n) // chunk * chunk - held
    if n <= 0:
        return 0, None
    end = held + n
    ids = torch.tensor([prompt[held:end]], dtype=torch.long, device=engine.device)
    positions = torch.arange(held, end, device=engine.device)[None]
    windows = [layer for layer in cache if type(layer) is SlidingWindowLayer] if n > chunk else []
    for layer in windows:  # keep the block's tokens past the window until its chunks are taken
        layer.activate_past_recording()
    logits = engine.model(ids, cache=cache, position_ids=positions)
    session.fed(n, lambda s, e: [capture_back(layer, s, e, end) for layer in cache])
    for layer in windows:
        layer.record_past = False  # commit: the window evicts what it no longer needs
    return n, (logits[:, -1] if end == len(prompt) else None)
