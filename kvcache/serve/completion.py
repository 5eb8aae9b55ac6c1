"""The choices of an answer (`n` per prompt; a completion may send several prompts): each
request's tokens turned into text, stop strings applied (the text that could still become one is
held back while streaming), and the answer assembled whole or streamed as OpenAI sends it. A
client that disconnects cancels every row of its answer; a failed row ends the answer.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request as HttpRequest

from ..generation.detokenize import Detokenizer
from ..generation.prediction import prediction_usage
from .engine import Request
from .events import asyncio_sink
from .logprobs import TokenLogprobs, chat_logprobs, completion_logprobs, echoed_logprobs, joined
from .reasoning import THINK, UNTHINK, Reasoning, ReasoningReader
from .schema import ApiError
from .served import ServedModel
from .tools import CallReader, ToolCall, call_reader

#: How often a non-streamed answer checks whether its client is still there (seconds).
DISCONNECT_POLL_S = 0.1


class Completion:
    """One choice: its request's tokens turned into text as they arrive, stop strings applied.
    `index`: the choice's place in the answer; `counts_prompt`: whether its prompt counts in the
    answer's usage (the first of the `n` choices of a prompt); `echo`: the prompt's text, which the
    completion's text starts with (its tokens' log probabilities come first too, when asked). A chat
