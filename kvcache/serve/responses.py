"""OpenAI's Responses API (`POST /v1/responses`) over the chat completions path: a request's
`input` and `instructions` become a conversation, its function tools and generation settings the
chat's, and the answer comes back as output items (a `reasoning` item, a `message` with its
`output_text`, a `function_call` per call), whole or as the API's stream of typed events.

The server keeps no responses: `previous_response_id` is refused (send the conversation as
`input`, with earlier `function_call` and `function_call_output` items), and `store` changes
nothing. A reasoning item sent back in `input` is the `reasoning_content` of the assistant turn
after it (the chat template decides what of it to keep).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from .api_error import ApiError
from .completion import Completion, reasoning_tokens, usage
from .reasoning import Reasoning
from .tools import ToolCall

#: Responses fields that are the chat's under another name, or the Responses API's own.
RENAMED = {"max_output_tokens": "max_completion_tokens"}
OWN = {"input", "instructions", "tools", "tool_choice", "text", "previous_response_id", "store", "truncation",
       "reasoning", "include", "stream_options", "prompt_cache_key", "safety_identifier"}  # fmt: skip
#: Chat fields a Responses request may carry as they are (vLLM's and kvcache's extensions included).
PASSED = {"model", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stream", "metadata", "user",
          "parallel_tool_calls", "service_tier", "presence_penalty", "frequency_penalty", "repetition_penalty",
          "logit_bias",
          "chat_template_kwargs"}  # fmt: skip
#: What the Response object reports of its request (as given, or OpenAI's defaults).
REPORTED = {"instructions": None, "max_output_tokens": None, "temperature": 1.0, "top_p": 1.0, "tool_choice": "auto",
            "parallel_tool_calls": True, "metadata": {}, "text": {"format": {"type": "text"}}, "truncation": "disabled",
            "previous_response_id": None, "reasoning": None, "store": False}  # fmt: skip


def chat_body(body: dict[str, Any]) -> dict[str, Any]:
    """The chat completions request that a Responses request `body` asks for."""
    unknown = sorted(set(body) - OWN - PASSED - set(RENAMED))
    if unknown:
        raise ApiError(400, f"unrecognized request argument(s): {', '.join(unknown)}", param=unknown[0])
    if body.get("previous_response_id") is not None:
        raise ApiError(400, "this server keeps no responses: send the conversation as input instead of "
                       "previous_response_id", param="previous_response_id")  # fmt: skip
    if body.get("truncation") not in (None, "disabled"):
        raise ApiError(400, f"truncation={body['truncation']!r} is not supported by this server", param="truncation")
    chat = {key: value for key, value in body.items() if key in PASSED}
    chat.update({RENAMED[key]: value for key, value in body.items() if key in RENAMED})
    chat["messages"] = _messages(body.get("input"), body.get("instructions"))
    if body.get("tools") is not None:
        chat["tools"] = _tools(body["tools"])
    if body.get("text") is not None:
        chat["response_format"] = _response_format(body["text"])
    reasoning = body.get("reasoning")
    if reasoning is not None and not isinstance(reasoning, dict):
        raise ApiError(400, f"reasoning must be an object, got {reasoning!r}"[:300], param="reasoning")
    if reasoning and reasoning.get("effort") is not None:  # (the chat's reasoning_effort; summary: ignored)
        chat["reasoning_effort"] = reasoning["effort"]
    choice = body.get("tool_choice")
    if isinstance(choice, dict) and choice.get("type") == "function" and set(choice) == {"type", "name"}:
        choice = {"type": "function", "function": {"name": choice["name"]}}  # the Responses API's form, flat
    if choice is not None:
        chat["tool_choice"] = choice
    return chat


def _response_format(text: Any) -> dict[str, Any]:
    """The chat's `response_format` for a Responses `text` (`{"format": {"type": "json_schema",
    "name", "schema", ...}}` flat, where the chat nests the schema under `json_schema`)."""
    form = text.get("format") if isinstance(text, dict) and set(text) <= {"format", "verbosity"} else None
    if not isinstance(form, dict) or text.get("verbosity") not in (None, "medium"):
        raise ApiError(400, f'text must be {{"format": {{"type": ...}}}}, got {text!r}'[:300], param="text")
    if form.get("type") == "json_schema":
        return {"type": "json_schema", "json_schema": {k: v for k, v in form.items() if k != "type"}}
    return form


def _messages(given: Any, instructions: Any) -> list[dict[str, Any]]:
    if instructions is not None and not isinstance(instructions, str):
        raise ApiError(400, "instructions must be a string", param="instructions")
    head = [] if instructions is None else [{"role": "system", "content": instructions}]
    if isinstance(given, str):
        return [*head, {"role": "user", "content": given}]
    if not isinstance(given, list) or not given:
        raise ApiError(400, "input must be a string or a non-empty list of input items", param="input")
    out, thought = head, None  # thought: a reasoning item's text, for the assistant turn it comes before
    for i, item in enumerate(given):
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "reasoning":
            thought = _text(i, item.get("content") or item.get("summary") or "")
            continue
        if kind == "message" and isinstance(item.get("content"), (str, list)):
            out.append({"role": item.get("role"), "content": _text(i, item["content"])})
        elif kind == "function_call" and all(isinstance(item.get(k), str) for k in ("call_id", "name", "arguments")):
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}  # fmt: skip
            if out and out[-1]["role"] == "assistant" and thought is None:
                out[-1].setdefault("tool_calls", []).append(call)  # calls after the text they follow
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output" and isinstance(item.get("call_id"), str):
            output = item.get("output")
            out.append({"role": "tool", "tool_call_id": item["call_id"],
                        "content": output if isinstance(output, str) else _text(i, output)})  # fmt: skip
        else:
            raise ApiError(400, f"input[{i}] must be a message, a function_call (call_id, name, arguments), a "
                           "function_call_output (call_id, output) or a reasoning item",
                           param=f"input[{i}]")  # fmt: skip
        if thought and out[-1]["role"] == "assistant":  # (the chat template decides what of it to keep)
            out[-1]["reasoning_content"] = thought
        thought = None
    return out


def _text(i: int, content: Any) -> str:
    """A message's text: a string, or its text parts (`input_text`, `output_text`; a reasoning
    item's `reasoning_text` or `summary_text`) joined."""
    if isinstance(content, str):
        return content
    kinds = ("input_text", "output_text", "text", "reasoning_text", "summary_text")
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") in kinds
                                         and isinstance(p.get("text"), str) for p in content):  # fmt: skip
        return "".join(p["text"] for p in content)
    raise ApiError(400, f"input[{i}].content must be a string or a list of text parts", param=f"input[{i}].content")


def _tools(tools: Any) -> Any:
    """Function tools as the Responses API writes them (flat) in the chat's shape (nested)."""
    if not isinstance(tools, list):
        return tools  # (the chat's check names what is wrong)
    flat = ("name", "description", "parameters", "strict")
    return [{"type": "function", "function": {k: t[k] for k in flat if k in t}}
            if isinstance(t, dict) and t.get("type") == "function" and "function" not in t else t
            for t in tools]  # fmt: skip


def renamed(err: ApiError) -> ApiError:
    """A chat request's error named by the Responses request's fields."""
    param = err.param or ""
    if param.startswith("messages"):
        err.param, err.message = "input", err.message.replace("messages", "input (as messages)")
    elif param == "max_completion_tokens":
        err.param, err.message = "max_output_tokens", err.message.replace("max_completion_tokens", "max_output_tokens")
    elif param.startswith("response_format"):
        err.param, err.message = "text", err.message.replace("response_format.json_schema", "text.format")
        err.message = err.message.replace("response_format", "text")
    elif param.startswith("tools[") and ".function" in param:
        err.param = param.replace(".function", "")
        err.message = err.message.replace(".function", "")
    return err


class ResponseShape:
    """The Response object of one answer: its id, the request's reported settings, and its items."""

    def __init__(self, body: dict[str, Any], model: str, sampling: dict[str, Any] | None = None) -> None:
        """`sampling`: the served model's sampling defaults (`Limits.sampling`), reported where the
        request leaves a setting out."""
        self.id, self.created, self.model = f"resp_{uuid.uuid4().hex}", int(time.time()), model
        defaults = {**REPORTED, **{k: v for k, v in (sampling or {}).items() if k in REPORTED}}
        self.reported = {key: default if body.get(key) is None else body[key] for key, default in defaults.items()}
        self.reported["tools"] = body.get("tools") or []
        self.reported["metadata"] = body.get("metadata") or {}

    def shaped(self, status: str, output: list[dict[str, Any]], choice: Completion | None = None) -> dict[str, Any]:
        out = {"id": self.id, "object": "response", "created_at": self.created, "status": status, "model": self.model,
               "output": output, "error": None, "incomplete_details": None, "usage": None, **self.reported}  # fmt: skip
        if status == "incomplete":
            out["incomplete_details"] = {"reason": "max_output_tokens"}
        if choice is not None:
            counted = usage([choice])
            cached = counted["prompt_tokens_details"]["cached_tokens"]
            out["usage"] = {"input_tokens": counted["prompt_tokens"], "output_tokens": counted["completion_tokens"],
                            "total_tokens": counted["total_tokens"], "input_tokens_details": {"cached_tokens": cached},
                            "output_tokens_details": {"reasoning_tokens": reasoning_tokens(choice)}}  # fmt: skip
        return out


def items(parts: list[str | Reasoning | ToolCall], status: str = "completed") -> list[dict[str, Any]]:
    """An answer's output items from its read parts: the reasoning, the message, each call."""
    thought = "".join(p for p in parts if isinstance(p, Reasoning))
    text = "".join(p for p in parts if type(p) is str)
    calls = [p for p in parts if isinstance(p, ToolCall)]
    out = [reasoning_item(thought, status)] if thought else []
    if text or not calls:
        out.append(message_item(text, status))
    return out + [call_item(call, status) for call in calls]


def reasoning_item(text: str, status: str, item_id: str | None = None) -> dict[str, Any]:
    return {"type": "reasoning", "id": item_id or f"rs_{uuid.uuid4().hex}", "summary": [], "status": status,
            "content": [{"type": "reasoning_text", "text": text}]}  # fmt: skip


def message_item(text: str, status: str, item_id: str | None = None) -> dict[str, Any]:
    return {"type": "message", "id": item_id or f"msg_{uuid.uuid4().hex}", "role": "assistant", "status": status,
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}  # fmt: skip


def call_item(call: ToolCall, status: str) -> dict[str, Any]:
    shaped = call.shaped()
    return {"type": "function_call", "id": f"fc_{uuid.uuid4().hex}", "call_id": shaped["id"], "name": call.name,
            "arguments": call.arguments, "status": status}  # fmt: skip


async def whole(choice: Completion, shape: ResponseShape) -> dict[str, Any]:
    text = "".join([piece async for piece in choice.deltas()])
    status = "incomplete" if choice.finish_reason == "length" else "completed"
    return shape.shaped(status, items(choice.read(text, end=True), status), choice)


async def events(choice: Completion, shape: ResponseShape) -> AsyncIterator[str]:
    """The Responses stream of one answer: typed events, each with its `sequence_number`."""
    sequence = 0
    output: list[dict[str, Any]] = []
    open_item: dict[str, Any] | None = None  # the reasoning or message item text is streamed into

    def event(kind: str, **fields: Any) -> str:
        nonlocal sequence
        sequence += 1
        return f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': sequence - 1, **fields})}\n\n"

    def close() -> list[str]:
        nonlocal open_item
        if open_item is None:
            return []
        item, open_item = open_item, None
        item["status"] = "completed"
        index, part = len(output), item["content"][0]
        output.append(item)
        kind = "reasoning_text" if item["type"] == "reasoning" else "output_text"
        done = [event(f"response.{kind}.done", item_id=item["id"], output_index=index, content_index=0,
                      text=part["text"], **({"logprobs": []} if kind == "output_text" else {}))]  # fmt: skip
        done.append(event("response.content_part.done", item_id=item["id"], output_index=index, content_index=0,
                          part=part))  # fmt: skip
        return [*done, event("response.output_item.done", output_index=index, item=item)]

    def put(part: str | Reasoning | ToolCall) -> list[str]:
        nonlocal open_item
        if isinstance(part, ToolCall):  # a call comes whole: its item opens, its arguments come, it closes
            item, lines = call_item(part, "completed"), close()
            index, begun = len(output), {**item, "arguments": "", "status": "in_progress"}
            lines += [event("response.output_item.added", output_index=index, item=begun),
                      event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                            delta=item["arguments"]),
                      event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                            arguments=item["arguments"], name=item["name"]),
                      event("response.output_item.done", output_index=index, item=item)]  # fmt: skip
            output.append(item)
            return lines
        kind = "reasoning" if isinstance(part, Reasoning) else "message"
        lines = []
        if open_item is None or open_item["type"] != kind:
            lines += close()
            open_item = (reasoning_item if kind == "reasoning" else message_item)("", "in_progress")
            empty = {**open_item, "content": []}
            lines.append(event("response.output_item.added", output_index=len(output), item=empty))
            lines.append(event("response.content_part.added", item_id=open_item["id"], output_index=len(output),
                               content_index=0, part=dict(open_item["content"][0])))  # fmt: skip
        open_item["content"][0]["text"] += str(part)
        text_kind = "reasoning_text" if kind == "reasoning" else "output_text"
        extra = {"logprobs": []} if kind == "message" else {}
        lines.append(event(f"response.{text_kind}.delta", item_id=open_item["id"], output_index=len(output),
                           content_index=0, delta=str(part), **extra))  # fmt: skip
        return lines

    yield event("response.created", response=shape.shaped("in_progress", []))
    yield event("response.in_progress", response=shape.shaped("in_progress", []))
    try:
        async for piece in choice.deltas():
            for part in choice.read(piece):
                for line in put(part):
                    yield line
        for part in choice.read("", end=True):
            for line in put(part):
                yield line
    except ApiError as err:
        yield event("error", code=err.code or "server_error", message=err.message, param=err.param)
        return
    if not output and open_item is None:  # nothing said: an empty message, as whole answers have
        for line in put(""):
            yield line
    for line in close():
        yield line
    status = "incomplete" if choice.finish_reason == "length" else "completed"
    yield event(f"response.{status}", response=shape.shaped(status, output, choice))
