"""Log probabilities of the tokens a request was given, for clients that ask (`logprobs`).

The engine computes them from the scores it chose each token from, for the rows that asked only:
the model's own distribution at that position (`log_softmax` of its logits, before temperature
and top-k/top-p/min-p, as vLLM returns them by default), the chosen token's and the `top` most
likely ones. Under speculation a token's scores come from the verify forward's position where it
was chosen, so they are the same distribution computed in a wider forward (equal to a plain
step's within rounding). The web side shapes them as OpenAI does: chat's `logprobs.content`
(token text, log probability, UTF-8 bytes, alternatives) and completions' `tokens`,
`token_logprobs`, `top_logprobs` and `text_offset`.

With `echo` a completion asks for its prompt's too (what evaluation harnesses score a text with:
`max_tokens` 0 or 1, `echo`, `logprobs`): the engine reads the prompt once more in a cache of its
own before prefilling it (`score_prompts`; a stored prefix keeps states, not every position's
scores), and each prompt token after the first gets its log probability given those before it.
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


#: Prompt positions scored per forward (`prompt_logprobs`): their logits `[block, vocab]` are held
#: at once, twice (log-softmax), so a 150k-token vocabulary costs ~150 MB, not that per position.
PROMPT_BLOCK = 128


def prompt_logprobs(model: Any, prompt: Sequence[int], top: int, device: torch.device) -> list[TokenLogprobs]:
    """Each prompt token after the first with its log probability given the tokens before it and
    the `top` most likely tokens there (what `echo` with `logprobs` returns): the prompt read by
    `model` in a cache of its own, `PROMPT_BLOCK` positions a forward."""
    cache, out = model.new_cache(), []
    for start in range(0, len(prompt) - 1, PROMPT_BLOCK):
        end = min(start + PROMPT_BLOCK, len(prompt) - 1)
        ids = torch.tensor([list(prompt[start:end])], dtype=torch.long, device=device)
        logits = model(ids, cache=cache, position_ids=torch.arange(start, end, device=device)[None])[0]
        logp = logits.to(torch.promote_types(logits.dtype, torch.float32)).log_softmax(-1)
        following = list(prompt[start + 1 : end + 1])
        chosen = logp.gather(-1, torch.tensor(following, device=device)[:, None])[:, 0].tolist()
        best: list[tuple[tuple[int, float], ...]] = [()] * len(following)
        if top:
            values, indices = logp.topk(min(top, logp.shape[-1]), dim=-1)
            best = [tuple(zip(i, v, strict=True)) for i, v in zip(indices.tolist(), values.tolist(), strict=True)]
        out += [TokenLogprobs(t, lp, b) for t, lp, b in zip(following, chosen, best, strict=True)]
    return out


def score_prompts(engine: Any) -> None:
    """The engine's newcomers that asked for their prompt's log probabilities (`echo` with
    `logprobs`) get them before anything else (a "prompt" event), in order of arrival, about a
    step budget of prompt tokens a turn (at least one prompt); those that asked for no new token
    (`max_tokens` 0) end there."""
    spent = 0
    for request in [r for r in engine._prefilling if not r.scored]:
        if spent >= engine.max_step_tokens:
            break
        request.scored = True
        try:
            if request.prompt_logprobs is not None:
                spent += len(request.prompt)
                scored = prompt_logprobs(engine.model, request.prompt, request.prompt_logprobs, engine.device)
                engine._send(request, ("prompt", scored))
            if request.max_tokens == 0:
                engine._prefilling.remove(request)
                engine._finish(request, "length")
        except Exception as exc:  # this prompt's own failure: it alone ends
            engine._drop_failed(request, exc)


def _logprob(value: float) -> float:
    """A JSON number: -inf (a token the model rules out) is not one, nor NaN (logits a model
    computed as NaN, as transformers' eager attention does for left-padded rows in float64)."""
    return value if value >= -9999.0 else -9999.0


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


def echoed_logprobs(prompt: Sequence[int], given: Sequence[TokenLogprobs],
                    decode: Callable[[list[int]], str]) -> dict[str, Any]:  # fmt: skip
    """Completions' `logprobs` object of an echoed prompt: its first token has none (nothing comes
    before it: null, as OpenAI and vLLM send it), then `given`, the rest's (`prompt_logprobs`)."""
    first = decode([prompt[0]])
    rest = completion_logprobs(given, decode, len(first))
    return {"tokens": [first, *rest["tokens"]], "token_logprobs": [None, *rest["token_logprobs"]],
            "top_logprobs": [None, *rest["top_logprobs"]], "text_offset": [0, *rest["text_offset"]]}  # fmt: skip


def joined(head: dict[str, Any], tail: dict[str, Any]) -> dict[str, Any]:
    """Two completions' `logprobs` objects one after the other (an echoed prompt's, the answer's)."""
    return {name: [*head[name], *tail[name]] for name in head}
