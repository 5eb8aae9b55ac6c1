"""vLLM's `/tokenize` and `/detokenize`: the token ids a completion or chat request would feed the
model (a chat rendered by the model's template, as the chat endpoint renders it), counted against
the model's context, and the text of token ids, as the answers decode them. Clients count tokens
with them before they send a request; vLLM's request and answer shapes are kept."""

from __future__ import annotations

from typing import Any

from .schema import ApiError

#: The fields `/tokenize` takes besides a completion's or a chat's own.
TOKENIZE_FIELDS = ("add_special_tokens", "return_token_strs")
#: The most token ids `/detokenize` takes.
MAX_DETOKENIZE = 1 << 20


def split_tokenize_body(body: dict[str, Any]) -> tuple[dict[str, Any], dict[str, bool | None]]:
    """`body` less `TOKENIZE_FIELDS` (what is left is checked as a completion's or a chat's: a
    chat's `add_generation_prompt` and `continue_final_message` among them), and those flags
    (None: left out)."""
    rest = {name: value for name, value in body.items() if name not in TOKENIZE_FIELDS}
    flags: dict[str, bool | None] = {}
    for name in TOKENIZE_FIELDS:
        value = body.get(name)
        if value is not None and not isinstance(value, bool):
            raise ApiError(400, f"{name} must be a boolean, got {value!r}", param=name)
        flags[name] = value
    if "messages" not in rest and isinstance(rest.get("prompt"), list) and not all(
            isinstance(t, int) and not isinstance(t, bool) for t in rest["prompt"]):  # fmt: skip
        raise ApiError(400, "prompt must be one string (or one list of token ids) to tokenize", param="prompt")
    return rest, flags


def tokenized(served: Any, ids: list[int], context: int | None, token_strs: bool) -> dict[str, Any]:
    """vLLM's answer: the ids, their count, the context they count against, and with
    `token_strs` each token as the tokenizer writes it."""
    strings = None
    if token_strs:
        strings = ([served.decode([t]) for t in ids] if served.kind == "bundled"
                   else served.tokenizer.convert_ids_to_tokens(ids))  # fmt: skip
    return {"count": len(ids), "max_model_len": context, "tokens": ids, "token_strs": strings}


def detokenize_ids(body: dict[str, Any], vocab_size: int) -> list[int]:
    """`/detokenize`'s `tokens`, checked: a list of ids of the vocabulary (`model` is checked by the
    caller; nothing else is taken)."""
    unknown = sorted(set(body) - {"model", "tokens"})
    if unknown:
        raise ApiError(400, f"unrecognized request argument(s): {', '.join(unknown)}", param=unknown[0])
    ids = body.get("tokens")
    if (not isinstance(ids, list) or len(ids) > MAX_DETOKENIZE
            or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids)):  # fmt: skip
        raise ApiError(400, f"tokens must be a list of at most {MAX_DETOKENIZE} token ids", param="tokens")
    if any(not 0 <= t < vocab_size for t in ids):
        raise ApiError(400, f"tokens must be in [0, {vocab_size})", param="tokens")
    return ids
