"""The OpenAI request bodies the server takes, checked field by field, and its error answers.

Every bad request is an `ApiError`: the status (400 for a malformed or out-of-range field, 401
without the API key, 404 for another model or path, 413 for a body too large, 429 when the queue
is full) and OpenAI's error JSON, `{"error": {"message", "type", "param", "code"}}`, never a
traceback. Fields OpenAI defines that this server does not implement are accepted only at their
neutral value (`best_of=1`, chat's `echo` off, penalties 0, ...); unknown fields are refused. Log
probabilities are returned as OpenAI shapes them: chat's `logprobs: true` with `top_logprobs`
alternatives (0 to `MAX_LOGPROBS`), completions' `logprobs: k` (the chosen token and the top k),
the prompt's too with `echo`.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

from .api_error import ApiError
from .grammar import grammar_of
from .messages import chat_message
from .prediction import predicted_text
from .reasoning import reasoning_effort
from .tools import check_tools, forced_tool

__all__ = ["ApiError", "Limits", "Params", "chat_params", "completion_params", "parse_json"]


#: Fields accepted only at these values (OpenAI defines them; this server does not implement them).
#: Each lists every value that means "off".
NEUTRAL: dict[str, tuple[Any, ...]] = {
    "best_of": (1,), "echo": (False,), "suffix": (None, ""),
    "tools": (None, []), "tool_choice": (None, "none"), "response_format": (None, {"type": "text"}),
    "parallel_tool_calls": (None,)}  # fmt: skip
#: Of those, the ones a chat completion implements (`tools`, `response_format`).
TOOL_FIELDS = ("tools", "tool_choice", "parallel_tool_calls", "response_format")
#: Fields accepted and ignored (they change nothing here).
IGNORED = {"user", "metadata", "store", "service_tier"}
#: Temperatures above 0 and below this decode greedily (dividing logits by less overflows them).
GREEDY_BELOW = 1e-5
#: The most alternatives a token's log probabilities list (`top_logprobs`, completions' `logprobs`).
MAX_LOGPROBS = 20
#: The most tokens a request's `logit_bias` names (OpenAI's limit).
MAX_LOGIT_BIAS = 300
#: The most choices one request asks for: its prompts (a completion may send a list) times `n`.
MAX_CHOICES = 64
#: The most `stop_token_ids` a request may name.
MAX_STOP_TOKEN_IDS = 64
COMMON = {"model", "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stream", "stream_options",
          "logprobs", "top_logprobs", "n", "logit_bias", "presence_penalty", "frequency_penalty",
          "repetition_penalty", "ignore_eos", "min_tokens", "stop_token_ids",
          "include_stop_str_in_output", "truncate_prompt_tokens"}  # fmt: skip
COMPLETION_FIELDS = COMMON | {"prompt"} | set(NEUTRAL) | IGNORED
CHAT_FIELDS = (COMMON | {"messages", "max_completion_tokens", "chat_template_kwargs", "add_generation_prompt",
                         "continue_final_message", "prediction", "reasoning_effort"}
               | set(NEUTRAL) | IGNORED)  # fmt: skip
#: `apply_chat_template`'s own parameters, which `chat_template_kwargs` may not set.
TEMPLATE_PARAMETERS = {"conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
                       "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors",
                       "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
                       "processor_kwargs"}  # fmt: skip


@dataclass
class Limits:
    max_body_bytes: int = 1 << 20
    max_prompt_tokens: int = 8192
    max_tokens: int = 4096
    default_max_tokens: int = 128
    max_waiting: int = 256
    #: what a request that leaves a sampling setting out gets (the served model's recommended
    #: `temperature`, `top_p`, `top_k`, `min_p`, `repetition_penalty`: `models.sampling_defaults`);
    #: OpenAI's (and 1, no repetition penalty) otherwise
    sampling: dict[str, float | int] = field(default_factory=dict)
    #: the most tokens a prompt and its answer hold together (`--max-model-len`, by default the
    #: model's context: `models.context_length`); None: no limit
    context_length: int | None = None


@dataclass
class Params:
    """A checked request: its prompts (texts, or token ids; a chat's one, once its template is
    applied) and the generation parameters; `n` answers to each prompt."""

    prompts: list[str | list[int]]
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: no cut (-1, as vLLM writes it, means the same)
    min_p: float = 0.0  # 0: no cut
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    messages: list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None  # a chat's function tools, as its template takes them
    template_options: dict[str, Any] = field(default_factory=dict)  # a chat's `chat_template_kwargs`
    generation_prompt: bool = True  # a chat's prompt ends with the start of the answer (vLLM's `add_generation_prompt`)
    continue_final: bool = False  # ... or inside its last message, an assistant's (`continue_final_message`)
    reasoning: bool | None = None  # a chat's answer read for reasoning (True: it starts thinking); None: not
    reasoning_tags: tuple[str, str] | None = None  # the tags it is read with (`reasoning.reasoning_tags`)
    call_style: str | None = None  # how a chat offered tools writes calls (`tools.call_style`); None: no tools
    forced_tool: str | None = None  # a chat's forced `tool_choice`: None (the model chooses), "" (any tool), a name
    opening: str = ""  # what the chat's prompt ends with of its answer (a forced call's start: `tools.call_opening`)
    grammar: str | None = None  # a chat's `response_format` as a grammar its answer is held to (`grammar.grammar_of`)
    closing: str = ""  # what a chat's answer held to a grammar ends with, unwritten (a forced call's closing tag)
    logprobs: int | None = None  # None: no log probabilities; k: the chosen token's and the top k
    n: int = 1
    max_tokens_asked: bool = True  # False: max_tokens is the server's default (cut to the context's room)
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) pairs, added to the logits
    echo: bool = False  # a completion's text (and log probabilities) start with its prompt's
    presence_penalty: float = 0.0  # subtracted from the logits of every token generated so far
    frequency_penalty: float = 0.0  # ... once per time it was generated
    repetition_penalty: float = 1.0  # divides (multiplies, if negative) the logits of tokens seen (vLLM's field)
    # vLLM's fields: the answer goes on past the model's end tokens; ends at these tokens too; cannot
    # end (an end or stop token, a stop string) before this many tokens; shows the stop string it ended on
    ignore_eos: bool = False
    stop_token_ids: frozenset[int] = frozenset()
    min_tokens: int = 0
    include_stop: bool = False
    truncate: int | None = None  # vLLM's `truncate_prompt_tokens`: the prompt's last so many tokens (-1: all taken)
    prediction: str | None = None  # a chat's predicted output (`prediction.predicted_text`), drafted from


#: JSON nested deeper than this is refused (a request needs 4 levels; Python's parser recurses).
MAX_JSON_DEPTH = 32


def parse_json(raw: bytes) -> dict[str, Any]:
    """The request body as a JSON object; a 400 for anything else: invalid JSON or UTF-8, strings
    that are not valid Unicode (lone surrogates such as "\\ud800", which no answer could quote),
    nesting deeper than `MAX_JSON_DEPTH`."""
    try:
        body = json.loads(raw)
    except RecursionError:
        raise ApiError(400, f"the request body is nested deeper than {MAX_JSON_DEPTH} levels",
                       code="invalid_json") from None  # fmt: skip
    except (ValueError, UnicodeDecodeError) as exc:
        why = "a number has too many digits" if "integer string conversion" in str(exc) else exc  # not Python's advice
        raise ApiError(400, f"the request body is not valid JSON ({why})", code="invalid_json") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    _check_json(body, 1)
    return body


def _check_json(value: Any, depth: int) -> None:
    if depth > MAX_JSON_DEPTH:
        raise ApiError(400, f"the request body is nested deeper than {MAX_JSON_DEPTH} levels", code="invalid_json")
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise ApiError(400, "the request body holds a string that is not valid Unicode (a lone surrogate)",
                           code="invalid_json") from None  # fmt: skip
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_json(key, depth)
            _check_json(item, depth + 1)
    elif isinstance(value, list):
        for item in value:
            _check_json(item, depth + 1)


def _number(body: dict[str, Any], name: str, default: float, low: float, high: float, *,
            low_open: bool = False) -> float:  # fmt: skip
    value = body.get(name, default)
    if value is None:
        return float(default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ApiError(400, f"{name} must be a number, got {value!r}", param=name)
    if value < low or value > high or (low_open and value == low):
        span = f"({low}, {high}]" if low_open else f"[{low}, {high}]"
        raise ApiError(400, f"{name} must be in {span}, got {value!r}", param=name)
    return float(value)


def _integer(value: Any, name: str, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ApiError(400, f"{name} must be an integer, got {value!r}", param=name)
    if not low <= value <= high:
        raise ApiError(400, f"{name} must be in [{low}, {high}], got {value}", param=name)
    return value


def _same(value: Any, neutral: Any) -> bool:
    """`value == neutral`, except that a boolean equals only a boolean (`n: true` is not `n: 1`)."""
    if isinstance(value, bool) or isinstance(neutral, bool):
        return type(value) is type(neutral) and value == neutral
    return value == neutral


def _common(body: dict[str, Any], allowed: set[str], model: str | tuple[str, ...], limits: Limits, max_name: str,
            least_tokens: int = 1, implemented: tuple[str, ...] = ()) -> Params:  # fmt: skip
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise ApiError(400, f"unrecognized request argument(s): {', '.join(unknown)}", param=unknown[0])
    for name, neutral in NEUTRAL.items():
        if name in body and name not in implemented and not any(_same(body[name], v) for v in neutral):
            shown = " or ".join(json.dumps(v) for v in neutral)
            raise ApiError(400, f"{name}={body[name]!r} is not supported by this server (only {shown})",
                           param=name)  # fmt: skip
    names = (model,) if isinstance(model, str) else model  # the ids the served model answers to, shown first
    given = body.get("model")
    if given is not None and given not in names:
        raise ApiError(404, f"the model {given!r} does not exist; this server serves {names[0]!r}", param="model",
                       code="model_not_found")  # fmt: skip
    maximum = body.get(max_name, body.get("max_tokens"))
    max_tokens = (limits.default_max_tokens if maximum is None
                  else _integer(maximum, max_name, least_tokens, limits.max_tokens))  # fmt: skip
    seed = body.get("seed")
    if seed is not None:
        seed = _integer(seed, "seed", -(2**63), 2**63 - 1)
    stop = body.get("stop")
    stops = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or len(stops) > 4 or not all(isinstance(s, str) and s for s in stops):
        raise ApiError(400, f"stop must be a non-empty string or a list of up to 4 of them, got {stop!r}", param="stop")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise ApiError(400, f"stream must be a boolean, got {stream!r}", param="stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict) or not isinstance(options.get("include_usage", False), bool):
        raise ApiError(400, f"stream_options must be an object with a boolean include_usage, got {options!r}",
                       param="stream_options")  # fmt: skip
    if options and not stream:  # as OpenAI's API and vLLM answer it
        raise ApiError(400, "stream_options is only allowed with stream: true", param="stream_options")
    model_says = limits.sampling  # the served model's recommended settings, for those left out
    top_k = body.get("top_k")
    top_k = (int(model_says.get("top_k", 0)) if top_k is None
             else 0 if top_k == -1 else _integer(top_k, "top_k", 0, 1 << 31))  # fmt: skip
    temperature = _number(body, "temperature", model_says.get("temperature", 1.0), 0.0, 2.0)
    n = 1 if body.get("n") is None else _integer(body["n"], "n", 1, MAX_CHOICES)
    min_tokens = 0 if body.get("min_tokens") is None else _integer(body["min_tokens"], "min_tokens", 0, 1 << 31)
    if min_tokens > max_tokens:  # (vLLM answers it so)
        raise ApiError(400, f"min_tokens must be at most max_tokens ({max_tokens}), got {min_tokens}",
                       param="min_tokens")  # fmt: skip
    return Params(prompts=[], max_tokens=max_tokens, max_tokens_asked=maximum is not None, n=n,
                  logit_bias=_logit_bias(body.get("logit_bias")),
                  temperature=0.0 if temperature < GREEDY_BELOW else temperature,
                  top_p=_number(body, "top_p", model_says.get("top_p", 1.0), 0.0, 1.0, low_open=True), top_k=top_k,
                  min_p=_number(body, "min_p", model_says.get("min_p", 0.0), 0.0, 1.0), seed=seed, stop=stops,
                  stream=stream, include_usage=bool(options.get("include_usage", False)),
                  presence_penalty=_number(body, "presence_penalty", 0.0, -2.0, 2.0),
                  frequency_penalty=_number(body, "frequency_penalty", 0.0, -2.0, 2.0),
                  repetition_penalty=_number(body, "repetition_penalty", model_says.get("repetition_penalty", 1.0),
                                             0.0, 2.0, low_open=True),
                  ignore_eos=_flag(body, "ignore_eos"), stop_token_ids=_stop_token_ids(body.get("stop_token_ids")),
                  min_tokens=min_tokens, include_stop=_flag(body, "include_stop_str_in_output"),
                  truncate=_truncation(body.get("truncate_prompt_tokens")))  # fmt: skip


def _truncation(value: Any) -> int | None:
    """vLLM's `truncate_prompt_tokens`: k >= 1 keeps the prompt's last k tokens, -1 as many as the
    server takes; null: the whole prompt."""
    if value is None or (type(value) is int and value == -1):
        return value
    return _integer(value, "truncate_prompt_tokens", 1, 1 << 31)


def _flag(body: dict[str, Any], name: str, default: bool = False) -> bool:
    """A boolean field (null or absent: `default`)."""
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ApiError(400, f"{name} must be a boolean, got {value!r}", param=name)
    return value


def _stop_token_ids(value: Any) -> frozenset[int]:
    """vLLM's `stop_token_ids`: a list of at most `MAX_STOP_TOKEN_IDS` token ids (null: none). Ids
    past the vocabulary are refused by the server."""
    if value is None:
        return frozenset()
    if (not isinstance(value, list) or len(value) > MAX_STOP_TOKEN_IDS
            or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value)):  # fmt: skip
        raise ApiError(400, f"stop_token_ids must be a list of at most {MAX_STOP_TOKEN_IDS} token ids, got "
                       f"{value!r}"[:300], param="stop_token_ids")  # fmt: skip
    return frozenset(value)


def _logit_bias(value: Any) -> tuple[tuple[int, float], ...]:
    """OpenAI's `logit_bias`: an object of token ids (as strings) to numbers in [-100, 100], at most
    `MAX_LOGIT_BIAS` of them (null or {}: none). Ids past the vocabulary are refused by the server."""
    if value is None:
        return ()
    if not isinstance(value, dict) or len(value) > MAX_LOGIT_BIAS:
        raise ApiError(400, f"logit_bias must be an object of at most {MAX_LOGIT_BIAS} token ids to numbers",
                       param="logit_bias")  # fmt: skip
    pairs = []
    for key, bias in value.items():
        if not (key.isascii() and key.isdigit()) or len(key) > 10:
            raise ApiError(400, f"logit_bias keys must be token ids, got {key!r}", param="logit_bias")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not -100 <= bias <= 100:
            raise ApiError(400, f"logit_bias values must be numbers in [-100, 100], got {bias!r} for token {key}",
                           param="logit_bias")  # fmt: skip
        pairs.append((int(key), float(bias)))
    return tuple(pairs)


def completion_params(body: dict[str, Any], model: str | tuple[str, ...], limits: Limits) -> Params:
    """A completion's request checked. `echo` (a completion field: chat's stays off) may ask for no
    new token (`max_tokens: 0`), the prompt's log probabilities alone, as evaluation harnesses
    score a text."""
    echo = False if body.get("echo") is None else body["echo"]  # null: the default, as OpenAI reads it
    if not isinstance(echo, bool):
        raise ApiError(400, f"echo must be a boolean, got {echo!r}", param="echo")
    body = {name: value for name, value in body.items() if name != "echo"}
    params = _common(body, COMPLETION_FIELDS, model, limits, "max_tokens", 0 if echo else 1)
    params.echo = echo
    if body.get("top_logprobs") not in (None, 0) or isinstance(body.get("top_logprobs"), bool):
        raise ApiError(400, "top_logprobs is a chat field: a completion takes logprobs: k (the top k)",
                       param="top_logprobs")  # fmt: skip
    count = body.get("logprobs")
    if count is not None and count is not False:  # false: off, as null
        params.logprobs = _integer(count, "logprobs", 0, MAX_LOGPROBS)
    prompt = body.get("prompt")
    prompts = prompt if isinstance(prompt, list) and prompt and not _token_ids(prompt) else [prompt]
    if not all((isinstance(p, str) and p) or _token_ids(p) for p in prompts):
        raise ApiError(400, "prompt must be a non-empty string, a list of token ids, or a non-empty list of either",
                       param="prompt")  # fmt: skip
    if len(prompts) * params.n > MAX_CHOICES:
        raise ApiError(400, f"{len(prompts)} prompt(s) times n={params.n} is more than the {MAX_CHOICES} choices a "
                       "request may ask for", param="n")  # fmt: skip
    params.prompts = prompts
    return params


def _token_ids(value: Any) -> bool:
    """A non-empty list of ints (one prompt's token ids)."""
    return isinstance(value, list) and bool(value) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in value)


