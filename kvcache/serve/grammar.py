"""Structured outputs: a chat answer held to JSON (`response_format: {"type": "json_object"}`) or
to a JSON Schema (`{"type": "json_schema", "json_schema": {"schema": ...}}`), token by token.

The grammar engine is llguidance (the one vLLM, SGLang and llama.cpp use for this; a Rust
library with no Python dependencies): from the grammar's state it says which tokens may come
next, and the engine sets every other token's logit to -inf before it chooses, greedy or sampled.
Writing our own would mean a JSON Schema compiler and a tokenizer-aware lexer, with their bugs.
The web side turns `response_format` into a grammar (checked there: a bad schema is a 400 before
anything is queued); the engine keeps one `Constraint` per constrained answer, and the answer
ends ("stop") where the grammar allows nothing more. Constrained rows never draft (a draft would
have to be checked against the grammar token by token).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from typing import Any

import torch

from ..errors import CacheInputError
from .api_error import ApiError
from .gemma_calls import QUOTE as GEMMA_QUOTE
from .keyword_grammar import PYTHONIC, gemma_syntax, keyword_call_lark, markup_call_lark
from .mistral_calls import ARGS as MISTRAL_ARGS

INSTALL = "pip install 'kvcache[serve]'"
#: The whitespace allowed between JSON tokens: any layout a model writes (indented objects nested
#: a dozen levels deep), but not the endless run of blanks a weak model falls into once JSON's
#: grammar lets it (a known failure of unbounded whitespace under constrained decoding).
WHITESPACE = r"[\x20\x0A\x0D\x09]{0,48}"


def _llguidance() -> Any:
    try:
        import llguidance
    except ImportError:
        return None
    return llguidance


def grammar_of(response_format: Any, param: str = "response_format") -> str | None:
    """The grammar a chat's `response_format` asks for: None for text (absent, or `{"type":
    "text"}`); a 400 naming `param` for anything that is not a format this server holds answers to."""
    if response_format is None:
        return None
    kind = response_format.get("type") if isinstance(response_format, dict) else None
    if kind == "text" and set(response_format) == {"type"}:
        return None
    if kind == "json_object" and set(response_format) == {"type"}:
        schema: Any = {"type": "object"}
    elif kind == "json_schema" and set(response_format) == {"type", "json_schema"}:
        schema = _schema(response_format["json_schema"], f"{param}.json_schema")
    else:
        raise ApiError(400, f'{param} must be {{"type": "text"}}, {{"type": "json_object"}} or {{"type": '
                       f'"json_schema", "json_schema": {{"name": ..., "schema": {{...}}}}}}, got '
                       f"{response_format!r}"[:300], param=param)  # fmt: skip
    llguidance = _llguidance()
    if llguidance is None:
        raise ApiError(400, f"{param} needs llguidance, which is not installed: {INSTALL}", param=param)
    grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_pattern": WHITESPACE})
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error:
        raise ApiError(400, f"{param}: the schema cannot be followed: {error}"[:400], param=param)
    return grammar


def call_grammar(style: str, tools: list[dict[str, Any]], name: str,
                 token_id: Callable[[str], int | None] = lambda text: None) -> str | None:  # fmt: skip
    """The grammar of the rest of a forced call after its opening (`tools.call_opening`): the tool's
    name where the opening left it out ("required": one of the `tools`), then its arguments as its
    parameters' JSON Schema says, then what closes the call's object (`}`; `}]` for Mistral's
    JSON list; nothing after Mistral's `NAME[ARGS]{...}`, which ends the answer). The answer ends
    there: a tagged call's closing tag, often a token of its own, is the template's, added by the
    reader (`Completion`'s `closing`). LFM2's Python calls, Gemma 4's `key:value` ones and Qwen
    3.5's markup are held to the schema as `keyword_grammar` writes them. `token_id` gives the id
    of a tag the tokenizer holds as one token (`TextModel.token_id`): such a tag inside a call
    (Mistral's `[ARGS]`, Gemma's string quote, the markup's tags) is that token, which no text
    matches (a Gemma call, or a Mistral call to a tool the model picks, without its token is the
    model's own). None without llguidance, or for schemas it cannot follow (the call is then the
    model's alone)."""
    llguidance = _llguidance()
    if llguidance is None or style not in ("json", "bare", "mistral", "mistral-args", "pythonic", "gemma", "markup"):
        return None
    if style == "markup":
        lark = markup_call_lark(tools, name, WHITESPACE, token_id)
        return None if lark is None else _valid(llguidance, lark)
    args_token, quote_token = token_id(MISTRAL_ARGS), token_id(GEMMA_QUOTE)
    if (style == "mistral-args" and not name and args_token is None) or (style == "gemma" and quote_token is None):
        return None
    if style in ("pythonic", "gemma"):
        syntax = PYTHONIC if style == "pythonic" else gemma_syntax(quote_token)  # type: ignore[arg-type]
        lark = keyword_call_lark(syntax, tools, name)
        return None if lark is None else _valid(llguidance, lark)
    field = "parameters" if style == "bare" else "arguments"
    # Mistral's v3 templates write each call's id after its arguments (nine letters and digits)
    end = {"mistral": r'(", \"id\": " /"[A-Za-z0-9]{9}"/)? "}]"', "mistral-args": ""}.get(style, '"}"')
    rules, choices = [], []
    for i, tool in enumerate(t for t in tools if not name or t["function"]["name"] == name):
        schema = {**(tool["function"].get("parameters") or {"type": "object"}),
                  "x-guidance": {"whitespace_pattern": WHITESPACE}}  # fmt: skip
        rules.append(f"args{i}: %json {json.dumps(schema)}")
        called = tool["function"]["name"]
        if style == "mistral-args":  # [TOOL_CALLS]NAME[ARGS]{...}: the opening ends after [ARGS] when named
            choices.append(f"args{i}" if name else f"{json.dumps(called)} <[{args_token}]> args{i}")
            continue
        head = "" if name else json.dumps(f" {json.dumps(called)}, \"{field}\":") + " "
        choices.append(f'{head}" " args{i}')
    lark = "\n".join([f"start: ({' | '.join(choices)}) {end}".strip(), *rules])
    return _valid(llguidance, lark)


def _valid(llguidance: Any, lark: str) -> str | None:
    """`lark` as llguidance's grammar, or None where it cannot follow it."""
    grammar = llguidance.LLMatcher.grammar_from_lark(lark)
    return None if llguidance.LLMatcher.validate_grammar(grammar) else grammar


def _schema(about: Any, param: str) -> dict[str, Any]:
    """A `json_schema` object's schema (OpenAI's shape: `name`, `schema`, optional `description`
    and `strict`)."""
    if not isinstance(about, dict) or not isinstance(about.get("name"), str) or not about["name"]:
        raise ApiError(400, f"{param} must be an object with a name", param=param)
    unknown = sorted(set(about) - {"name", "schema", "description", "strict"})
    if unknown:
        raise ApiError(400, f"{param} has unknown field(s): {', '.join(unknown)}", param=param)
    if about.get("strict") not in (None, True, False):
        raise ApiError(400, f"{param}.strict must be a boolean", param=f"{param}.strict")
    schema = about.get("schema", {})  # (OpenAI: no schema allows any JSON)
    if not isinstance(schema, dict):
        raise ApiError(400, f"{param}.schema must be a JSON Schema object", param=f"{param}.schema")
    return schema


def grammar_tokenizer(served: Any) -> Any:
    """llguidance's view of `served`'s tokenizer (each token's bytes, its end tokens): a
    transformers fast tokenizer as it is; the bundled model's characters one per token, with one
    end token past its vocabulary (it has none: an answer ends where its grammar ends)."""
    llguidance = _llguidance()
    if llguidance is None:
        raise CacheInputError(f"structured outputs need llguidance: {INSTALL}")
    if served.kind == "bundled":
        tokenizer, vocab = served.tokenizer, int(served.model.vocab_size)
        end = vocab

        class Characters:
            eos_token_id, bos_token_id, special_token_ids = end, None, [end]
            tokens = [tokenizer.decode([i]).encode() for i in range(vocab)] + [b""]

            def __call__(self, text: bytes | str) -> list[int]:
                return tokenizer.encode(text.decode(errors="replace") if isinstance(text, bytes) else text)

        return llguidance.LLTokenizer(llguidance.TokenizerWrapper(Characters()), n_vocab=vocab + 1)
    import llguidance.hf

    return llguidance.hf.from_tokenizer(served.tokenizer, eos_token=list(served.eos) or None)


class TokenizerInBackground:
    """`grammar_tokenizer`'s result, built on a thread of its own once `start`ed (an engine starts
    it with itself): for a large vocabulary it takes about a second, which the engine's thread,
    holding every row, would otherwise spend at the first request with a format. `get` waits for
    it, and raises what building it raised (llguidance not installed)."""

    def __init__(self, build: Callable[[], Any]) -> None:
        self._build, self._value, self._error = build, None, None
        self._thread = threading.Thread(target=self._run, name="kvcache-grammar-tokenizer", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        try:
            self._value = self._build()
        except Exception as exc:  # (raised again where a request needs it)
            self._error = exc

    def get(self) -> Any:
        if self._thread.ident is None:  # never started (an engine driven by hand): built here
            self._thread.start()
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._value


class Constraint:
    """One answer's grammar state over a model of `vocab` tokens: `mask` the logits of the next
    token, `accept` the token chosen; `done` once the grammar allows nothing more."""

    def __init__(self, tokenizer: Any, grammar: str, vocab: int) -> None:
        llguidance = _llguidance()
        self.matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        if self.matcher.is_error():
            raise CacheInputError(f"response_format: {self.matcher.get_error()}")
        self.vocab = vocab
        self._next()

    def _next(self) -> None:
        """The tokens that may come next (the model's vocabulary: tokens the tokenizer does not
        know never may), and whether any may."""
        bias = torch.frombuffer(bytearray(self.matcher.compute_logit_bias()), dtype=torch.uint8)
        if bias.numel() < self.vocab:
            bias = torch.cat([bias, bias.new_zeros(self.vocab - bias.numel())])
        self.allowed = bias[: self.vocab] != 0
        self.done = self.matcher.is_stopped() or not bool(self.allowed.any())

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """`logits` (`[..., vocab]`) with every token the grammar does not allow next at -inf."""
        return logits.masked_fill(~self.allowed.to(logits.device), float("-inf"))

    def accept(self, token: int) -> None:
        """The answer's next token (one `mask` allowed)."""
        if not self.matcher.consume_token(token):
            raise CacheInputError(f"response_format: token {token} does not follow the grammar: "
                                  f"{self.matcher.get_error()}"[:300])  # fmt: skip
        self._next()
