"""Tool calls in chat completions: the `tools` a request offers and the tool turns of its
conversation, checked and shaped for the model's chat template; and the calls the model writes,
read out of its text, whole or while it streams.

The calls are read in the formats of Qwen's and Hermes' chat templates, the ones most open
models with tool use are trained on: each call between `<tool_call>` and `</tool_call>`, as a JSON
object `{"name": ..., "arguments": {...}}` (Qwen 3, Hermes) or as `<function=...>` markup with
one `<parameter=...>` per argument (Qwen 3.5, Qwen3-Coder; its values typed by the offered tool's
schema: `call_formats`). Llama 3.1-3.3's templates ask instead for an answer that is nothing but
a JSON object `{"name": ..., "parameters": {...}}` (no tags; `BareCallReader`), Gemma 4's for
`call:NAME{...}` between its `<|tool_call>` and `<tool_call|>` tokens (`gemma_calls`), and LFM2's
for a Python list of calls between `<|tool_call_start|>` and `<|tool_call_end|>`
(`pythonic_calls`), and Mistral's for what follows `[TOOL_CALLS]` (`mistral_calls`). A model is served
with tools when its chat template writes the tools and asks for one of these; other models refuse
`tools` with a 400 rather than answer with calls no one reads. A forced `tool_choice` ("required",
a named function) puts the start of a call at the end of the prompt (`call_opening`), read as the
answer's start: the model writes the rest. Text between tagged calls is the
message's content (whitespace next to a call is the template's layout, not content); a region
that does not hold a call, or that the answer ended inside, stays content, as the model wrote it.
"""

from __future__ import annotations

import json
import re
from typing import Any, Protocol

from .api_error import ApiError
from .call_formats import ToolCall, arguments_object, parameter_types, read_call
from .gemma_calls import CLOSE as GEMMA_CLOSE
from .gemma_calls import OPEN as GEMMA_OPEN
from .gemma_calls import read_gemma_call
from .mistral_calls import ARGS as MISTRAL_ARGS
from .mistral_calls import OPEN as MISTRAL_OPEN
from .mistral_calls import MistralCallReader
from .pythonic_calls import CLOSE as PYTHONIC_CLOSE
from .pythonic_calls import OPEN as PYTHONIC_OPEN
from .pythonic_calls import TOOL_LIST, read_pythonic_calls
from .tags import until_tag

OPEN, CLOSE = "<tool_call>", "</tool_call>"
#: What Llama 3.1-3.3's chat templates say when they ask for a bare JSON call.
BARE = '"parameters": dictionary of argument name and its value'
#: The most tools one request may offer (OpenAI's limit).
MAX_TOOLS = 128
#: What OpenAI allows as a function's name.
NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


def tools_refused(served: Any) -> str | None:
    """Why `served` (a `TextModel`) cannot be served with tools, None when it can: its chat template
    must write the request's tools and ask for calls between `<tool_call>` tags (which its tokenizer
    must decode as text) or for bare JSON calls."""
    tokenizer = served.tokenizer
    template = None if served.kind == "bundled" else getattr(tokenizer, "chat_template", None)
    if not isinstance(template, str) or "tools" not in template or not any(
            tag in template for tag in (OPEN, BARE, GEMMA_OPEN, PYTHONIC_OPEN, TOOL_LIST, MISTRAL_OPEN)):  # fmt: skip
        return ("the served model's chat template does not write tools in a format this server reads "
                f"({OPEN} JSON or <function=...> markup {CLOSE}, as Qwen's and Hermes' templates ask for, "
                f"Llama 3's bare JSON, Gemma 4's {GEMMA_OPEN}call:...{GEMMA_CLOSE}, LFM2's "
                f"{PYTHONIC_OPEN}[f(...)]{PYTHONIC_CLOSE}, or Mistral's {MISTRAL_OPEN})")  # fmt: skip
    if any(tag in template for tag in (GEMMA_OPEN, PYTHONIC_OPEN, TOOL_LIST, MISTRAL_OPEN)):  # tags the text keeps
        return None
    if OPEN in template and OPEN in getattr(tokenizer, "all_special_tokens", ()):
        return f"the served model's tokenizer drops {OPEN} from decoded text (a special token)"
    return None


