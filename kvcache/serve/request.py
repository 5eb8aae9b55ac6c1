"""One completion request as the engine holds it: what the web side asks for and what the engine
fills in as it decodes (its cache, its drafter, its tokens)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..cache import Cache
from ..generation.drafters import Drafter
from ..generation.sampling import Sampling


@dataclass(eq=False)  # a request is itself: compared by identity
class Request:
    """One completion: its prompt ids and parameters, and what the engine fills in."""

    prompt: list[int]
    max_tokens: int
    sampling: Sampling
    seed: int | None = None
    stop_ids: frozenset[int] = frozenset()  # tokens that end the answer besides the model's end tokens
    ignore_eos: bool = False  # the model's end tokens do not end the answer
    min_tokens: int = 0  # no end token (nor stop id) is chosen before the answer has this many tokens
    logprobs: int | None = None  # tokens come with their log probabilities and this many alternatives
    prompt_logprobs: int | None = None  # the prompt's, first (a "prompt" event), with this many alternatives
    grammar: str | None = None  # the answer is held to this llguidance grammar (`grammar.grammar_of`)
    prediction: list[int] | None = None  # the tokens the answer is predicted to repeat (drafted from)
    id: str = ""
    on_event: Callable[[tuple[str, Any]], None] = lambda event: None
    created: float = field(default_factory=time.monotonic)
    cancelled: bool = False
    # filled in by the engine
    tokens: list[int] = field(default_factory=list)
    cached_tokens: int = 0
    finish_reason: str | None = None
    first_token_at: float | None = None
    generator: torch.Generator | None = None
    session: Any = None
    cache: Cache | None = None
    pending: int | None = None  # the token to feed at the next decode step
    counts: torch.Tensor | None = None  # how often each token was generated (`[vocab]`), for penalties
    prompt_seen: torch.Tensor | None = None  # the prompt's tokens (`[vocab]` bool), for a repetition penalty
    drafter: Drafter | None = None
    constraint: Any = None  # its `grammar.Constraint`, when it has a grammar
    rows: list | None = None  # prefilled with other newcomers: its row of their batch (`rows.stack` takes it)
    alone: bool = False  # its group's forward failed: prefilled alone from now on
    scored: bool = False  # its prompt's log probabilities were sent (or not asked for)
    on_cancel: Callable[[], None] | None = None  # tells an engine in another process (`engine_process`)

    def cancel(self) -> None:
        """Ask the engine to drop this request at its next step (a client that went away)."""
        self.cancelled = True
        if self.on_cancel is not None:
            self.on_cancel()
