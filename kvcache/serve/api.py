"""The HTTP side of `kvcache serve`: OpenAI's completions and chat completions (streamed as
server-sent events, or whole), models, health and Prometheus metrics, on Starlette.

A request is checked (`schema`), tokenized and handed to the engine; its tokens come back one by
one and are turned into text here: stop strings are found in the decoded text (the text that
could still become one is held back while streaming), and a row whose stop string appeared
leaves the batch at the engine's next step. A client that disconnects cancels its row.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import sys
import time
import traceback
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from ..errors import KVCacheError
from ..generation.detokenize import Detokenizer
from ..generation.sampling import Sampling
from .engine import Engine, Request
from .events import asyncio_sink
from .logprobs import TokenLogprobs, chat_logprobs, completion_logprobs
from .schema import ApiError, Limits, Params, chat_params, completion_params, parse_json
from .served import ServedModel

#: How often a non-streamed request checks whether its client is still there (seconds).
DISCONNECT_POLL_S = 0.1


class Completion:
    """One request's tokens turned into text as they arrive, stop strings applied."""

    def __init__(self, served: ServedModel, engine: Engine, request: Request, stops: list[str],
                 chat: bool = False) -> None:  # fmt: skip
        self.served, self.engine, self.request, self.stops, self.chat = served, engine, request, stops, chat
        self.queue: asyncio.Queue = asyncio.Queue()
        request.on_event = asyncio_sink(asyncio.get_running_loop(), self.queue)
        self.finish_reason: str | None = None
        self.text = ""
        self.tokens: list[int] = []  # as the events brought them: the engine may be a step ahead
        self.logprobs: list[TokenLogprobs] = []  # the tokens' log probabilities, when the request asked
        self._offset = (0, 0)  # (tokens shaped so far, their text's length), for completions' text_offset
        self.detokenizer = Detokenizer(served.decode)

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
        try:
            while True:
                kind, value = await self.queue.get()
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
                    self.detokenizer.add(fresh)
                    self.text = self.detokenizer.finish()
                    if sent < len(self.text):
                        yield self.text[sent:]
                    return
                token = self._take(value)
                self.tokens.append(token)
                text = self.detokenizer.add([*fresh, token])
                cut = min((i for s in self.stops if (i := text.find(s, max(0, sent - len(s)))) >= 0), default=-1)
                if cut >= 0:
                    self.text, self.finish_reason = text[:cut], "stop"
                    self.engine.finish_early(self.request)
                    if sent < cut:
                        yield text[sent:cut]
                    return
                safe = len(text) - holdback
                if text.endswith("\ufffd"):  # an incomplete multi-byte character
                    safe = min(safe, len(text) - 1)
                if safe > sent:
                    yield text[sent:safe]
                    sent = safe
        finally:
            if self.finish_reason is None:
                self.request.cancel()  # the client went away (or the stream was closed): the row leaves

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
            offset = sum(len(self.served.decode([t])) for t in self.tokens[:start])
        shaped = completion_logprobs(given, self.served.decode, offset)
        self._offset = (len(self.tokens), offset + sum(map(len, shaped["tokens"])))
        return shaped

    def usage(self) -> dict[str, Any]:
        """OpenAI's usage: the completion's tokens are those up to where it ended (a stop string's
        last token included), not the ones the engine decoded before it heard of the stop."""
        prompt, completion = len(self.request.prompt), len(self.tokens)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": self.request.cached_tokens}}  # fmt: skip