def bare_calls(served: Any) -> bool:
    """Whether `served`'s template asks for bare JSON calls (Llama 3's) rather than tagged ones."""
    template = getattr(served.tokenizer, "chat_template", None)
    return isinstance(template, str) and BARE in template and OPEN not in template


def check_tools(body: dict[str, Any]) -> list[dict[str, Any]] | None:
    """The request's `tools` as the chat template takes them (OpenAI's function tools), or None when
    it offers none or `tool_choice` is "none" (`forced_tool` reads a forced choice)."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if body.get("parallel_tool_calls") not in (None, True):
        raise ApiError(400, "parallel_tool_calls=false is not supported by this server", param="parallel_tool_calls")
    if tools is None or tools == []:
        if choice not in (None, "none"):
            raise ApiError(400, f"tool_choice={choice!r} needs tools", param="tool_choice")
        return None
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise ApiError(400, f"tools must be a list of at most {MAX_TOOLS} tools", param="tools")
    shaped, names = [], set()
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(function, dict):
            raise ApiError(400, f'tools[{i}] must be {{"type": "function", "function": {{...}}}}', param=f"tools[{i}]")
        name = function.get("name")
        if not isinstance(name, str) or not NAME.fullmatch(name) or name in names:
            raise ApiError(400, f"tools[{i}].function.name must be a new name of 1 to 64 letters, digits, _ or -, "
                           f"got {name!r}", param=f"tools[{i}].function.name")  # fmt: skip
        names.add(name)
        unknown = sorted(set(function) - {"name", "description", "parameters", "strict"})
        if unknown:
            raise ApiError(400, f"tools[{i}].function has unknown field(s): {', '.join(unknown)}",
                           param=f"tools[{i}].function")  # fmt: skip
        if not isinstance(function.get("description", ""), str):
            raise ApiError(400, f"tools[{i}].function.description must be a string", param=f"tools[{i}].function")
        if not isinstance(function.get("parameters", {}), dict):
            raise ApiError(400, f"tools[{i}].function.parameters must be a JSON Schema object",
                           param=f"tools[{i}].function.parameters")  # fmt: skip
        shaped.append({"type": "function", "function": {k: v for k, v in function.items() if k != "strict"}})
    forced_tool(body, shaped)
    return None if choice == "none" else shaped


def forced_tool(body: dict[str, Any], tools: list[dict[str, Any]] | None) -> str | None:
    """What `tool_choice` forces: None (the model chooses: "auto", the default, or "none"), "" (a
    call to any tool: "required") or the name of the function to call (`{"type": "function",
    "function": {"name": ...}}`, a tool of `tools`)."""
    choice = body.get("tool_choice")
    if choice in (None, "auto", "none"):
        return None
    if choice == "required":
        return ""
    function = choice.get("function") if isinstance(choice, dict) and choice.get("type") == "function" else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str) or set(choice) != {"type", "function"} or set(function) != {"name"}:  # type: ignore[arg-type]
        raise ApiError(400, 'tool_choice must be "auto", "none", "required" or {"type": "function", "function": '
                       f'{{"name": ...}}}}, got {choice!r}'[:300], param="tool_choice")  # fmt: skip
    if name not in [tool["function"]["name"] for tool in tools or []]:
        raise ApiError(400, f"tool_choice names {name!r}, which is not one of the tools", param="tool_choice")
    return name


def call_style(served: Any) -> str:
    """How `served`'s template writes a call: "json" (Qwen/Hermes, between tags), "markup" (Qwen 3.5,
    between tags), "bare" (Llama 3), "gemma" (Gemma 4), "pythonic" (LFM2), "mistral" (Mistral's v3
    templates: a JSON list) or "mistral-args" (v11 and later: `NAME[ARGS]{...}`)."""
    template = str(getattr(served.tokenizer, "chat_template", ""))
    if MISTRAL_OPEN in template:
        return "mistral-args" if MISTRAL_ARGS in template else "mistral"
    if GEMMA_OPEN in template:
        return "gemma"
    if PYTHONIC_OPEN in template or TOOL_LIST in template:
        return "pythonic"
    if bare_calls(served):
        return "bare"
    return "markup" if "<function=" in template else "json"


#: vLLM's `--tool-call-parser` names of the call formats this server reads (`call_style`'s styles).
PARSERS = {"hermes": "json", "qwen3_xml": "markup", "qwen3_coder": "markup", "llama3_json": "bare",
           "llama4_json": "bare", "pythonic": "pythonic", "llama4_pythonic": "pythonic", "lfm2": "pythonic",
           "mistral": "mistral", "gemma4": "gemma"}  # fmt: skip


def parser_refused(served: Any, parser: str) -> str | None:
    """Why vLLM's `--tool-call-parser parser` does not fit `served` (None: it does). The server reads
    calls in the format the model's template asks for; the flag, taken so that vLLM's command lines
    run, must name that format."""
    if parser not in PARSERS:
        return (f"--tool-call-parser {parser}: not a call format this server reads (it reads "
                f"{', '.join(sorted(PARSERS))})")  # fmt: skip
    refused = tools_refused(served)
    if refused:
        return f"--tool-call-parser {parser}: {refused}"
    found = call_style(served).replace("mistral-args", "mistral")
    if PARSERS[parser] != found:
        names = " or ".join(sorted(name for name, style in PARSERS.items() if style == found))
        return (f"--tool-call-parser {parser}: the model's chat template writes calls in another format "
                f"({names}), which the server reads as the template asks; leave the flag out or name that one")
    return None


def call_opening(style: str, name: str) -> str:
    """The start of a call to `name` ("": to a tool the model picks) written in `style`: what a
    forced `tool_choice` puts at the start of the answer, so that the model goes on with the call.
    It stops before a space or the name's end, where the model's own tokens may join what follows."""
    if style == "bare":
        return '{"name":' + (f' {json.dumps(name)}, "parameters":' if name else "")
    if style == "gemma":
        return f"{GEMMA_OPEN}call:" + (f"{name}{{" if name else "")
    if style == "pythonic":
        return f"{PYTHONIC_OPEN}[" + (f"{name}(" if name else "")
    if style == "mistral-args":
        return MISTRAL_OPEN + (f"{name}{MISTRAL_ARGS}" if name else "")
    if style == "mistral":
        return f'{MISTRAL_OPEN} [{{"name":' + (f' {json.dumps(name)}, "arguments":' if name else "")
    if style == "markup":
        return f"{OPEN}\n<function=" + (f"{name}>\n" if name else "")
    return f'{OPEN}\n{{"name":' + (f' {json.dumps(name)}, "arguments":' if name else "")


def assistant_calls(i: int, calls: Any) -> list[dict[str, Any]]:
    """An assistant message's `tool_calls` (OpenAI's: arguments as JSON text) as chat templates take
    them: arguments as an object (a template writes them with `tojson`)."""
    where = f"messages[{i}].tool_calls"
    if not isinstance(calls, list) or not calls:
        raise ApiError(400, f"{where} must be a non-empty list", param=where)
    shaped = []
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(function, dict) or call.get("type", "function") != "function" or not isinstance(name, str):
            raise ApiError(400, f'{where}[{j}] must be {{"type": "function", "function": {{"name", "arguments"}}}}',
                           param=f"{where}[{j}]")  # fmt: skip
        arguments = arguments_object(function.get("arguments", "{}"))
        if arguments is None:
            raise ApiError(400, f"{where}[{j}].function.arguments must be a JSON object (as text)",
                           param=f"{where}[{j}].function.arguments")  # fmt: skip
        shaped.append({"id": str(call.get("id", "")), "type": "function",
                       "function": {"name": name, "arguments": arguments}})  # fmt: skip
    return shaped


class ToolCallReader:
    """A chat answer's text, fed piece by piece, as content pieces and `ToolCall`s in order: what
    it gives for any split of the text is what it gives for the whole (held back: text that may yet
    open a call, and a call until it closes). `tools`: the offered tools (`check_tools`'), whose
    schemas type the values of calls written as markup; `style`: "json" or "markup" (read alike:
    `call_formats`), "gemma" (Gemma 4's tags and syntax, `gemma_calls`) or "pythonic" (LFM2's
    tags around a list of calls, `pythonic_calls`)."""

    def __init__(self, tools: list[dict[str, Any]] | None = None, style: str = "json") -> None:
        self._types = parameter_types(tools)
        self._open, self._close = {"gemma": (GEMMA_OPEN, GEMMA_CLOSE),
                                   "pythonic": (PYTHONIC_OPEN, PYTHONIC_CLOSE)}.get(style, (OPEN, CLOSE))  # fmt: skip
        self._read = {"gemma": lambda body: _listed(read_gemma_call(body)), "pythonic": read_pythonic_calls}.get(
            style, lambda body: _listed(read_call(body, self._types)))  # fmt: skip
        self._held = ""
        self._inside = False  # between OPEN and its CLOSE
        self._after_call = False  # the whitespace that follows a call is layout
        self.calls = 0

    def feed(self, text: str) -> list[str | ToolCall]:
        self._held += text
        out: list[str | ToolCall] = []
        while True:
            if self._inside:
                at = self._held.find(self._close)
                if at < 0:
                    return out
                body, self._held, self._inside = self._held[:at], self._held[at + len(self._close) :], False
                calls = self._read(body)
                if calls is None:
                    self._content(out, self._open + body + self._close)
                else:
                    out += calls
                    self.calls += len(calls)
                    self._after_call = True
                continue
            ready, self._held, self._inside = until_tag(self._held, self._open)
            self._content(out, ready)
            if not self._inside:
                return out

    def finish(self) -> list[str | ToolCall]:
        """What is still held once the answer ended: text (a call never closed stays text)."""
        rest, self._held = (self._open if self._inside else "") + self._held, ""
        self._inside = False
        out: list[str | ToolCall] = []
        self._content(out, rest)
        return out

    def _content(self, out: list[str | ToolCall], text: str) -> None:
        if self._after_call:
            text = text.lstrip()
            self._after_call = not text
        if text:
            out.append(text)


class CallReader(Protocol):
    """What reads an answer's calls out of its text (`ToolCallReader`, `BareCallReader`,
    `mistral_calls.MistralCallReader`): content pieces and calls in order, piece by piece."""

    calls: int

    def feed(self, text: str) -> list[str | ToolCall]: ...

    def finish(self) -> list[str | ToolCall]: ...


def call_reader(style: str, tools: list[dict[str, Any]] | None) -> CallReader:
    """The reader of the calls a model writes in `style` (`call_style`), `tools` offered."""
    if style == "bare":
        return BareCallReader()
    if style in ("mistral", "mistral-args"):
        return MistralCallReader()
    return ToolCallReader(tools, style)


def _listed(call: ToolCall | None) -> list[ToolCall] | None:
    return None if call is None else [call]


class BareCallReader:
    """A chat answer read as Llama 3's templates ask a call to be written: the whole answer one
    JSON object `{"name": ..., "parameters": {...}}`, or several separated by `;`. An answer that
    starts (after whitespace) with `{` is held until it ends, then read: calls if it is nothing but
    calls, else content as written; any other answer is content, passed on as it comes. The same
    interface as `ToolCallReader`."""

    def __init__(self) -> None:
        self._held, self._holding = "", True
        self.calls = 0

    def feed(self, text: str) -> list[str | ToolCall]:
        if not self._holding:
            return [text] if text else []
        self._held += text
        bare = self._held.lstrip()
        if not bare or bare.startswith("{"):
            return []
        self._holding, held, self._held = False, self._held, ""
        return [held]

    def finish(self) -> list[str | ToolCall]:
        held, self._held = self._held, ""
        calls = _bare_calls(held) if held.strip() else None
        if calls is None:
            return [held] if held else []
        self.calls += len(calls)
        return list(calls)


def _bare_calls(text: str) -> list[ToolCall] | None:
    """The calls `text` holds as JSON objects separated by whitespace or `;`, None if it holds anything else."""
    decoder, calls, at = json.JSONDecoder(), [], 0
    while True:
        at = len(text) - len(text[at:].lstrip(" \t\r\n;")) if calls else len(text) - len(text[at:].lstrip())
        if at == len(text):
            return calls or None
        try:
            _, end = decoder.raw_decode(text, at)
        except ValueError:
            return None
        call = read_call(text[at:end], {})
        if call is None:
            return None
        calls.append(call)
        at = end
