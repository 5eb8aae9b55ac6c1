"""A chat request's messages checked one by one and shaped as chat templates take them: a role, its
text (content parts joined), and a tool turn's parts. Every bad message is a 400 naming it."""

from __future__ import annotations

from typing import Any

from .api_error import ApiError
from .tools import assistant_calls


def chat_message(i: int, message: Any) -> dict[str, Any]:
    """A chat message as the chat template takes it: its role and text, and a tool turn's parts
    (an assistant's `tool_calls`, a tool's `tool_call_id`), and an assistant's `reasoning_content`."""
    roles = ("system", "user", "assistant", "developer", "tool")
    if not isinstance(message, dict) or message.get("role") not in roles:
        raise ApiError(400, f"messages[{i}] must be an object with a role of system, developer, user, assistant "
                       "or tool", param=f"messages[{i}]")  # fmt: skip
    content = message.get("content")
    calls = message.get("tool_calls")
    if message["role"] == "assistant" and calls is not None and content is None:
        content = ""  # an assistant turn of tool calls alone
    if isinstance(content, list):  # content parts: text only
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                   for p in content):  # fmt: skip
            raise ApiError(400, f"messages[{i}].content parts must all be text", param=f"messages[{i}].content")
        content = "".join(p["text"] for p in content)
    if not isinstance(content, str):
        raise ApiError(400, f"messages[{i}].content must be a string", param=f"messages[{i}].content")
    role = "system" if message["role"] == "developer" else message["role"]
    shaped: dict[str, Any] = {"role": role, "content": content}
    if calls is not None:
        if role != "assistant":
            raise ApiError(400, f"messages[{i}]: only an assistant message has tool_calls", param=f"messages[{i}]")
        shaped["tool_calls"] = assistant_calls(i, calls)
    thought = message.get("reasoning_content")
    if thought is not None:  # an earlier answer's reasoning, sent back: the template decides what to keep
        if role != "assistant" or not isinstance(thought, str):
            raise ApiError(400, f"messages[{i}].reasoning_content must be a string, in an assistant message",
                           param=f"messages[{i}].reasoning_content")  # fmt: skip
        shaped["reasoning_content"] = thought
    if role == "tool":
        call_id = message.get("tool_call_id")
        if not isinstance(call_id, str):
            raise ApiError(400, f"messages[{i}].tool_call_id must be a string", param=f"messages[{i}].tool_call_id")
        shaped["tool_call_id"] = call_id
    return shaped