def create_app(served: ServedModel, engine: Engine, *, limits: Limits | None = None,
               api_key: str | None = None) -> Starlette:  # fmt: skip
    """The Starlette app serving `served` through `engine` (started and stopped with the app)."""
    limits = limits or Limits()
    metrics = engine.metrics

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        engine.start()
        try:
            yield
        finally:
            engine.stop()

    def endpoint(name: str, handler: Callable[[HttpRequest], Awaitable[Response]], *, auth: bool) -> Any:
        async def run(request: HttpRequest) -> Response:
            try:
                if auth and api_key is not None:
                    check_key(request, api_key)
                response = await handler(request)
            except ApiError as err:
                response = JSONResponse(err.body(), status_code=err.status)
            except Exception:  # a bug: logged here, never a traceback to the client
                traceback.print_exc(file=sys.stderr)
                response = JSONResponse(ApiError(500, "internal server error").body(), status_code=500)
            metrics.requests.labels(name, str(response.status_code)).inc()
            return response

        return run

    async def submit(http: HttpRequest, params: Params) -> Completion:
        try:
            prompt = params.prompt if isinstance(params.prompt, list) else served.encode(
                params.prompt, add_special_tokens=params.messages is None)
        except KVCacheError as err:
            raise ApiError(400, f"the prompt cannot be encoded: {err}", param="prompt") from None
        if any(not 0 <= t < served.vocab_size for t in prompt):
            raise ApiError(400, f"prompt token ids must be in [0, {served.vocab_size})", param="prompt")
        if len(prompt) > limits.max_prompt_tokens:
            raise ApiError(400, f"the prompt has {len(prompt)} tokens, more than the {limits.max_prompt_tokens} "
                           "this server takes", param="prompt", code="context_length_exceeded")  # fmt: skip
        if engine.active["waiting"] >= limits.max_waiting:
            raise ApiError(429, "the server is busy: too many requests are waiting, retry later")
        sampling = Sampling(params.temperature > 0, params.temperature or 1.0, params.top_k, params.top_p,
                            params.min_p)
        request = Request(prompt=prompt, max_tokens=params.max_tokens, sampling=sampling, seed=params.seed,
                          logprobs=params.logprobs)  # fmt: skip
        completion = Completion(served, engine, request, params.stop, chat=params.messages is not None)
        metrics.prompt_tokens.inc(len(prompt))
        engine.submit(request)
        return completion

    async def read(http: HttpRequest) -> dict[str, Any]:
        declared = http.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limits.max_body_bytes:
            raise ApiError(413, f"the request body is larger than {limits.max_body_bytes} bytes")
        chunks, size = [], 0
        async for chunk in http.stream():
            size += len(chunk)
            if size > limits.max_body_bytes:
                raise ApiError(413, f"the request body is larger than {limits.max_body_bytes} bytes")
            chunks.append(chunk)
        return parse_json(b"".join(chunks))

    async def generate(http: HttpRequest, chat: bool) -> Response:
        body = await read(http)
        params = (chat_params if chat else completion_params)(body, served.name, limits)
        if chat:
            try:
                params.prompt = served.chat_prompt(params.messages or [])
            except KVCacheError as err:
                raise ApiError(400, str(err), param="messages") from None
        completion = await submit(http, params)
        head = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}", "created": int(time.time()),
                "model": served.name}  # fmt: skip
        if params.stream:
            return StreamingResponse(_events(completion, head, chat, params.include_usage, params.logprobs is not None),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})  # fmt: skip
        watcher = asyncio.create_task(_watch(http, completion))
        try:
            text = "".join([piece async for piece in completion.deltas()])
        finally:
            watcher.cancel()
        choice: dict[str, Any] = {"index": 0, "finish_reason": completion.finish_reason}
        logprobs = completion.logprobs_since(0) if params.logprobs is not None else None
        if chat:
            choice.update(message={"role": "assistant", "content": text}, logprobs=logprobs)
        else:
            choice.update(text=text, logprobs=logprobs)
        kind = "chat.completion" if chat else "text_completion"
        return JSONResponse({**head, "object": kind, "choices": [choice], "usage": completion.usage()})

    async def completions(http: HttpRequest) -> Response:
        return await generate(http, chat=False)

    async def chat_completions(http: HttpRequest) -> Response:
        return await generate(http, chat=True)

    card = {"id": served.name, "object": "model", "created": 0, "owned_by": "kvcache"}

    async def models(http: HttpRequest) -> Response:
        return JSONResponse({"object": "list", "data": [card]})

    async def model(http: HttpRequest) -> Response:
        name = http.path_params["name"]
        if name != served.name:
            raise ApiError(404, f"the model {name!r} does not exist; this server serves {served.name!r}",
                           param="model", code="model_not_found")  # fmt: skip
        return JSONResponse(card)

    async def health(http: HttpRequest) -> Response:
        return JSONResponse({"status": "ok", "model": served.name, **engine.active,
                             "store_writes_pending": engine.store_writes_pending})  # fmt: skip

    async def metrics_text(http: HttpRequest) -> Response:
        return Response(metrics.text(), media_type="text/plain; version=0.0.4; charset=utf-8")

    async def http_error(http: HttpRequest, exc: Exception) -> Response:
        status = getattr(exc, "status_code", 500)
        detail = "no such endpoint" if status == 404 else "method not allowed" if status == 405 else str(exc)
        return JSONResponse(ApiError(status, f"{http.method} {http.url.path}: {detail}").body(), status_code=status)

    routes = [
        Route("/v1/completions", endpoint("completions", completions, auth=True), methods=["POST"]),
        Route("/v1/chat/completions", endpoint("chat", chat_completions, auth=True), methods=["POST"]),
        Route("/v1/models", endpoint("models", models, auth=True), methods=["GET"]),
        Route("/v1/models/{name:path}", endpoint("models", model, auth=True), methods=["GET"]),
        Route("/health", endpoint("health", health, auth=False), methods=["GET"]),
        Route("/metrics", endpoint("metrics", metrics_text, auth=False), methods=["GET"]),
    ]
    return Starlette(routes=routes, lifespan=lifespan, exception_handlers={HTTPException: http_error},
                     middleware=[Middleware(RefuseAmbiguousFraming)])  # fmt: skip


