"""The grammars (llguidance's Lark syntax) of forced calls written with keyword arguments: LFM2's
Python calls, Gemma 4's `key:value` calls and Qwen 3.5's markup (`markup_call_lark`), held to
the tool's schema.

LFM2 writes `[NAME(key=value, ...)]` with Python literals between its call tags
(`pythonic_calls`); Gemma 4 writes `call:NAME{key:value,...}` with strings between `<|"|>`
tokens and JSON's numbers and words (`gemma_calls`). A forced call's answer starts after the
opening (`tools.call_opening`: `[NAME(`, `call:NAME{`, or before the name where the model picks
the tool), so the grammar holds the rest: the keyword arguments of the tool's `parameters`, in a
fixed order (the schema's, as structured outputs write JSON keys; sorted for Gemma, whose
template sorts them), the required ones always and each optional one at most once, every value
a literal of the type its schema names, then the call's end (`)]`, `}`), where the answer ends
(the closing tag is the template's, added by the reader). What the schema does not say precisely
(nested objects, a type not named, `anyOf`) is any literal the reader takes.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

#: Terminals shared by both syntaxes (Rust regex syntax): numbers as JSON writes them, positive
#: exponents of at most two digits (a float past 1e308 would be infinite, which JSON cannot hold:
#: the readers refuse it); the separator between arguments or items.
COMMON = r"""
INTEGER: /-?(0|[1-9][0-9]{0,30})/
NUMBER: /-?(0|[1-9][0-9]{0,30})(\.[0-9]{1,30})?([eE](\+?[0-9]{1,2}|-[0-9]{1,3}))?/
SEP: /, ?/
KEY: /[A-Za-z_][A-Za-z0-9_]{0,63}/
"""
#: Python's strings, in single quotes (as LFM2.5's template writes them) or double quotes (as LFM2's
#: model card shows them), with the escapes Python's `repr` writes
PYTHON_STRING = (r"""STRING: /"([^"\\\x00-\x1f]|\\(["'\\bfnrt]|x[0-9a-fA-F]{2}|u[0-9a-fA-F]{4}))*"/"""
                 r"""  | /'([^'\\\x00-\x1f]|\\(["'\\bfnrt]|x[0-9a-fA-F]{2}|u[0-9a-fA-F]{4}))*'/""")  # fmt: skip


@dataclass(frozen=True)
class Syntax:
    """How one family writes a call's arguments."""

    assign: str  # between a key and its value
    words: tuple[str, str, str]  # the expressions of true, false and null as written
    string: str  # the expression of any string
    literal: str  # the rule `literal`: any value the reader takes
    terminals: str  # what `string` and `literal` need beyond `COMMON`
    opening: str  # what follows a tool's name where the model writes it ("required")
    end: str  # what ends the call after its arguments
    sorted_keys: bool  # arguments in sorted order (else the schema's)
    key: re.Pattern[str]  # the keys (and the tools' names) this syntax writes bare

    def quoted(self, value: str) -> str:
        """The expression of the one string `value`."""
        if self.string == "STRING":  # Python's: either quote
            return f"({json.dumps(json.dumps(value))} | {json.dumps(repr(value))})"
        quote = self.string.split()[0]
        return f"{quote} {json.dumps(value)} {quote}"


PYTHONIC = Syntax(
    "=", ('"True"', '"False"', '"None"'), "STRING",
    'literal: STRING | NUMBER | "True" | "False" | "None" | "true" | "false" | "null" | "[" (literal (SEP literal)*)?'
    ' "]" | "{" (STRING ": " literal (SEP STRING ": " literal)*)? "}"',
    PYTHON_STRING, "(", ")]", False, re.compile(r"[A-Za-z_][A-Za-z0-9_]*"))  # fmt: skip


def gemma_syntax(quote_token: int) -> Syntax:
    """Gemma 4's, its string quote being the token `quote_token`."""
    string = f"<[{quote_token}]> TEXT <[{quote_token}]>"
    return Syntax(":", ('"true"', '"false"', '("null" | "None")'), string,  # (its template writes a null None)
                  f'literal: {string} | NUMBER | "true" | "false" | "null" | "None" | "[" (literal (SEP literal)*)?'
                  ' "]"\n'
                  '    | "{" (KEY ":" literal (SEP KEY ":" literal)*)? "}"',
                  r"TEXT: /(.|\n)*/", "{", "}", True, re.compile(r"[A-Za-z_][A-Za-z0-9_.-]*"))  # fmt: skip


class _Rules:
    """The rules of one grammar, named in the order they are made."""

    def __init__(self, syntax: Syntax) -> None:
        self.syntax = syntax
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
                return self.add(" | ".join(self._one(c) for c in choices))
            return "literal"
        kinds = schema.get("type")
        kinds = kinds if isinstance(kinds, list) else [kinds]
        parts = [self._typed(kind, schema) for kind in kinds]
        if not parts or any(p is None for p in parts):
            return "literal"
        return parts[0] if len(parts) == 1 else self.add(" | ".join(parts))  # type: ignore[arg-type]

    def _one(self, value: Any) -> str:
        true, false, null = self.syntax.words
        if value is None or isinstance(value, bool):
            return {True: true, False: false, None: null}[value]
        return self.syntax.quoted(value) if isinstance(value, str) else json.dumps(json.dumps(value))

    def _typed(self, kind: Any, schema: dict[str, Any]) -> str | None:
        true, false, null = self.syntax.words
        if kind == "array":
            item = self.value(schema.get("items"))
            return self.add(f'"[" ({item} (SEP {item})*)? "]"')
        return {"string": self.syntax.string, "integer": "INTEGER", "number": "NUMBER",
                "boolean": f"({true} | {false})", "null": null,
                "object": "literal"}.get(kind)  # fmt: skip

    def arguments(self, schema: Any) -> str | None:
        """The expression of a call's keyword arguments for its `parameters` schema: its properties
        in order, the required ones always, the others at most once; any keyword arguments where
        it names none. None where a key cannot be written bare."""
        assign = self.syntax.assign
        properties = schema.get("properties") if isinstance(schema, dict) else None
        if not isinstance(properties, dict) or not properties:
            return f'(KEY "{assign}" literal (SEP KEY "{assign}" literal)*)?'
        keys = sorted(properties) if self.syntax.sorted_keys else list(properties)
        if not all(self.syntax.key.fullmatch(key) for key in keys):
            return None
        required = _required(schema)
        items = [f"{json.dumps(key + assign)} {self.value(properties[key])}" for key in keys]
        # after[k]: the arguments from key k on, after one already written (each with its comma);
        # first[k]: the same with none written yet; None past the last key
        after: list[str | None] = [None] * (len(keys) + 1)
        first: list[str | None] = [None] * (len(keys) + 1)
        for k in range(len(keys) - 1, -1, -1):
            rest = f" {after[k + 1]}" if after[k + 1] else ""
            if after[k + 1] and not required.intersection(keys[k + 1 :]):
                rest += "?"
            optional = keys[k] not in required
            with_k = f"SEP {items[k]}{rest}"
            after[k] = self.add(f"{with_k} | {after[k + 1]}" if optional and after[k + 1] else with_k)
            starting = f"{items[k]}{rest}"
            first[k] = self.add(f"{starting} | {first[k + 1]}" if optional and first[k + 1] else starting)
        return first[0] if required.intersection(keys) else f"{first[0]}?"


def _required(schema: dict[str, Any]) -> set[str]:
    """The names a schema's `required` lists (none where it is not a list of names)."""
    listed = schema.get("required")
    return {name for name in listed if isinstance(name, str)} if isinstance(listed, list) else set()


def _simple(value: Any) -> bool:
    return value is None or isinstance(value, (str, bool, int, float))


def keyword_call_lark(syntax: Syntax, tools: list[dict[str, Any]], name: str) -> str | None:
    """The Lark grammar of the rest of a forced call to `name` ("": to one of `tools`) after its
    opening, to the call's end; None where a tool's keys cannot be written in `syntax`. A tool
    whose name the syntax cannot write as a call's (`my-tool(...)` is not Python) is left out of
    the choice, and a call forced to it is the model's own."""
    rules = _Rules(syntax)
    choices = []
    for tool in tools:
        called = tool["function"]["name"]
        if (name and called != name) or not syntax.key.fullmatch(called):
            continue
        arguments = rules.arguments(tool["function"].get("parameters"))
        if arguments is None:
            return None
        choices.append(arguments if name else f"{json.dumps(called + syntax.opening)} {arguments}")
    if not choices:
        return None
    lines = [f"start: ({' | '.join(choices)}) {json.dumps(syntax.end)}", *rules.lines, syntax.literal]
    return "\n".join([*lines, COMMON.strip(), syntax.terminals])


def markup_call_lark(tools: list[dict[str, Any]], name: str, whitespace: str,
                     token_id: Callable[[str], int | None]) -> str | None:  # fmt: skip
    """The Lark grammar of the rest of a forced markup call (Qwen 3.5's; `call_formats`) to `name`
    ("": to one of `tools`) after its opening, to its `</function>`: each parameter of the schema
    in its order as the template writes it (`<parameter=KEY>`, the value on lines of its own), the
    required ones always. A string is written as it is: any text up to `</parameter>` (one of an
    enum's strings where it lists strings); any other value as JSON of its schema (the template's
    `tojson`), `whitespace` between JSON's tokens. A tag the tokenizer holds as one token
    (`token_id`) is that token. None where a key cannot be written in the markup."""
    opening, closing, end = (_tag(t, token_id) for t in ("<parameter=", "</parameter>", "</function>"))
    text = "/(.|\\n)*/ " + closing if closing.startswith("<[") else "text"  # (no text matches a token)
    lines: list[str] = []
    choices = []
    for tool in tools:
        called = tool["function"]["name"]
        if name and called != name:
            continue
        schema = tool["function"].get("parameters")
        schema = schema if isinstance(schema, dict) else {}
        properties = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
        if not all(re.fullmatch(r"[^<>\n]+", key) for key in properties):
            return None
        items = []
        for key, about in properties.items():
            rule = f"r{len(lines)}"
            lines.append(f"{rule}: {_markup_value(about, whitespace, text, closing)}")
            item = f"{opening} {json.dumps(key + '>' + chr(10))} {rule}"
            items.append(item if key in _required(schema) else f"({item})?")
        head = "" if name else json.dumps(called + ">\n")
        choices.append(" ".join([head, *items]).strip())
    written = [c for c in choices if c]
    body = f"({' | '.join(written)}){'?' if len(written) < len(choices) else ''} " if written else ""
    lazy = [] if closing.startswith("<[") else ["text[lazy]: /(.|\\n)*\\n<\\/parameter>/"]
    return "\n".join([f"start: {body}{end}", *lines, *lazy, COMMON.strip()])


def _tag(text: str, token_id: Callable[[str], int | None]) -> str:
    """A tag as a grammar writes it: its token where the tokenizer holds it as one, else its text."""
    found = token_id(text)
    return json.dumps(text) if found is None else f"<[{found}]>"


def _markup_value(schema: Any, whitespace: str, text: str, closing: str) -> str:
    """The body of a rule for a parameter's value and the `</parameter>` line after it (`text`:
    any text up to and with `closing`, the tag's token or text)."""
    after = f'"\\n" {closing} "\\n"' if closing.startswith("<[") else '"\\n</parameter>\\n"'
    about = schema if isinstance(schema, dict) else {}
    choices = about["enum"] if isinstance(about.get("enum"), list) else [about["const"]] if "const" in about else None
    if choices and all(isinstance(c, str) for c in choices):
        return "(" + " | ".join(json.dumps(c) for c in choices) + f") {after}"
    kinds = about.get("type")
    if choices or kinds is None or kinds == "string" or (isinstance(kinds, list) and "string" in kinds):
        return f'{text} "\\n"'  # text as it is (strings written bare among other values too)
    scalars = [kinds] if isinstance(kinds, str) else kinds if isinstance(kinds, list) else []
    if scalars and all(kind in MARKUP_SCALARS for kind in scalars):  # as Jinja's `string` or `tojson` writes them
        return "(" + " | ".join(MARKUP_SCALARS[kind] for kind in scalars) + f") {after}"
    return f"%json {json.dumps({**about, 'x-guidance': {'whitespace_pattern': whitespace}})} {after}"


#: The markup's scalars: Qwen's templates write a number, a boolean or a null with Jinja's `string`
#: (Python's spelling: `True`, `None`) or, in later ones, `tojson` (`true`, `null`); the reader
#: takes either
MARKUP_SCALARS = {"integer": "INTEGER", "number": "NUMBER", "boolean": '("true" | "false" | "True" | "False")',
                  "null": '("null" | "None")'}  # fmt: skip