answer is read for `tools` calls (the offered tools, None: none) and for `reasoning` (None: not
read; else whether the prompt left the model thinking, `reasoning.opened_in`, with `reasoning_tags`);
`call_style`: how the model writes calls (`tools.call_style`, read by `tools.call_reader`'s reader);
`opening`: the answer's start that the
prompt already holds (a forced call's, `tools.call_opening`), read as the answer's but not counted
as its tokens; `closing`: what the answer's grammar left for the template to write once it ended
(the grammar's end, not a stop string's), read as the answer's end (a forced call's closing tag).
A stop string ends the answer only where it ends past the text of its request's first
`min_tokens` tokens (as vLLM reads them), and stays in the text with `include_stop`."""

    def __init__(self, served: ServedModel, engine: Any, request: Request, stops: list[str], *,
                 chat: bool = False, index: int = 0, counts_prompt: bool = True,
                 echo: str | None = None, tools: list[dict[str, Any]] | None = None,
                 reasoning: bool | None = None, reasoning_tags: tuple[str, str] | None = None,
                 call_style: str | None = "json", opening: str = "",
                 closing: str = "", include_stop: bool = False) -> None:  # fmt: skip
        self.served, self.engine, self.request, self.stops, self.chat = served, engine, request, stops, chat
        self.index, self.counts_prompt, self.echo = index, counts_prompt, echo
        self.include_stop = include_stop
        #: vLLM's `stop_reason`: the stop string or stop token id the answer ended on (None: neither)
        self.stop_reason: str | int | None = None
        self.prompt_logprobs: list[TokenLogprobs] | None = None  # the engine's "prompt" event, when asked
        self.queue: asyncio.Queue = asyncio.Queue()
        request.on_event = asyncio_sink(asyncio.get_running_loop(), self.queue)
        self.finish_reason: str | None = None
        self.text = ""
        self.tokens: list[int] = []  # as the events brought them: the engine may be a step ahead
        self.logprobs: list[TokenLogprobs] = []  # the tokens' log probabilities, when the request asked
        self._offset = (0, len(echo or ""))  # (tokens shaped so far, where their text ends), for text_offset
        self.detokenizer = Detokenizer(served.decode, served.token_bytes)
        # a chat offered tools: its text may hold calls
        self.calls: CallReader | None = None if tools is None else call_reader(call_style or "json", tools)
        self.reasoning = None if reasoning is None else ReasoningReader(reasoning, reasoning_tags or (THINK, UNTHINK))
        self._opening, self._closing = opening, closing  # (read with the first text, and at a grammar's end)

    def read(self, text: str, end: bool = False) -> list[str | Reasoning | ToolCall]:
        """A chat answer's next text as what the message shows: content, `Reasoning` and `ToolCall`
        pieces in order (`end`: the answer ended, nothing is held back any more)."""
        text, self._opening = self._opening + text, ""
        if end and self.finish_reason == "stop":
            text += self._closing
        parts = [text] if self.reasoning is None else self.reasoning.feed(text)
        if end and self.reasoning is not None:
            parts += self.reasoning.finish()
        out: list[str | Reasoning | ToolCall] = []
        for part in parts:  # calls are read out of the content, not out of the reasoning
            out += [part] if self.calls is None or isinstance(part, Reasoning) else self.calls.feed(part)
        if end and self.calls is not None:
            out += self.calls.finish()
        return [part for part in out if not isinstance(part, str) or part]

    def _take(self, value: int | TokenLogprobs) -> int:
        """A token event's token (and its log probabilities, kept)."""
        if isinstance(value, TokenLogprobs):
            self.logprobs.append(value)
            return value.token
        return value

    async def deltas(self) -> AsyncIterator[str]:
        """The new text after each token (possibly empty pieces are skipped); `finish_reason` is
        set when it ends."""
        holdback = max((len(s) for s in self.stops), default=1) - 1
        sent = 0
        # where the text past the first min_tokens tokens starts (None: not yet there)
        floor, text = (0 if self.request.min_tokens == 0 else None), ""
        try:
            while True:
                kind, value = await self.queue.get()
                if kind == "prompt":  # (before any token)
                    self.prompt_logprobs = value
                    continue
                fresh = []
                # tokens that came together make one piece (a stop string is looked for token by token)
                while kind == "token" and not self.stops and not self.queue.empty():
                    fresh.append(self._take(value))
                    kind, value = self.queue.get_nowait()
                self.tokens += fresh
                if kind == "error":
                    raise ApiError(500, f"generation failed: {value}")
                if kind == "unavailable":
                    raise ApiError(503, str(value))
                if kind == "done":
                    self.finish_reason = "stop" if value == "stop" else "length" if value == "length" else value
                    if value == "stop" and self.tokens and self.tokens[-1] in self.request.stop_ids:
                        self.stop_reason = self.tokens[-1]
                    self.detokenizer.add(fresh)
                    self.text = self.detokenizer.finish()
                    if sent < len(self.text):
                        yield self.text[sent:]
                    return
                token = self._take(value)
                self.tokens.append(token)
                shown = text if floor is None else ""  # (the text before this token, while it may matter)
                text = self.detokenizer.add([*fresh, token])
                if floor is None and len(self.tokens) > self.request.min_tokens:
                    floor = len(shown)  # the first min_tokens tokens' text: no stop string ends in it
                found = [] if floor is None else [
                    (i, -len(s), s) for s in self.stops
                    if (i := text.find(s, max(0, sent - len(s), floor - len(s) + 1))) >= 0]  # fmt: skip
                if found:  # (a held call cut here is not complete: its closing tag is not added)
                    cut, _, stop = min(found)
                    self.stop_reason = stop
                    if self.include_stop:
                        cut += len(stop)
                    self.text, self.finish_reason, self._closing = text[:cut], "stop", ""
                    self.engine.finish_early(self.request)
                    if sent < cut:
                        yield text[sent:cut]
                    return
                safe = len(text) - holdback  # (the detokenizer holds a character still cut in two)
                if safe > sent:
                    yield text[sent:safe]
                    sent = safe
        finally:
            if self.finish_reason is None:
                self.request.cancel()  # the client went away (or the stream was closed): the row leaves

    def shown_finish_reason(self) -> str | None:
        """The answer's `finish_reason`: "tool_calls" where it stopped after calling tools."""
        if self.calls is not None and self.calls.calls and self.finish_reason == "stop":
            return "tool_calls"
        return self.finish_reason

    def logprobs_since(self, start: int) -> dict[str, Any]:
        """The `logprobs` object (chat's or completions') of the completion's tokens from `start` on:
        the tokens `usage` counts (to a stop string's last token)."""
        given = self.logprobs[start : len(self.tokens)]
        if self.request.logprobs is None or len(given) < len(self.tokens) - start:
            raise ApiError(500, "the engine sent no log probabilities for a token")
        if self.chat:
            return chat_logprobs(given, self.served.decode)
        done, offset = self._offset  # where the previous call's tokens ended: a stream asks in order
        if done != start:
            offset = len(self.echo or "") + sum(len(self.served.decode([t])) for t in self.tokens[:start])
        shaped = completion_logprobs(given, self.served.decode, offset)
        self._offset = (len(self.tokens), offset + sum(map(len, shaped["tokens"])))
        return shaped

    def echoed(self) -> dict[str, Any] | None:
        """The echoed prompt's `logprobs` object (None when not asked for)."""
        if self.request.prompt_logprobs is None:
            return None
        if self.prompt_logprobs is None:
            raise ApiError(500, "the engine sent no log probabilities for the prompt")
        return echoed_logprobs(self.request.prompt, self.prompt_logprobs, self.served.decode)

    async def scored(self) -> None:
        """Wait for the prompt's log probabilities (a stream sends them first; the engine sends
        them before any token), raising the request's failure instead if it ends without them."""
        if self.request.prompt_logprobs is None or self.prompt_logprobs is not None:
            return
        kind, value = await self.queue.get()
        if kind == "prompt":
            self.prompt_logprobs = value
            return
        self.finish_reason = "cancelled"  # (`deltas` is not called after this)
        raise ApiError(503 if kind == "unavailable" else 500, f"generation failed: {value}")


def usage(choices: list[Completion]) -> dict[str, Any]:
    """OpenAI's usage of an answer: each prompt once, every choice's tokens up to where it ended
    (a stop string's last token included), not the ones the engine decoded before it heard of
    the stop."""
    prompt = sum(len(c.request.prompt) for c in choices if c.counts_prompt)
    completion = sum(len(c.tokens) for c in choices)
    cached = sum(c.request.cached_tokens for c in choices if c.counts_prompt)
    out = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
           "prompt_tokens_details": {"cached_tokens": cached}}  # fmt: skip
    details: dict[str, int] = {}
    if any(c.reasoning is not None for c in choices):  # a thinking model's: how much of the answer was reasoning
        details["reasoning_tokens"] = sum(map(reasoning_tokens, choices))
    predicted = [prediction_usage(c.request.prediction, c.tokens) for c in choices if c.request.prediction]
    if predicted:  # a predicted output's: how many of its tokens the answers took
        details.update({key: sum(p[key] for p in predicted) for key in predicted[0]})
    if details:
        out["completion_tokens_details"] = details
    return out


