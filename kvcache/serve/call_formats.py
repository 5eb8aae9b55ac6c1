"""The two ways a model writes one tool call between `<tool_call>` and `</tool_call>`, read into a
`ToolCall`: Qwen 3's and Hermes' JSON object (`{"name": ..., "arguments": {...}}`), and the
markup of Qwen 3.5's and Qwen3-Coder's templates:

    <function=NAME>
    <parameter=KEY>
    VALUE
    </parameter>
    </function>

In the markup every value is text, as the template wrote it (a string as it is, anything else as
JSON or as Jinja's string of it), so a value is read back by the type the offered tool's JSON
Schema gives that parameter: a string stays text (less the newline the template puts on each side;
`null` of a nullable string is null), an integer, number, boolean, null, object or array is parsed
as one; a parameter the schema does not type, or a value that does not parse as its type, stays
text (the client validates calls).
"""

from __future__ import annotations

import json
import math
import re
import uuid
from dataclasses import dataclass
from typing import Any

#: One call in the markup: the function's name, then its parameters and nothing else.
_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>(.*?)</function>\s*", re.DOTALL)
_PARAMETER = re.compile(r"\s*<parameter=([^>\n]+)>(.*?)</parameter>", re.DOTALL)


@dataclass
class ToolCall:
    """One call the model wrote: a function's name and its arguments (JSON text of an object);
    `short_id`: its id is nine letters and digits, as Mistral's templates require of the calls
    sent back to them (else OpenAI's `call_...`)."""

    name: str
    arguments: str
    short_id: bool = False

    def shaped(self, index: int | None = None) -> dict[str, Any]:
        """The call as OpenAI writes it (with its `index` in a stream's delta)."""
        out = {"id": uuid.uuid4().hex[:9] if self.short_id else f"call_{uuid.uuid4().hex[:24]}", "type": "function",
               "function": {"name": self.name, "arguments": self.arguments}}  # fmt: skip
        return out if index is None else {"index": index, **out}


def arguments_object(value: Any) -> dict[str, Any] | None:
    """A call's arguments as an object: given as one, or as JSON text of one; None otherwise."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            return None
    return value if isinstance(value, dict) else None


def parameter_types(tools: list[dict[str, Any]] | None) -> dict[str, dict[str, tuple[str, ...]]]:
    """For each offered function, the JSON Schema types each of its parameters may take."""
    out = {}
    for tool in tools or []:
        function = tool["function"]
        properties = (function.get("parameters") or {}).get("properties")
        if isinstance(properties, dict):
            out[function["name"]] = {key: _types(schema) for key, schema in properties.items()}
    return out


def _types(schema: Any) -> tuple[str, ...]:
    if not isinstance(schema, dict):
        return ()
    named = schema.get("type")
    types = [named] if isinstance(named, str) else [t for t in named if isinstance(t, str)] if isinstance(
        named, list) else []  # fmt: skip
    for union in ("anyOf", "oneOf"):
        for choice in schema.get(union) or []:
            types += _types(choice)
    if schema.get("nullable"):
        types.append("null")
    return tuple(types)


def read_call(body: str, types: dict[str, dict[str, tuple[str, ...]]]) -> ToolCall | None:
    """The call `body` (the text between the tags) holds, in either format; None when it is neither
    (then the model's text is shown as it wrote it). `types`: `parameter_types` of the offered tools."""
    if _FUNCTION.fullmatch(body):
        return _markup_call(body, types)
    try:
        value = json.loads(body)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = arguments_object(value.get("arguments", value.get("parameters", {})))
    return None if arguments is None else ToolCall(value["name"], json.dumps(arguments, ensure_ascii=False))


def _markup_call(body: str, types: dict[str, dict[str, tuple[str, ...]]]) -> ToolCall | None:
    function = _FUNCTION.fullmatch(body)
    assert function is not None
    name, inner = function.group(1).strip(), function.group(2)
    arguments, at = {}, 0
    for parameter in _PARAMETER.finditer(inner):
        if parameter.start() != at:  # text between parameters: not the markup
            return None
        key, at = parameter.group(1).strip(), parameter.end()
        arguments[key] = _value(parameter.group(2), types.get(name, {}).get(key, ()))
    if inner[at:].strip():
        return None
    return ToolCall(name, json.dumps(arguments, ensure_ascii=False))


def _value(text: str, types: tuple[str, ...]) -> Any:
    """A parameter's text as the value its schema `types` say it is (text where none fits)."""
    text = text.removeprefix("\n").removesuffix("\n")  # the template's layout around a value
    bare = text.strip()
    if "string" in types or not types:  # text, unless it is the null of an Optional[str]
        return None if "null" in types and bare == "null" else text
    for kind in types:
        if kind == "null" and bare in ("null", "None"):
            return None
        if kind == "boolean" and bare.lower() in ("true", "false"):
            return bare.lower() == "true"
        if kind in ("integer", "number"):
            try:
                number = float(bare)
            except ValueError:
                continue
            if not math.isfinite(number):
                continue
            if kind == "integer" or re.fullmatch(r"[+-]?\d+", bare):
                if number.is_integer():
                    return int(bare) if re.fullmatch(r"[+-]?\d+", bare) else int(number)
                continue
            return number
        if kind in ("object", "array"):
            try:
                parsed = json.loads(bare)
            except ValueError:
                continue
            if isinstance(parsed, dict if kind == "object" else list):
                return parsed
    return text
