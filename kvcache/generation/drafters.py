"""Drafters for speculative decoding: who proposes the tokens the target model then verifies.

A drafter proposes up to k next tokens for the current sequence (`propose`) and is told the
sequence after verification (`accept`), so it can drop what the target rejected. Two come with
the package: `ModelDrafter` (a smaller model with its own cache, rolled back exactly like the
target's) and `PromptLookupDrafter` (n-gram lookup in the text so far; no model at all).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..cache import Cache
from ..errors import GenerationError
from .speculative_runner import NO_ROLLBACK, ModelRunner

#: Turns one position's draft logits `[vocab]` into `(token, q)`: the token proposed, and the
#: distribution it was sampled from (`[vocab]`), or None when it was picked deterministically.
DraftPicker = Callable[[torch.Tensor], tuple[int, "torch.Tensor | None"]]


@dataclass
class Draft:
    """Proposed tokens; `probs[i]` is the distribution `tokens[i]` was drawn from (`[n, vocab]`),
    None when every token was picked deterministically (a point mass, as for n-gram lookup)."""

    tokens: list[int]
    probs: torch.Tensor | None = None
    #: How many tokens of the sequence's end the draft continues, as the drafter matched them (0:
    #: not said); the default schedule judges drafts of each match length apart.
    match: int = 0


class Drafter(ABC):
    """Proposes draft tokens. Subclasses implement `propose`; model-backed ones also `start`/`accept`."""

    #: Model calls spent on drafting so far (0 for drafters without a model).
    forwards: int = 0
    #: Whether proposals say their match length (`Draft.match`) and cost little: the default
    #: schedule then asks for one at every step it might draft and sizes the draft by its match.
    reports_match: bool = False
    #: Whether proposals draw from the run's generator (a draft model that samples, through `pick`).
    #: Drafts that do not (point masses: lookups) leave a sampled run's draws those of plain
    #: sampling, so one sequence's tokens are plain sampling's, seed for seed, whatever was drafted.
    samples: bool = False

    def start(  # noqa: B027  (an optional hook)
        self,
        prompt: Sequence[int],
        *,
        device: torch.device,
        encoder_input_ids: torch.Tensor | None = None,
        encoder_attention_mask: torch.Tensor | None = None,
    ) -> None:
        """Called once before the first proposal with the (decoder) prompt tokens."""

    @abstractmethod
    def propose(self, sequence: Sequence[int], num_tokens: int, pick: DraftPicker) -> Draft:
        """Up to `num_tokens` tokens likely to follow `sequence` (possibly none)."""

    def accept(self, sequence: Sequence[int]) -> str:
        """The sequence after verification; drop whatever of the last proposal it does not contain.
        Returns the rollback path taken ("none", "crop" or "refeed")."""
        return NO_ROLLBACK

    @property
    def cache(self) -> Cache | None:
        """The draft model's cache, if there is a model."""
        return None


class ModelDrafter(Drafter):
    """A (smaller) draft model with its own cache, decoded greedily or by sampling (as the target is).

    Before proposing, the draft model is fed the tokens it has not seen (the target's correction
    of the last round, or the last accepted draft token and the bonus token). After verification
    its cache is rolled back exactly to the tokens the target kept, and committed.
    """

    samples = True

    def __init__(self, model: Any, **model_kwargs: Any) -> None:
        for attr in ("vocab_size", "new_cache"):
            if not hasattr(model, attr):
                raise GenerationError(f"draft model {type(model).__name__} has no {attr!r}: it is not a kvcache model")
        self.model = model
        self.model_kwargs = model_kwargs
        self._runner: ModelRunner | None = None

    @property
    def is_encoder_decoder(self) -> bool:
        return bool(getattr(self.model, "is_encoder_decoder", False))

    @property
    def vocab_size(self) -> int:
        return int(self.model.vocab_size)

    @property
    def forwards(self) -> int:  # type: ignore[override]
        return 0 if self._runner is None else self._runner.forwards

    @property
    def cache(self) -> Cache | None:
        return None if self._runner is None else self._runner.cache

    @property
    def cached_tokens(self) -> list[int]:
        """The tokens the draft cache holds."""
        return [] if self._runner is None else list(self._runner.tokens)

    def start(
        self,
        prompt: Sequence[int],
        *,
        device: torch.device,
        encoder_input_ids: torch.Tensor | None = None,
        encoder_attention_mask: torch.Tensor | None = None,
        cache: Cache | None = None,
    ) -> None:
        """Prefill the draft model on `prompt` (its cache: `cache`, holding a prefix of it, or a new one)."""
        self._runner = ModelRunner(
            self.model,
            device=device,
            encoder_input_ids=encoder_input_ids,
            encoder_attention_mask=encoder_attention_mask,
            model_kwargs=self.model_kwargs,
            cache=cache,
        )
        self._runner.prefill(prompt)

    def propose(self, sequence: Sequence[int], num_tokens: int, pick: DraftPicker) -> Draft:
        runner = self._need_runner()
        if num_tokens <= 0:
            return Draft([])
        held = len(runner.tokens)
        logits = runner.feed(sequence[held:])[-1]
        tokens: list[int] = []
        probs: list[torch.Tensor | None] = []
        for i in range(num_tokens):
            token, q = pick(logits)
            tokens.append(token)
            probs.append(q)
            if i + 1 < num_tokens:
                logits = runner.feed([token])[-1]
        if any(q is None for q in probs):
            return Draft(tokens)
        return Draft(tokens, torch.stack(probs))  # type: ignore[arg-type]

    def accept(self, sequence: Sequence[int]) -> str:
        runner = self._need_runner()
        keep = runner.committed_length
        limit = min(len(runner.tokens), len(sequence) - 1)  # the last token is fed with the next proposal
        while keep < limit and runner.tokens[keep] == sequence[keep]:
            keep += 1
        return runner.truncate(keep, defer_refeed=True)  # `propose` feeds what the cache lacks

    def _need_runner(self) -> ModelRunner:
        if self._runner is None:
            raise GenerationError("ModelDrafter.start() must be called before proposing")
        return self._runner


