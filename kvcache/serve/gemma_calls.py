"""Gemma 4's tool calls, read into a `ToolCall`: each call between the special tokens
`<|tool_call>` and `<tool_call|>` as `call:NAME{key:value,...}`, where a key is written bare, a
string between two `<|"|>` tokens (no escaping: the delimiter cannot occur inside), a number,
`true`, `false` and `null` as JSON writes them (`None` too, as Gemma 4's template writes a null),
and objects and arrays as `{key:value,...}` and
`[value,...]` of the same. Whitespace between the parts is allowed; a JSON string (in double
quotes) is read as well, as a model trained on JSON may write one. What does not read as exactly
one call of this shape is not a call (the reader then shows the text as the model wrote it)."""

from __future__ import annotations

import json
import re

from .call_formats import ToolCall

OPEN, CLOSE, QUOTE = "<|tool_call>", "<tool_call|>", '<|"|>'
_HEAD = re.compile(r"\s*call:([A-Za-z0-9_.-]+)\s*(?=\{)")
_NUMBER = re.compile(r"-?(?:0|[1-9]\d*)(?:\.\d+)?(?:[eE][+-]?\d+)?")
_WORDS = {"true": True, "false": False, "null": None, "None": None}  # (Gemma 4's template writes a null as None)
_JSON = json.JSONDecoder()


def read_gemma_call(body: str) -> ToolCall | None:
    """The call `body` (the text between `OPEN` and `CLOSE`) holds, None when it holds anything else."""
    head = _HEAD.match(body)
    if head is None:
        return None
    try:
        arguments, at = _value(body, head.end())
    except (ValueError, IndexError):
        return None
    if body[at:].strip() or not isinstance(arguments, dict):
        return None
    return ToolCall(head.group(1), json.dumps(arguments, ensure_ascii=False))


def _skip(text: str, at: int) -> int:
    while at < len(text) and text[at].isspace():
        at += 1
    return at


def _value(text: str, at: int) -> tuple[object, int]:
    """The value written at `text[at:]` (after whitespace) and where it ends; `ValueError` if none is."""
    at = _skip(text, at)
    if text.startswith(QUOTE, at):
        end = text.find(QUOTE, at + len(QUOTE))
        if end < 0:
            raise ValueError("an unclosed string")
        return text[at + len(QUOTE) : end], end + len(QUOTE)
    if text[at] == '"':
        return _JSON.raw_decode(text, at)
    if text[at] in "{[":
        return _container(text, at)
    number = _NUMBER.match(text, at)
    word = re.match(r"[A-Za-z]+", text[at:])
    if word is not None and word.group() in _WORDS:
        return _WORDS[word.group()], at + word.end()
    if number is not None:
        written = number.group()
        return (float(written) if any(c in written for c in ".eE") else int(written)), number.end()
    raise ValueError(f"no value at {at}")


def _container(text: str, at: int) -> tuple[object, int]:
    """The object or array that opens at `text[at]`."""
    is_object, close = text[at] == "{", "}" if text[at] == "{" else "]"
    items: dict[str, object] | list[object] = {} if is_object else []
    at = _skip(text, at + 1)
    if text[at] == close:
        return items, at + 1
    while True:
        if is_object:
            key, at = _key(text, at)
            at = _skip(text, at)
            if text[at] != ":":
                raise ValueError("a key without its value")
            value, at = _value(text, at + 1)
            items[key] = value  # type: ignore[index]
        else:
            value, at = _value(text, at)
            items.append(value)  # type: ignore[union-attr]
        at = _skip(text, at)
        if text[at] == close:
            return items, at + 1
        if text[at] != ",":
            raise ValueError("items not separated by a comma")
        at = _skip(text, at + 1)


def _key(text: str, at: int) -> tuple[str, int]:
    """An object's key at `text[at:]`: bare, between `QUOTE`s or a JSON string."""
    if text.startswith(QUOTE, at) or text[at] == '"':
        key, end = _value(text, at)
        if not isinstance(key, str):
            raise ValueError("a key that is not a string")
        return key, end
    bare = re.match(r"[^\s:{}\[\],]+", text[at:])
    if bare is None:
        raise ValueError("no key")
    return bare.group(), at + bare.end()