def reasoning_tokens(choice: Completion) -> int:
    """How many of the answer's tokens were reasoning: those up to the one that completes its
    closing tag (all of them where it never came); 0 for an answer without reasoning."""
    if choice.reasoning is None or not choice.reasoning.reasoned:
        return 0
    tokens, decode, close = choice.tokens, choice.served.decode, choice.reasoning.close
    low, high = 1, len(tokens)  # the fewest leading tokens whose text holds the closing tag
    if close not in decode(tokens):
        return len(tokens)
    while low < high:
        mid = (low + high) // 2
        low, high = (low, mid) if close in decode(tokens[:mid]) else (mid + 1, high)
    return low


async def whole(http: HttpRequest, choices: list[Completion], chat: bool, logprobs: bool) -> list[dict[str, Any]]:
    """The answer's choices, each whole, decoded side by side; the first failure ends them all."""

    async def text(choice: Completion) -> str:
        return "".join([piece async for piece in choice.deltas()])

    tasks = [asyncio.create_task(text(c)) for c in choices]
    watcher = asyncio.create_task(watch(http, choices))
    try:
        texts = await asyncio.gather(*tasks)
    finally:
        watcher.cancel()
        for task in tasks:
            task.cancel()  # (after a failure: the other rows leave the batch)
    out = []
    for choice, content in zip(choices, texts, strict=True):
        # vLLM's `stop_reason` beside OpenAI's fields: the stop string or stop token id it ended on
        shaped: dict[str, Any] = {"index": choice.index, "finish_reason": choice.finish_reason,
                                  "stop_reason": choice.stop_reason}  # fmt: skip
        given = choice.logprobs_since(0) if logprobs else None
        if chat:
            shaped.update(message=_message(choice, content), logprobs=given, finish_reason=choice.shown_finish_reason())
        else:
            echoed = choice.echoed() if logprobs else None
            given = given if echoed is None else joined(echoed, given)
            shaped.update(text=(choice.echo or "") + content, logprobs=given)
        out.append(shaped)
    return out


def _message(choice: Completion, text: str) -> dict[str, Any]:
    """A whole chat answer's message: its text; or its content, its reasoning and its tool calls."""
    if choice.calls is None and choice.reasoning is None:
        return {"role": "assistant", "content": text}
    parts = choice.read(text, end=True)
    calls = [part.shaped() for part in parts if isinstance(part, ToolCall)]
    content = "".join(part for part in parts if type(part) is str)
    message: dict[str, Any] = {"role": "assistant", "content": content or (None if calls else "")}
    reasoning = "".join(part for part in parts if isinstance(part, Reasoning))
    if reasoning:
        message["reasoning_content"] = reasoning
    if calls:
        message["tool_calls"] = calls
    return message