class RefuseAmbiguousFraming:
    """A request with both `Transfer-Encoding` and `Content-Length` is refused (400) and its
    connection closed (RFC 9112, 6.1): the two framings disagree about where the body ends, which
    is how a second request is smuggled past a proxy."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            names = {name.lower() for name, _ in scope["headers"]}
            if b"transfer-encoding" in names and b"content-length" in names:
                body = json.dumps(ApiError(400, "a request must not have both Transfer-Encoding and "
                                                "Content-Length").body()).encode()  # fmt: skip
                headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                           (b"connection", b"close")]  # fmt: skip
                await send({"type": "http.response.start", "status": 400, "headers": headers})
                await send({"type": "http.response.body", "body": body})
                return
        await self.app(scope, receive, send)


def check_key(request: HttpRequest, key: str) -> None:
    given = request.headers.get("authorization", "")
    scheme, _, token = given.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
        raise ApiError(401, "a valid API key is required (Authorization: Bearer <key>)", code="invalid_api_key")


async def _watch(http: HttpRequest, completion: Completion) -> None:
    """Cancel a non-streamed request whose client went away."""
    while completion.finish_reason is None:
        if await http.is_disconnected():
            completion.request.cancel()
            return
        await asyncio.sleep(DISCONNECT_POLL_S)


async def _events(completion: Completion, head: dict[str, Any], chat: bool, include_usage: bool,
                  logprobs: bool = False) -> AsyncIterator[str]:  # fmt: skip
    """The SSE stream of one completion, as OpenAI sends it, ending with `data: [DONE]`. With
    `logprobs`, a chunk carries those of the tokens taken since the previous chunk (a token whose
    text is still held back, as the start of a stop string may be, comes before its text)."""
    kind = "chat.completion.chunk" if chat else "text_completion"
    reported = 0

    def chunk(delta: str | None, finish: str | None, first: bool = False) -> str:
        nonlocal reported
        given = None
        if logprobs and not first and len(completion.tokens) > reported:
            given, reported = completion.logprobs_since(reported), len(completion.tokens)
        if chat:
            piece: dict[str, Any] = {} if delta is None else {"content": delta}
            if first:
                piece = {"role": "assistant", "content": ""}
            choice = {"index": 0, "delta": piece, "logprobs": given, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": delta or "", "logprobs": given, "finish_reason": finish}
        usage = {"usage": None} if include_usage else {}  # OpenAI's chunks say null until the last
        return f"data: {json.dumps({**head, 'object': kind, 'choices': [choice], **usage})}\n\n"

    if chat:
        yield chunk(None, None, first=True)
    try:
        async for piece in completion.deltas():
            yield chunk(piece, None)
    except ApiError as err:
        yield f"data: {json.dumps(err.body())}\n\n"
        return
    yield chunk(None, completion.finish_reason)
    if include_usage:
        yield f"data: {json.dumps({**head, 'object': kind, 'choices': [], 'usage': completion.usage()})}\n\n"
    yield "data: [DONE]\n\n"
