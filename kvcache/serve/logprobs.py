"""Log probabilities of the tokens a request was given, for clients that ask (`logprobs`).

The engine computes them from the scores it chose each token from, for the rows that asked only:
the model's own distribution at that position (`log_softmax` of its logits, before temperature
and top-k/top-p/min-p, as vLLM returns them by default), the chosen token's and the `top` most
likely ones. Under speculation a token's scores come from the verify forward's position where it
was chosen, so they are the same distribution computed in a wider forward (equal to a plain
step's within rounding). The web side shapes them as OpenAI does: chat's `logprobs.content`
(token text, log probability, UTF-8 bytes, alternatives) and completions' `tokens`,
`token_logprobs`, `top_logprobs` and `text_offset`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch


class TokenLogprobs(NamedTuple):
    """One chosen token with its log probability and the `top` most likely alternatives."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]


def token_logprobs(scores: torch.Tensor, token: int, top: int) -> TokenLogprobs:
    """`token`'s log probability under `scores` (`[vocab]` logits or `[1, vocab]`), and the `top`
    most likely tokens with theirs, most likely first."""
    flat = scores.reshape(-1)
    logp = flat.to(torch.promote_types(flat.dtype, torch.float32)).log_softmax(-1)  # float32 at least
    best: tuple[tuple[int, float], ...] = ()
    if top:
        values, ids = logp.topk(min(top, logp.shape[0]))
        best = tuple(zip(ids.tolist(), values.tolist(), strict=True))
    return TokenLogprobs(token, float(logp[token]), best)


def _logprob(value: float) -> float:
    return max(value, -9999.0)  # a JSON number: -inf (a token the model rules out) is not one


def chat_logprobs(given: Sequence[TokenLogprobs], decode: Callable[[list[int]], str]) -> dict[str, Any]:
    """Chat's `logprobs` object for `given` tokens."""

    def entry(token: int, logprob: float) -> dict[str, Any]:
        text = decode([token])
        return {"token": text, "logprob": _logprob(logprob), "bytes": list(text.encode("utf-8"))}

    return {"content": [{**entry(t.token, t.logprob), "top_logprobs": [entry(i, lp) for i, lp in t.top]}
                        for t in given]}  # fmt: skip


def completion_logprobs(given: Sequence[TokenLogprobs], decode: Callable[[list[int]], str],
                        offset: int = 0) -> dict[str, Any]:  # fmt: skip
    """Completions' `logprobs` object for `given` tokens, whose text starts `offset` characters
    into the completion's."""
    tokens, offsets = [], []
    for t in given:
        offsets.append(offset)
        tokens.append(decode([t.token]))
        offset += len(tokens[-1])
    return {"tokens": tokens, "token_logprobs": [_logprob(t.logprob) for t in given],
            "top_logprobs": [{decode([i]): _logprob(lp) for i, lp in t.top} for t in given],
            "text_offset": offsets}  # fmt: skip
