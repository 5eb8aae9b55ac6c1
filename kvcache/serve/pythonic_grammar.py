"""The grammar (llguidance's Lark syntax) of a forced LFM2 call held to its tool's schema.

LFM2 writes a call as Python: `NAME(key=value, ...)` with literal values, inside a list between
its call tags (`pythonic_calls`). A forced call's answer starts after `[NAME(` (or after `[`
where the model picks the tool), so the grammar holds the rest: the keyword arguments of the
tool's `parameters`, in the schema's order as structured outputs write JSON keys, the required
ones always and each optional one at most once, every value a Python literal of the type its
schema names, then `)]`, where the answer ends (the closing tag is the template's, added by the
reader). What the schema does not say precisely (nested objects, a type not named, `anyOf`) is
any literal the reader takes: strings, numbers, `True`/`False`/`None`, lists and dicts of them.
"""

from __future__ import annotations

import json
from typing import Any

#: Terminals of the literals (Rust regex syntax). Strings in double quotes with the escapes that
#: mean the same in Python and JSON; numbers as JSON writes them, positive exponents of at most
#: two digits (a float past 1e308 would be infinite, which JSON cannot hold: the reader refuses it).
TERMINALS = r"""
STRING: /"([^"\\\x00-\x1f]|\\["\\\/bfnrt]|\\u[0-9a-fA-F]{4})*"/
INTEGER: /-?(0|[1-9][0-9]{0,30})/
NUMBER: /-?(0|[1-9][0-9]{0,30})(\.[0-9]{1,30})?([eE](\+?[0-9]{1,2}|-[0-9]{1,3}))?/
SEP: /, ?/
literal: STRING | NUMBER | "True" | "False" | "None" | "[" (literal (SEP literal)*)? "]"
    | "{" (STRING ": " literal (SEP STRING ": " literal)*)? "}"
"""


class _Rules:
    """The rules of one grammar, named in the order they are made."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def add(self, body: str) -> str:
        name = f"r{len(self.lines)}"
        self.lines.append(f"{name}: {body}")
        return name

    def value(self, schema: Any) -> str:
        """The expression of a literal `schema` allows (any literal where it says too little)."""
        if not isinstance(schema, dict):
            return "literal"
        if "enum" in schema or "const" in schema:
            choices = schema["enum"] if "enum" in schema else [schema["const"]]
            if isinstance(choices, list) and choices and all(_simple(c) for c in choices):
                return self.add(" | ".join(json.dumps(_python(c)) for c in choices))
            return "literal"
        kinds = schema.get("type")
        kinds = kinds if isinstance(kinds, list) else [kinds]
        parts = [self._typed(kind, schema) for kind in kinds]
        if not parts or any(p is None for p in parts):
            return "literal"
        return parts[0] if len(parts) == 1 else self.add(" | ".join(parts))  # type: ignore[arg-type]

    def _typed(self, kind: Any, schema: dict[str, Any]) -> str | None:
        if kind == "array":
            item = self.value(schema.get("items"))
            return self.add(f'"[" ({item} (SEP {item})*)? "]"')
        return {"string": "STRING", "integer": "INTEGER", "number": "NUMBER", "boolean": '("True" | "False")',
                "null": '"None"', "object": "literal"}.get(kind)  # fmt: skip

    def arguments(self, schema: Any) -> str:
        """The expression of a call's keyword arguments for its `parameters` schema: its properties
        in order, the required ones always, the others at most once; any keyword arguments where
        it names none."""
        properties = schema.get("properties") if isinstance(schema, dict) else None
        if not isinstance(properties, dict) or not properties:
            name = r"/[A-Za-z_][A-Za-z0-9_]{0,63}/"
            return f'({name} "=" literal (SEP {name} "=" literal)*)?'
        required = set(schema.get("required") or [])
        keys = list(properties)
        items = [f"{json.dumps(key + '=')} {self.value(properties[key])}" for key in keys]
        # after[k]: the arguments from property k on, after one already written (each with its
        # comma); first[k]: the same with none written yet. None where they may all be absent.
        after: list[str | None] = [None] * (len(keys) + 1)
        first: list[str | None] = [None] * (len(keys) + 1)
        for k in range(len(keys) - 1, -1, -1):
            rest = f" {after[k + 1]}" if after[k + 1] else ""
            rest_or_none = f" {after[k + 1]}?" if after[k + 1] and not _needed(keys[k + 1:], required) else rest
            with_k = f"SEP {items[k]}{rest_or_none}"
            after[k] = self.add(with_k if keys[k] in required or not after[k + 1] else f"{with_k} | {after[k + 1]}")
            starting = f"{items[k]}{rest_or_none}"
            first[k] = self.add(starting if keys[k] in required or not first[k + 1] else f"{starting} | {first[k + 1]}")
        return first[0] if _needed(keys, required) else f"{first[0]}?"  # type: ignore[return-value]


def _needed(keys: list[str], required: set[str]) -> bool:
    return any(key in required for key in keys)


def _simple(value: Any) -> bool:
    return value is None or isinstance(value, (str, bool, int, float))


def _python(value: Any) -> str:
    """`value` as the literal LFM2 writes (JSON's spelling for strings and numbers)."""
    return {True: "True", False: "False", None: "None"}[value] if value is None or isinstance(value, bool) \
        else json.dumps(value)  # fmt: skip


def pythonic_call_lark(tools: list[dict[str, Any]], name: str) -> str:
    """The Lark grammar of the rest of a forced call to `name` ("": to one of `tools`) after its
    opening (`tools.call_opening`), to its `)]`."""
    rules = _Rules()
    choices = []
    for tool in tools:
        called = tool["function"]["name"]
        if name and called != name:
            continue
        arguments = rules.arguments(tool["function"].get("parameters"))
        choices.append(arguments if name else f"{json.dumps(called + '(')} {arguments}")
    return "\n".join([f'start: ({" | ".join(choices)}) ")]"', *rules.lines, TERMINALS.strip()])