class NgramIndex:
    """Where each n-gram (n in `sizes`) of a growing token list first occurs, followed by a token.

    `extend` indexes only the tokens added since the last call, so drafting costs the same at any
    context length (a scan of the whole sequence per step grows with it)."""

    def __init__(self, sizes: range) -> None:
        self.sizes = sizes
        self.tokens: list[int] = []
        self.first: dict[tuple[int, ...], int] = {}  # n-gram -> start of its earliest occurrence
        self._seen: Sequence[int] | None = None  # the sequence object indexed last

    def extend(self, sequence: Sequence[int]) -> None:
        """Catch up with `sequence`; one that does not extend what was indexed is indexed anew. The
        speculative driver hands the same list each step, only ever appended to, so the check that
        it extends the indexed tokens is free then (an O(n) comparison for any other sequence)."""
        done = len(self.tokens)
        extends = len(sequence) >= done and (
            sequence is self._seen or list(sequence[:done]) == self.tokens  # type: ignore[index]
        )
        if not extends:
            self.tokens, self.first, done = [], {}, 0
        self._seen = sequence
        self.tokens.extend(int(t) for t in sequence[done:])
        # an n-gram ending at position `end` is followed by a token once the list reaches end + 2
        for end in range(max(done - 1, 0), len(self.tokens) - 1):
            for n in self.sizes:
                if end + 1 >= n:
                    self.first.setdefault(tuple(self.tokens[end + 1 - n : end + 1]), end + 1 - n)

    def continuation(self, pattern: Sequence[int], num_tokens: int) -> list[int] | None:
        """The up to `num_tokens` tokens after the earliest occurrence of `pattern` (followed by at
        least one token); None when there is none."""
        start = self.first.get(tuple(pattern))
        if start is None:
            return None
        return self.tokens[start + len(pattern) : start + len(pattern) + num_tokens]


class PromptLookupDrafter(Drafter):
    """Prompt lookup decoding: no draft model, the text so far is the draft.

    The last `n` tokens of the sequence (n from `max_ngram_size` down to `min_ngram_size`) are looked
    up earlier in the sequence, and the tokens that followed the earliest earlier occurrence are
    proposed (as in transformers' prompt lookup and vLLM's n-gram proposer). For encoder-decoder
    models the encoder input is searched too (after the sequence), which is where summaries and
    translations copy from. No match: no proposal, and the target takes a plain decoding step.
    Lookups go through an `NgramIndex` kept up to date token by token, so a proposal costs the
    same at 256 tokens of context as at 64k.
    """

    reports_match = True

    def __init__(self, max_ngram_size: int = 3, min_ngram_size: int = 1) -> None:
        for name, value in (("max_ngram_size", max_ngram_size), ("min_ngram_size", min_ngram_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise GenerationError(f"{name} must be a positive int, got {value!r}")
        if min_ngram_size > max_ngram_size:
            raise GenerationError(f"min_ngram_size {min_ngram_size} > max_ngram_size {max_ngram_size}")
        self.max_ngram_size = max_ngram_size
        self.min_ngram_size = min_ngram_size
        self._index = NgramIndex(range(min_ngram_size, max_ngram_size + 1))
        self._source: NgramIndex | None = None

    def start(
        self,
        prompt: Sequence[int],
        *,
        device: torch.device,
        encoder_input_ids: torch.Tensor | None = None,
        encoder_attention_mask: torch.Tensor | None = None,
    ) -> None:
        self._index = NgramIndex(self._index.sizes)
        self._source = None
        if encoder_input_ids is not None:
            source = encoder_input_ids[0].cpu()
            if encoder_attention_mask is not None:
                source = source[encoder_attention_mask[0].cpu().bool()]
            self._source = NgramIndex(self._index.sizes)
            self._source.extend(source.tolist())

    def propose(self, sequence: Sequence[int], num_tokens: int, pick: DraftPicker) -> Draft:
        if num_tokens <= 0:
            return Draft([])
        self._index.extend(sequence)
        text = self._index.tokens
        for size in range(min(self.max_ngram_size, len(text) - 1), self.min_ngram_size - 1, -1):
            pattern = text[-size:]
            found = self._index.continuation(pattern, num_tokens)
            if found is None and self._source is not None:
                found = self._source.continuation(pattern, num_tokens)
            if found:
                return Draft(found, match=size)
        return Draft([])


def check_draft(draft: Draft, budget: int, vocab_size: int) -> Draft:
    """Reject a drafter's output that does not fit (too many tokens, ids out of range, bad probs)."""
    if not isinstance(draft, Draft):
        raise GenerationError(f"a drafter must return a Draft, got {type(draft).__name__}")
    if len(draft.tokens) > budget:
        raise GenerationError(f"the drafter proposed {len(draft.tokens)} tokens, more than the {budget} asked for")
    if draft.tokens and not 0 <= min(draft.tokens) <= max(draft.tokens) < vocab_size:
        raise GenerationError(f"the drafter proposed token ids outside [0, {vocab_size})")
    if draft.probs is not None and tuple(draft.probs.shape) != (len(draft.tokens), vocab_size):
        raise GenerationError(
            f"draft probs have shape {tuple(draft.probs.shape)}, expected ({len(draft.tokens)}, {vocab_size})"
        )
    return draft