def chat_params(body: dict[str, Any], model: str | tuple[str, ...], limits: Limits) -> Params:
    """A chat's request checked (`model`: the id, or ids, a request may name)."""
    params = _common(body, CHAT_FIELDS, model, limits, "max_completion_tokens", implemented=TOOL_FIELDS)
    params.tools = check_tools(body)
    params.forced_tool = forced_tool(body, params.tools)
    params.grammar = grammar_of(body.get("response_format"))
    params.prediction = predicted_text(body.get("prediction"))
    if params.grammar is not None and params.tools is not None:
        raise ApiError(400, "response_format with tools is not supported: an answer held to a format cannot call "
                       "tools (send tool_choice \"none\" or no tools)", param="response_format")  # fmt: skip
    wanted, top = body.get("logprobs"), body.get("top_logprobs")
    if wanted is not None and not isinstance(wanted, bool):
        raise ApiError(400, f"logprobs must be a boolean, got {wanted!r}", param="logprobs")
    top = 0 if top is None else _integer(top, "top_logprobs", 0, MAX_LOGPROBS)
    if top and not wanted:  # as OpenAI answers it
        raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    params.logprobs = top if wanted else None
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages must be a non-empty list", param="messages")
    params.messages = [chat_message(i, message) for i, message in enumerate(messages)]
    options = body.get("chat_template_kwargs", {})
    if not isinstance(options, dict) or not all(isinstance(k, str) and k.isidentifier() for k in options):
        raise ApiError(400, "chat_template_kwargs must be an object of variables for the chat template",
                       param="chat_template_kwargs")  # fmt: skip
    taken = sorted(set(options) & TEMPLATE_PARAMETERS)
    if taken:
        raise ApiError(400, f"chat_template_kwargs may not set {', '.join(taken)} (a request field or the "
                       "server's choice)", param="chat_template_kwargs")  # fmt: skip
    effort = reasoning_effort(body.get("reasoning_effort"))  # a template variable (chat_template_kwargs win)
    params.template_options = options if effort is None else {"reasoning_effort": effort, **options}
    params.generation_prompt = _flag(body, "add_generation_prompt", True)
    params.continue_final = _flag(body, "continue_final_message")
    if params.continue_final and params.generation_prompt:  # (vLLM's rule)
        raise ApiError(400, "continue_final_message and add_generation_prompt cannot both be true (send "
                       "add_generation_prompt: false to continue the last message)", param="continue_final_message")
    if params.continue_final and params.messages[-1]["role"] != "assistant":
        raise ApiError(400, "continue_final_message needs the last message to be the assistant's",
                       param="continue_final_message")  # fmt: skip
    return params

