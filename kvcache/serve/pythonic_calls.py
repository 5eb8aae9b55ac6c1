"""LFM2's tool calls, read into `ToolCall`s: a Python list of calls between the special tokens
`<|tool_call_start|>` and `<|tool_call_end|>`, each call a function's name with keyword
arguments whose values are Python literals: `[get_weather(city="Paris"), search(q='x', n=3)]`.

The list is parsed as Python (`ast`), never run: only a list of calls (or one call) by plain name, with
keyword arguments only, each a literal (strings, numbers, `True`/`False`/`None` and the JSON
spellings `true`/`false`/`null`, lists, dicts with string keys, tuples as lists); an item may
also be a JSON object `{"name": ..., "arguments": {...}}`, as some LFM2 templates render earlier
calls. Anything else is not calls (the reader then shows the text as the model wrote it)."""

from __future__ import annotations

import ast
import json
import math
from typing import Any

from .call_formats import ToolCall

OPEN, CLOSE = "<|tool_call_start|>", "<|tool_call_end|>"
#: What LFM2's templates wrap the offered tools in (some write no call themselves: this marks them)
TOOL_LIST = "<|tool_list_start|>"
_JSON_WORDS = {"true": True, "false": False, "null": None}


def read_pythonic_calls(body: str) -> list[ToolCall] | None:
    """The calls `body` (the text between `OPEN` and `CLOSE`) holds, None when it holds anything else."""
    try:
        tree = ast.parse(body.strip(), mode="eval").body
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        return None
    nodes = tree.elts if isinstance(tree, ast.List) else [tree]
    calls = []
    for node in nodes:
        call = _call(node) if not isinstance(node, ast.Dict) else _json_call(node)
        if call is None:
            return None
        calls.append(call)
    return calls or None


def _json_call(node: ast.Dict) -> ToolCall | None:
    """A call written as JSON's `{"name": ..., "arguments": {...}}` (as some LFM2 templates render
    the calls of earlier turns, so a model may write them so)."""
    try:
        value = _literal(node)
    except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
        return None
    name, arguments = value.get("name"), value.get("arguments", {})
    if not isinstance(name, str) or not isinstance(arguments, dict) or set(value) - {"name", "arguments", "id"}:
        return None
    return ToolCall(name, json.dumps(arguments, ensure_ascii=False))


def _call(node: ast.AST) -> ToolCall | None:
    if not isinstance(node, ast.Call) or node.args or any(k.arg is None for k in node.keywords):
        return None
    if not isinstance(node.func, ast.Name):  # a function's name: no attribute, no expression
        return None
    name = node.func.id
    try:
        arguments = {k.arg: _literal(k.value) for k in node.keywords}
    except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):  # what literal_eval may raise
        return None
    return ToolCall(name, json.dumps(arguments, ensure_ascii=False))


def _literal(node: ast.AST) -> Any:
    """A literal's value (`ValueError` for anything that is not one)."""
    if isinstance(node, ast.Name) and node.id in _JSON_WORDS:
        return _JSON_WORDS[node.id]
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_literal(item) for item in node.elts]
    if isinstance(node, ast.Dict):
        keys = [_literal(key) if key is not None else None for key in node.keys]
        if not all(isinstance(key, str) for key in keys):
            raise ValueError("a dict key that is not a string")
        return {key: _literal(value) for key, value in zip(keys, node.values, strict=True)}
    value = ast.literal_eval(node)  # strings, numbers, True/False/None, signed numbers
    if isinstance(value, (str, bool, int, float)) or value is None:
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError("a number JSON cannot hold")
        return value
    raise ValueError(f"not a literal of JSON's types: {type(value).__name__}")
