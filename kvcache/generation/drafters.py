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


class Drafter(ABC):
    """Proposes draft tokens. Subclasses implement `propose`; model-backed ones also `start`/`accept`."""

    #: Model calls spent on drafting so far (0 for drafters without a model).
    forwards: int = 0

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
        return runner.truncate(keep)

    def _need_runner(self) -> ModelRunner:
        if self._runner is None:
            raise GenerationError("ModelDrafter.start() must be called before proposing")
        return self._runner


class PromptLookupDrafter(Drafter):
    """Prompt lookup decoding: no draft model, the text so far is the draft.

    The last `n` tokens of the sequence (n from `max_ngram_size` down to `min_ngram_size`) are looked
    up earlier in the sequence, and the tokens that followed the earliest earlier occurrence are
    proposed (as in transformers' prompt lookup and vLLM's n-gram proposer). For encoder-decoder
    models the encoder input is searched too (after the sequence), which is where summaries and
    translations copy from. No match: no proposal, and the target takes a plain decoding step.
    """

    def __init__(self, max_ngram_size: int = 3, min_ngram_size: int = 1) -> None:
        for name, value in (("max_ngram_size", max_ngram_size), ("min_ngram_size", min_ngram_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise GenerationError(f"{name} must be a positive int, got {value!r}")
        if min_ngram_size > max_ngram_size:
            raise GenerationError(f"min_ngram_size {min_ngram_size} > max_ngram_size {max_ngram_size}")
        self.max_ngram_size = max_ngram_size
        self.min_ngram_size = min_ngram_size
        self._source: torch.Tensor | None = None

    def start(
        self,
        prompt: Sequence[int],
        *,
        device: torch.device,
        encoder_input_ids: torch.Tensor | None = None,
        encoder_attention_mask: torch.Tensor | None = None,
    ) -> None:
        self._source = None
        if encoder_input_ids is not None:
            source = encoder_input_ids[0].cpu()
            if encoder_attention_mask is not None:
                source = source[encoder_attention_mask[0].cpu().bool()]
            self._source = source

    def propose(self, sequence: Sequence[int], num_tokens: int, pick: DraftPicker) -> Draft:
        if num_tokens <= 0:
            return Draft([])
        text = torch.as_tensor(list(sequence), dtype=torch.long)
        for size in range(min(self.max_ngram_size, len(text) - 1), self.min_ngram_size - 1, -1):
            pattern = text[-size:]
            found = _continuation(text, pattern, num_tokens)
            if found is None and self._source is not None:
                found = _continuation(self._source, pattern, num_tokens)
            if found is not None:
                return Draft(found)
        return Draft([])


def _continuation(haystack: torch.Tensor, pattern: torch.Tensor, num_tokens: int) -> list[int] | None:
    """The up to `num_tokens` tokens after the earliest occurrence of `pattern` in `haystack` that
    is followed by at least one token; None when there is none."""
    size = len(pattern)
    if len(haystack) <= size:
        return None
    windows = haystack[:-1].unfold(0, size, 1)  # windows followed by at least one token
    hits = (windows == pattern).all(dim=1).nonzero()
    if hits.numel() == 0:
        return None
    start = int(hits[0, 0]) + size
    return haystack[start : start + num_tokens].tolist()
