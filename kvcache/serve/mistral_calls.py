"""Mistral's tool calls: what follows the special token `[TOOL_CALLS]` to the end of the answer
(no closing tag: a call ends the turn), in either of the formats Mistral's templates write:

    [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, ...]    (v3 templates)
    [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]search[ARGS]{...}    (v11 and later)

Mistral's templates also check the ids of the calls sent back to them: nine letters or digits
(`ToolCall.short_id`). Text before the first `[TOOL_CALLS]` is content; what follows it is held
until the answer ends, then read as calls, or shown as written where it is not exactly calls.
"""

from __future__ import annotations

import json
import re

from .call_formats import ToolCall, arguments_object
from .tags import until_tag

OPEN, ARGS = "[TOOL_CALLS]", "[ARGS]"
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


def read_mistral_calls(body: str) -> list[ToolCall] | None:
    """The calls `body` (what follows the first `OPEN`, to the answer's end) holds; None when it
    holds anything else."""
    calls = []
    for part in body.split(OPEN):
        part = part.strip()
        if not part:
            continue
        if ARGS in part:  # NAME[ARGS]{...}
            name, _, written = part.partition(ARGS)
            arguments = arguments_object(written.strip()) if written.strip().startswith("{") else None
            if not _NAME.fullmatch(name.strip()) or arguments is None:
                return None
            calls.append(ToolCall(name.strip(), json.dumps(arguments, ensure_ascii=False), short_id=True))
            continue
        try:
            listed = json.loads(part)
        except ValueError:
            return None
        for item in listed if isinstance(listed, list) else [listed]:
            name = item.get("name") if isinstance(item, dict) else None
            arguments = arguments_object(item.get("arguments", {})) if isinstance(item, dict) else None
            if not isinstance(name, str) or arguments is None:
                return None
            calls.append(ToolCall(name, json.dumps(arguments, ensure_ascii=False), short_id=True))
    return calls or None


class MistralCallReader:
    """A chat answer read for Mistral's calls: text before `[TOOL_CALLS]` passes on as content,
    what follows is held to the answer's end and read then (calls, or the text as written). The
    same interface as `tools.ToolCallReader`."""

    def __init__(self) -> None:
        self._held, self._inside = "", False
        self.calls = 0

    def feed(self, text: str) -> list[str | ToolCall]:
        self._held += text
        if self._inside:
            return []
        ready, self._held, self._inside = until_tag(self._held, OPEN)
        return [ready] if ready else []

    def finish(self) -> list[str | ToolCall]:
        held, inside, self._held, self._inside = self._held, self._inside, "", False
        calls = read_mistral_calls(held) if inside else None
        if calls is None:
            rest = (OPEN if inside else "") + held
            return [rest] if rest else []
        self.calls += len(calls)
        return list(calls)
