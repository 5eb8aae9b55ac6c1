"""Turning next-token logits into scores and picking tokens: a logit bias, temperature, top-k, top-p,
min-p, argmax."""

from __future__ import annotations

import math
from collections.abc import Collection
from dataclasses import dataclass

import torch

from ..errors import GenerationError


@dataclass(frozen=True)
class Sampling:
    """How the next token is chosen. `do_sample=False` is greedy (argmax of the raw logits);
    otherwise the logits are divided by `temperature`, cut to the `top_k` best (0 = no cut), to the
    smallest set of probability mass `top_p` and to the tokens at least `min_p` times as likely as
    the most likely one (0 = no cut), in that order (transformers' order), and sampled.
    `logit_bias` (`(token, bias)` pairs, OpenAI's `logit_bias`) is added to the logits first,
    greedy or not: -100 bans a token, +100 all but forces it. `presence_penalty` and
    `frequency_penalty` (OpenAI's) are subtracted with it, greedy or not, from the logits of the
    tokens generated so far (`scores`' `counts`): once for a token that occurred, and once per
    occurrence. `repetition_penalty` (transformers' and vLLM's, 1 = none) then divides the positive
    logits and multiplies the negative ones of every token seen, in the prompt (`scores`' `seen`)
    or generated so far."""

    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0

    def __post_init__(self) -> None:
        penalty = self.repetition_penalty
        if isinstance(penalty, bool) or not isinstance(penalty, (int, float)) or not (0 < penalty < math.inf):
            raise GenerationError(f"repetition_penalty must be a finite number > 0, got {penalty!r}",
                                  param="repetition_penalty")  # fmt: skip
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise GenerationError(f"{name} must be a finite number, got {value!r}", param=name)
        bias = self.logit_bias
        if not isinstance(bias, tuple) or not all(
            isinstance(pair, tuple) and len(pair) == 2 and type(pair[0]) is int and pair[0] >= 0
            and type(pair[1]) in (int, float) and math.isfinite(pair[1]) for pair in bias
        ):  # fmt: skip
            raise GenerationError(f"logit_bias must be a tuple of (token id, finite number) pairs, got {bias!r}",
                                  param="logit_bias")  # fmt: skip
        if not isinstance(self.do_sample, bool):
            raise GenerationError(f"do_sample must be a bool, got {self.do_sample!r}", param="do_sample")
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)):
            raise GenerationError(f"temperature must be a number, got {self.temperature!r}", param="temperature")
        if not math.isfinite(self.temperature):
            raise GenerationError(f"temperature must be a finite number, got {self.temperature!r}", param="temperature")
        if self.do_sample and not self.temperature > 0:
            raise GenerationError(
                f"temperature must be > 0 when sampling, got {self.temperature!r}", param="temperature"
            )
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise GenerationError(f"top_k must be an int >= 0 (0 = no top-k cut), got {self.top_k!r}", param="top_k")
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise GenerationError(f"top_p must be in (0, 1], got {self.top_p!r}", param="top_p")
        if isinstance(self.min_p, bool) or not isinstance(self.min_p, (int, float)) or not 0 <= self.min_p <= 1:
            raise GenerationError(f"min_p must be in [0, 1] (0 = no min-p cut), got {self.min_p!r}", param="min_p")

    @property
    def penalized(self) -> bool:
        """Whether the scores depend on the tokens generated so far (a presence, frequency or
        repetition penalty)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1)

    @property
    def argmax_only(self) -> bool:
        """Whether the next token is the argmax of the raw logits (greedy, nothing added to them)."""
        return not (self.do_sample or self.logit_bias or self.penalized)

    def scores(self, logits: torch.Tensor, counts: torch.Tensor | None = None,
               seen: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
        """Float32 scores `[batch, vocab]` of the next token (what `output_scores` returns); `counts`
        (broadcast to `logits`): how often each token was generated before that position, for the
        penalties (None: none yet); `seen` (bool, broadcast): the prompt's tokens, which the
        repetition penalty also reads (None: none)."""
        if self.logit_bias:
            ids = torch.tensor([t for t, _ in self.logit_bias], device=logits.device)
            values = torch.tensor([b for _, b in self.logit_bias], dtype=torch.float32, device=logits.device)
            logits = logits.float().index_add(-1, ids, values.expand(*logits.shape[:-1], -1))
        if self.penalized and counts is not None:
            counts = counts.to(device=logits.device, dtype=torch.float32)
            logits = logits.float() - self.frequency_penalty * counts - self.presence_penalty * (counts > 0).float()
        if self.repetition_penalty != 1 and (counts is not None or seen is not None):
            hit = counts.to(logits.device) > 0 if counts is not None else None
            if seen is not None:
                hit = seen.to(logits.device) if hit is None else hit | seen.to(logits.device)
            logits = logits.float()  # as transformers' processor: divided where positive, multiplied elsewhere
            penalized = torch.where(logits > 0, logits / self.repetition_penalty, logits * self.repetition_penalty)
            logits = torch.where(hit, penalized, logits)
        if self.do_sample and self.temperature != 1:
            scores = logits.float() / self.temperature
        else:
            scores = logits.float()
            if scores is logits:  # never alias the model's output (it may hold the whole prefill)
                scores = scores.clone()
        if not self.do_sample:
            return scores
        if 0 < self.top_k < scores.shape[-1]:
            kth_best = torch.topk(scores, self.top_k, dim=-1).values[:, -1:]
            scores = scores.masked_fill(scores < kth_best, -float("inf"))
        if self.top_p < 1:
            sorted_scores, order = torch.sort(scores, dim=-1)
            cumulative = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
            drop_sorted = cumulative <= 1 - self.top_p
            drop_sorted[:, -1] = False  # the best token always stays
            scores = scores.masked_fill(drop_sorted.scatter(1, order, drop_sorted), -float("inf"))
        if self.min_p > 0:  # relative to the best token: the same whichever cuts came before
            probs = scores.softmax(dim=-1)
            scores = scores.masked_fill(probs < self.min_p * probs.amax(dim=-1, keepdim=True), -float("inf"))
        return scores

    def select(self, scores: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
        """The next token of every row `[batch]` (long), drawn with `generator` when sampling."""
        if not self.do_sample:
            return scores.argmax(dim=-1)
        probs = scores.softmax(dim=-1)
        return torch.multinomial(probs, 1, generator=generator).squeeze(1)


def ban_ends(logits: torch.Tensor, made: int, min_new_tokens: int, ends: Collection[int]) -> None:
    """In place: `logits` `[positions, vocab]`, position j choosing the new token after `made + j`
    of them, get -inf for the tokens that would end the answer (`ends`) wherever it would come
    before the `min_new_tokens`-th (transformers' `min_new_tokens`, vLLM's `min_tokens`)."""
    short = min_new_tokens - made
    if short > 0 and ends:
        logits[:short, sorted(ends)] = float("-inf")