async def watch(http: HttpRequest, choices: list[Completion]) -> None:
    """Cancel a non-streamed answer's rows when its client went away."""
    while any(c.finish_reason is None for c in choices):
        if await http.is_disconnected():
            for choice in choices:
                choice.request.cancel()
            return
        await asyncio.sleep(DISCONNECT_POLL_S)


async def stream(choices: list[Completion], head: dict[str, Any], chat: bool, include_usage: bool,
                 logprobs: bool = False) -> AsyncIterator[str]:  # fmt: skip
    """The SSE stream of an answer, as OpenAI sends it, ending with `data: [DONE]`: each choice's
    chunks (named by their `index`) as they come; after the first failure, its error alone. With
    `logprobs`, a chunk carries those of the tokens taken since the choice's previous chunk (a
    token whose text is still held back, as the start of a stop string may be, comes before its
    text)."""
    kind = "chat.completion.chunk" if chat else "text_completion"
    parts = [_chunks(c, head, kind, chat, include_usage, logprobs) for c in choices]
    if len(parts) == 1:
        async for line, failed in parts[0]:
            yield line
            if failed:
                return
    else:
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(part: AsyncIterator[tuple[str, bool]]) -> None:
            try:
                async for item in part:
                    queue.put_nowait(item)
            finally:
                queue.put_nowait(None)

        tasks = [asyncio.create_task(pump(part)) for part in parts]
        try:
            running = len(tasks)
            while running:
                item = await queue.get()
                if item is None:
                    running -= 1
                    continue
                yield item[0]
                if item[1]:
                    return
        finally:
            for task in tasks:
                task.cancel()  # (a client gone, or a failure: every row leaves the batch)
    if include_usage:
        yield f"data: {json.dumps({**head, 'object': kind, 'choices': [], 'usage': usage(choices)})}\n\n"
    yield "data: [DONE]\n\n"


async def _chunks(choice: Completion, head: dict[str, Any], kind: str, chat: bool, include_usage: bool,
                  logprobs: bool) -> AsyncIterator[tuple[str, bool]]:  # fmt: skip
    """One choice's SSE lines, each with whether it reports a failure (the stream's last)."""
    reported = 0

    made = 0  # tool calls streamed so far

    def chunk(delta: str | Reasoning | ToolCall | None, finish: str | None, first: bool = False) -> str:
        nonlocal reported, made
        given = None
        if logprobs and not first and len(choice.tokens) > reported:
            given, reported = choice.logprobs_since(reported), len(choice.tokens)
        if chat:
            piece: dict[str, Any] = {} if delta is None else {"content": delta}
            if isinstance(delta, ToolCall):
                piece, made = {"tool_calls": [delta.shaped(made)]}, made + 1
            elif isinstance(delta, Reasoning):
                piece = {"reasoning_content": str(delta)}
            if first:
                piece = {"role": "assistant", "content": ""}
            shaped = {"index": choice.index, "delta": piece, "logprobs": given, "finish_reason": finish}
        else:
            shaped = {"index": choice.index, "text": delta or "", "logprobs": given, "finish_reason": finish}
        if finish is not None:
            shaped["stop_reason"] = choice.stop_reason
        usage = {"usage": None} if include_usage else {}  # OpenAI's chunks say null until the last
        return f"data: {json.dumps({**head, 'object': kind, 'choices': [shaped], **usage})}\n\n"

    if chat:
        yield chunk(None, None, first=True), False
    try:
        if choice.echo is not None:  # the prompt first, with its log probabilities
            await choice.scored()
            echoed = choice.echoed() if logprobs else None
            shaped = {"index": choice.index, "text": choice.echo, "logprobs": echoed, "finish_reason": None}
            usage = {"usage": None} if include_usage else {}
            yield f"data: {json.dumps({**head, 'object': kind, 'choices': [shaped], **usage})}\n\n", False
        async for piece in choice.deltas():
            for part in choice.read(piece) if chat else [piece]:
                yield chunk(part, None), False
        for part in choice.read("", end=True) if chat else []:
            yield chunk(part, None), False
    except ApiError as err:
        yield f"data: {json.dumps(err.body())}\n\n", True
        return
    yield chunk(None, choice.shown_finish_reason()), False
