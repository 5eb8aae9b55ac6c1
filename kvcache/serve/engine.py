"""The server's decoding engine: one thread that owns the model and decodes every request together.

Each loop turn does, in order: admit newcomers; spend the turn's token budget (`max_step_tokens`,
less one token per running row) on prefill blocks of the waiting prompts, first come first
served, each alone through the prefix store (`prefill`: a block is as long as the budget allows,
not a store chunk; several newcomers may be fed in one turn); hand their first tokens to the web
side at once; join the requests whose prefill is done into the batch (`rows.stack`); run one
decode step for every row (one forward, per-row positions and padding mask); hand each row its
token; let finished and cancelled rows leave (`batch_select_indices`). Every chunk boundary a
row's cache reaches is stored (`StoreSession.advance`), so the next turn of a chat finds the
previous answer; the store's encoding and writing run on its background writer. With
speculation (`speculative=K`) each step drafts per row, verifies all rows in one forward and crops
each row by its own count (`Cache.crop` with per-row counts).

What goes wrong with one request (a prompt the model cannot take, a sampling failure) ends that
request alone, with an error event; only a failure of the shared decode forward ends every row.

Requests talk to the engine through thread-safe queues: `submit` from the web server's event
loop, events (`token`, `done`, `error`) back into each request's own asyncio queue.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable
from typing import Any

import torch

from ..cache import Cache
from ..errors import CacheInputError
from ..generation.draft_schedule import DraftGate
from ..generation.suffix import SuffixDrafter
from ..store.payloads import model_module, storable
from . import prefill
from . import rows as batch_rows
from .events import BatchedSink
from .grammar import Constraint, TokenizerInBackground
from .logprobs import token_logprobs
from .metrics import Metrics
from .request import Request
from .row_tokens import ban_early_ends, step_tokens
from .speculation import can_speculate, new_drafter, speculative_step

#: Rows decoded together at most; newcomers wait while the batch is full.
MAX_BATCH = 32
#: Tokens one engine turn computes at most: the running rows' decode tokens plus prefill blocks.
#: 256, measured against 192-512 (docs/serve.md): at 512 a burst of newcomers is prefilled in one
#: large group, every one waiting for all, and the rows, finishing together, make the next burst.
MAX_STEP_TOKENS = 256


class Engine:
    """Continuous batching over `model` (kvcache protocol, its `new_cache()` dynamic layers) with a
    prefix `store` (a `PrefixStore`; every request goes through it)."""

    def __init__(self, model: Any, store: Any, *, eos: list[int], metrics: Metrics | None = None,
                 speculative: int = 0, max_batch: int = MAX_BATCH,
                 max_step_tokens: int = MAX_STEP_TOKENS, draft_model: Any = None,
                 suffix_corpus: Any = None, draft_schedule: str = "adaptive",
                 draft_rows: int | None = None,
                 grammar_tokenizer: Callable[[], Any] | None = None) -> None:  # fmt: skip
        """`speculative`: draft tokens per row and step (0: none), by prompt lookup, by
        `draft_model` (a model of the same vocabulary; each row drafts with a cache of its own), or
        from `suffix_corpus` (a `SuffixCorpus` every finished request's prompt and answer feeds,
        shared by all requests of this engine: one model, one API key). `draft_schedule`:
        "adaptive" (lookup and suffix drafts fed as far as their matches pay, `DraftGate`) or
        "constant" (every offered draft fed whole, as a draft model's always are). Under the
        adaptive schedule a step drafts only while the batch holds at most `draft_rows` rows (None:
        any number; 1 whatever the schedule for a model that cannot mask rows of different lengths,
        `ragged_refusal`). `grammar_tokenizer`: the served tokenizer as llguidance takes it
        (`grammar.grammar_tokenizer`, built on a thread of its own from `start`)."""
        if isinstance(speculative, bool) or not isinstance(speculative, int) or speculative < 0:
            raise CacheInputError(f"speculative must be an int >= 0 (draft tokens per row and step), got "
                                  f"{speculative!r}")
        if draft_schedule not in ("adaptive", "constant"):
            raise CacheInputError(f"draft_schedule must be 'adaptive' or 'constant', got {draft_schedule!r}")
        if draft_model is not None and suffix_corpus is not None:
            raise CacheInputError("a draft model and a suffix corpus are alternatives: give one")
        if draft_model is not None and not speculative:
            raise CacheInputError("a draft model needs speculative > 0 (draft tokens per step)")
        if draft_model is not None and int(draft_model.vocab_size) != int(model.vocab_size):
            raise CacheInputError(f"the draft model's vocabulary ({int(draft_model.vocab_size)} tokens) is not the "
                                  f"served model's ({int(model.vocab_size)})")  # fmt: skip
        self.model, self.store, self.eos, self.draft_model = model, store, frozenset(eos), draft_model
        context = getattr(model, "context_length", None)  # (positions, field): learned positions end there
        self.last_position = None if context is None else context[0] - 1
        self.suffix_corpus = suffix_corpus
        self._grammar_tokens = None if grammar_tokenizer is None else TokenizerInBackground(grammar_tokenizer)
        #: how many draft tokens the batch feeds (drafters that say their match: not a draft model)
        adaptive = speculative and draft_model is None and draft_schedule == "adaptive"
        #: the model leaves a forward's fillers out (`tokens_per_row`): verify forwards and grouped rests
        self.packs_rows = bool(getattr(model, "packs_rows", False))
        self.draft_gate = DraftGate(speculative, packed=self.packs_rows) if adaptive else None
        self.draft_width = 0 if adaptive else speculative  # draft tokens per row the last step fed
        self.draft_rows = draft_rows
        if getattr(model, "ragged_refusal", None):  # rows cropped by different counts could not be masked
            self.draft_rows = 1
        self.shadow_turn = 0  # the row the next step's shadow proposals start from
        self.metrics = metrics or Metrics()
        self.drafts = [0, 0]  # draft tokens verified and accepted so far (the metrics' counts, relayed)
        self.speculative, self.max_batch, self.max_step_tokens = speculative, max_batch, max_step_tokens
        if any(not storable(layer, store.chunk_size) for layer in model.new_cache()):
            raise CacheInputError("the served model's cache has static layers, which the prefix store cannot keep")
        self.block_limit = prefill.block_limit(model, store.chunk_size)
        self.group_prefill = prefill.groupable(model)
        #: newcomers holding as many tokens feed equal blocks in one forward (models that cannot be padded)
        self.lockstep = not self.group_prefill and prefill.lockstep(model)
        blocks = [block for layer in model.new_cache() if (block := layer.forward_block)]
        #: drafts stop at multiples of this: every chunk boundary, and no quantized block boundary crossed
        self.draft_step = math.gcd(store.chunk_size, *blocks)
        module = model_module(model)
        param = None if module is None else next(iter(module.parameters()), None)
        self.device = torch.device("cpu") if param is None else param.device
        self.identity: Any = None  # the model's `ModelIdentity` in the store, at the first request
        self._inbox: deque[Request] = deque()
        self._wake = threading.Condition()
        self._prefilling: deque[Request] = deque()
        self._ready: list[Request] = []
        self._rows: list[Request] = []
        self._pads: list[int] = []
        self._cache: Cache | None = None
        self._stopping = False
        self._outbox: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, tuple[str, Any]]]] = {}
        self._ids = itertools.count(1)
        self._thread = threading.Thread(target=self._run, name="kvcache-engine", daemon=True)
        if speculative:
            from ..generation.switches import row_states

            if not can_speculate(model, self.device):
                raise CacheInputError(
                    f"--speculative: {type(model).__name__} has recurrent layers whose state kvcache cannot take "
                    "token by token in a verify forward, so a rejected draft could not be rolled back; serve it "
                    "without --speculative"
                )
            row_states(model, None)[1](True)  # per-token recurrent states, for the server's lifetime

    # ------------------------------------------------------------------------- interface
    def start(self) -> None:
        self.store.start_writer()
        if self._grammar_tokens is not None:
            self._grammar_tokens.start()
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Cancel what is left, end the thread, and finish the store's queued writes."""
        with self._wake:
            self._stopping = True
            self._wake.notify()
        if self._thread.ident is not None:  # (stopped before it started: nothing to wait for)
            self._thread.join(timeout)
        self.store.stop_writer(timeout)

    def submit(self, request: Request) -> Request:
        request.id = request.id or f"req-{next(self._ids)}"
        with self._wake:
            self._inbox.append(request)
            self._wake.notify()
        return request

    @property
    def store_writes_pending(self) -> int:
        """Chunks queued for the store's background writer (0 without one)."""
        writer = self.store.writer
        return 0 if writer is None else writer.pending

    @property
    def active(self) -> dict[str, int]:
        """Requests waiting, prefilling, running; and whether a batch cache is held (for health
        checks and the load test's leak check)."""
        started = sum(r.session is not None for r in list(self._prefilling))
        return {"waiting": len(self._inbox) + len(self._prefilling) - started, "prefilling": started + len(self._ready),
                "running": len(self._rows), "batch_cache": int(self._cache is not None)}  # fmt: skip

    # ------------------------------------------------------------------------------ loop
    def _run(self) -> None:
        torch.set_grad_enabled(False)
        while True:
            with self._wake:
                while not (self._stopping or self._inbox or self._prefilling or self._ready or self._rows):
                    self._wake.wait()
                if self._stopping:
                    break
                while self._inbox:
                    self._prefilling.append(self._inbox.popleft())
            try:
                self._turn()
            except Exception as exc:  # a bug or an unusable model: every request learns why, the loop goes on
                traceback.print_exc()
                for request in [*self._prefilling, *self._ready, *self._rows]:
                    self._send(request, ("error", f"{type(exc).__name__}: {exc}"))
                self._prefilling.clear()
                self._ready.clear()
                self._drop_batch()
            self._flush()
        for request in [*self._inbox, *self._prefilling, *self._ready, *self._rows]:
            self._send(request, ("unavailable", "the server is shutting down: the request was not finished"))
        self._drop_batch()
        self._flush()

    def _turn(self) -> None:
        self._drop_cancelled()
        writer = self.store.writer
        if self._prefilling and writer is not None:
            with writer.paused():  # a prefill's forwards do not share the interpreter with encoding
                self._prefill_turn()
        else:
            self._prefill_turn()
        if self._ready:
            self._flush()  # the first tokens go out now, not after the join and the decode step
            self._join()
        if self._rows:
            self._decode_step()
        self.metrics.batch_size.set(len(self._rows))

    def _prefill_turn(self) -> None:
        prefill.prefill_turn(self)

    def _drop_failed(self, request: Request, exc: Exception) -> None:
        for queue in (self._prefilling, self._ready):
            if request in queue:
                queue.remove(request)
        self._fail(request, exc)

    def _drop_cancelled(self) -> None:
        for request in [r for r in [*self._prefilling, *self._ready] if r.cancelled]:
            (self._prefilling if request in self._prefilling else self._ready).remove(request)
            self._finish(request, request.finish_reason or "cancelled")
        gone = [i for i, r in enumerate(self._rows) if r.cancelled]
        if gone:
            for i in gone:
                self._finish(self._rows[i], self._rows[i].finish_reason or "cancelled")
            self._keep([i for i in range(len(self._rows)) if i not in gone])

    # --------------------------------------------------------------------------- prefill
    def _prefilled(self, request: Request, logits: torch.Tensor) -> None:
        """`request`'s prompt is in its cache: its first token, then it waits to join the batch."""
        if request.seed is not None:
            request.generator = torch.Generator(device=self.device).manual_seed(request.seed)
        self._prefilling.remove(request)
        if request.cancelled:
            self._finish(request, "cancelled")
            return
        if request.grammar is not None:
            try:
                request.constraint = Constraint(self._grammar(), request.grammar, int(self.model.vocab_size))
            except Exception as exc:  # an engine without structured outputs, a grammar llguidance refuses
                self._fail(request, exc)
                return
        if request.sampling.repetition_penalty != 1:  # the prompt's tokens, which the penalty reads
            request.prompt_seen = torch.zeros(int(self.model.vocab_size), dtype=torch.bool, device=self.device)
            request.prompt_seen[torch.tensor(request.prompt, device=self.device)] = True
        if self.speculative:
            request.drafter = new_drafter(self, request)
        ban_early_ends([request], logits, self.eos)
        self._emit(request, self._choose(request, logits), logits)
        if request.finish_reason is None:
            self._ready.append(request)

    def _grammar(self) -> Any:
        if self._grammar_tokens is None:
            raise CacheInputError("this engine was built without structured outputs (no grammar tokenizer)")
        return self._grammar_tokens.get()

    # ------------------------------------------------------------------------------ batch
    def _join(self) -> None:
        """Stack the ready requests' caches into the running batch (one copy of the batch)."""
        joining = [r.rows if r.rows is not None else batch_rows.single(r.cache) for r in self._ready]
        self._cache, self._pads = batch_rows.join(self._cache, self._pads, joining)
        for request in self._ready:
            request.cache = request.rows = None  # its content lives in the batch now
        self._rows += self._ready
        self._ready = []

    def _keep(self, keep: list[int]) -> None:
        """Only rows `keep` stay (finished and cancelled rows leave)."""
        if not keep:
            self._drop_batch()
            return
        if len(keep) < len(self._rows):
            self._cache.batch_select_indices(torch.tensor(keep, dtype=torch.long))  # type: ignore[union-attr]
            self._rows = [self._rows[i] for i in keep]
            self._pads = [self._pads[i] for i in keep]

    def _drop_batch(self) -> None:
        self._cache, self._rows, self._pads = None, [], []

    def _decode_step(self) -> None:
        rows_cap = self.draft_rows if self.draft_gate is not None or self.draft_rows == 1 else None
        if self.speculative and (rows_cap is None or len(self._rows) <= rows_cap):
            speculative_step(self)
            return
        if self.speculative and any(r.prediction for r in self._rows):  # past the cap: predicted rows draft
            speculative_step(self, predicted_only=True)
            return
        self.draft_width = 0  # a plain step (or a batch too large to draft for)
        rows, cache = self._rows, self._cache
        assert cache is not None
        ids = torch.tensor([[r.pending] for r in rows], dtype=torch.long, device=self.device)
        logits = self.model(ids, cache=cache, **self.row_inputs(1))[:, -1]
        ban_early_ends(rows, logits, self.eos)
        # the rows' tokens decided together (what `_choose` picks per row), in a few host transfers
        picked = step_tokens(rows, logits)
        keep = []
        for b, request in enumerate(rows):
            try:
                fed = request.pending
                request.session.advance([fed], self.row_capture(b))
                token = picked[b]
                self._emit(request, token if token is not None else self._choose(request, logits[b : b + 1]),
                           logits[b])  # fmt: skip
            except Exception as exc:  # this row's own failure (its sampling, its store path): it alone ends
                self._fail(request, exc)
            if request.finish_reason is None:
                keep.append(b)
        self._keep(keep)

    def row_inputs(self, width: int) -> dict[str, torch.Tensor]:
        """Position ids and the padding mask of a forward of `width` tokens per row."""
        device = self.device
        lengths = torch.tensor([r.session.length for r in self._rows], device=device)[:, None]
        positions = lengths + torch.arange(width, device=device)
        if width > 1 and self.last_position is not None:  # a short row's filler past the model's last position
            positions = positions.clamp_max(self.last_position)  # (fillers come after its tokens: never read)
        physical = self._cache.get_seq_length() + width  # type: ignore[union-attr]
        pads = torch.tensor(self._pads, device=device)[:, None]
        out = {"position_ids": positions}
        if any(self._pads):
            out["attention_mask"] = (torch.arange(physical, device=device)[None] >= pads).long()
        return out

    def row_capture(self, b: int) -> Callable[[int, int], list[Any]]:
        """What the prefix store keeps of row `b`'s chunk `[start, end)`."""
        return lambda start, end: batch_rows.row_payloads(self._cache, b, self._pads[b], start, end)  # type: ignore[arg-type]

    # ---------------------------------------------------------------------------- tokens
    def _choose(self, request: Request, logits: torch.Tensor) -> int:
        if request.constraint is not None:  # only the tokens its grammar allows next
            logits = request.constraint.mask(logits)
        scores = request.sampling.scores(logits, request.counts, request.prompt_seen)
        if not request.sampling.do_sample:
            return int(scores.argmax(-1))
        return int(torch.multinomial(scores.softmax(-1), 1, generator=request.generator))

    def _emit(self, request: Request, token: int, scores: torch.Tensor | None = None) -> None:
        """Hand `token` to the request (with its log probabilities under `scores`, the logits it was
        chosen from, when the request asks); decide whether it is done (an end token, `max_tokens`)."""
        now = time.monotonic()
        if request.first_token_at is None:
            request.first_token_at = now
            self.metrics.time_to_first_token.observe(now - request.created)
        request.tokens.append(token)
        request.pending = token
        if request.sampling.penalized:  # the counts the next token's penalties read
            if request.counts is None:
                request.counts = torch.zeros(int(self.model.vocab_size), device=self.device)
            request.counts[token] += 1
        self.metrics.generated_tokens.inc()
        asked = request.logprobs is not None and scores is not None
        self._send(request, ("token", token_logprobs(scores, token, request.logprobs) if asked else token))
        if request.constraint is not None:
            request.constraint.accept(token)
        if ((token in self.eos and not request.ignore_eos) or token in request.stop_ids
                or (request.constraint and request.constraint.done)):  # fmt: skip
            self._finish(request, "stop")
        elif len(request.tokens) >= request.max_tokens:
            self._finish(request, "length")

    def _finish(self, request: Request, reason: str) -> None:
        request.finish_reason = reason
        self._leave(request)
        if self.suffix_corpus is not None and reason in ("stop", "length") and request.tokens:
            self.suffix_corpus.add(request.prompt + request.tokens, len(request.prompt))  # later requests draft from it
        request.cache = None
        self._send(request, ("done", reason))

    def _fail(self, request: Request, exc: Exception) -> None:
        """End `request` alone with an error event (logged here: it is a bug or a bad model)."""
        traceback.print_exc()
        request.finish_reason = "error"
        self._leave(request)
        request.cache = None
        self._send(request, ("error", f"{type(exc).__name__}: {exc}"))

    @staticmethod
    def _leave(request: Request) -> None:
        """A suffix drafter stops offering the request's answer to the others in flight."""
        if isinstance(request.drafter, SuffixDrafter):
            request.drafter.leave()

    def _send(self, request: Request, event: tuple[str, Any]) -> None:
        sink = request.on_event
        if isinstance(sink, BatchedSink):
            self._outbox.setdefault(sink.channel, []).append((sink.target, event))
        else:
            sink(event)

    def _flush(self) -> None:
        """Hand this turn's events over, one call per channel (an event loop, the server process)."""
        outbox, self._outbox = self._outbox, {}
        for channel, items in outbox.items():
            channel.deliver(items)

    def finish_early(self, request: Request, reason: str = "stop") -> None:
        """Called from the web side when a stop string appeared: the row leaves at its next step."""
        request.cancelled = True
        request.finish_reason = reason
