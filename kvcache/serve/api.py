"""The HTTP side of `kvcache serve`: OpenAI's completions and chat completions (streamed as
server-sent events, or whole), models, health and Prometheus metrics, on Starlette.

A request is checked (`schema`), tokenized and handed to the engine, one engine request per
choice (`n` per prompt); their tokens come back one by one and are turned into text and answers
by `completion`: stop strings are found in the decoded text, and a row whose stop string
appeared leaves the batch at the engine's next step. A client that disconnects cancels its rows.
"""

from __future__ import annotations

import asyncio
import dataclasses
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
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from .._version import __version__
from ..errors import KVCacheError
from ..generation.sampling import Sampling
from . import responses
from .completion import Completion, stream, usage, watch, whole
from .engine import Engine, Request
from .gemma_calls import CLOSE as GEMMA_CLOSE
from .grammar import call_grammar
from .pythonic_calls import CLOSE as PYTHONIC_CLOSE
from .reasoning import closing, opened_in, reasoning_tags
from .schema import ApiError, Limits, Params, chat_params, completion_params, parse_json
from .served import ServedModel
from .tokenize import detokenize_ids, split_tokenize_body, tokenized
from .tools import CLOSE, call_opening, call_style, tools_refused

#: What a call held to its schema leaves for the template to write, by call style (read as written)
HELD_CLOSINGS = {"json": "\n" + CLOSE, "markup": "\n" + CLOSE, "pythonic": PYTHONIC_CLOSE, "gemma": GEMMA_CLOSE}


def create_app(served: ServedModel, engine: Engine, *, limits: Limits | None = None, api_key: str | None = None,
               names: tuple[str, ...] = (), allowed_origins: tuple[str, ...] = ()) -> Starlette:  # fmt: skip
    """The Starlette app serving `served` through `engine` (started and stopped with the app).
    `names`: the model ids requests may name, the first the one answers show (default: the served
    model's name alone). `allowed_origins`: the web origins whose pages may call the server from a
    browser (CORS; "*": any); none by default, so a page elsewhere cannot read its answers."""
    names = tuple(names) or (served.name,)
    shown = names[0]
    if limits is None or limits.context_length is None:  # the model's own context
        limits = dataclasses.replace(limits or Limits(), context_length=(served.context or (None,))[0])
    # the served model's recommended sampling settings are what a request leaving one out gets
    limits = dataclasses.replace(limits or Limits(), sampling=dict(getattr(served, "sampling", None) or {}))
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

    def encoded(prompt: str | list[int], chat: bool, special: bool | None = None, keep: int | None = None) -> list[int]:
        """A prompt's token ids, checked (nothing is submitted before every prompt passes); the
        tokenizer's special tokens added to a completion's text, not to a chat's (`special` says
        otherwise); only the last `keep` of them (vLLM's `truncate_prompt_tokens`; -1: as many as
        the server takes)."""
        try:
            special = not chat if special is None else special
            ids = prompt if isinstance(prompt, list) else served.encode(prompt, add_special_tokens=special)
        except KVCacheError as err:
            raise ApiError(400, f"the prompt cannot be encoded: {err}", param="prompt") from None
        if any(not 0 <= t < served.vocab_size for t in ids):
            raise ApiError(400, f"prompt token ids must be in [0, {served.vocab_size})", param="prompt")
        if keep is not None:
            ids = ids[-(min(limits.context_length or limits.max_prompt_tokens, limits.max_prompt_tokens)
                        if keep == -1 else keep):]  # fmt: skip
        if len(ids) > limits.max_prompt_tokens:
            raise ApiError(400, f"the prompt has {len(ids)} tokens, more than the {limits.max_prompt_tokens} "
                           "this server takes", param="prompt", code="context_length_exceeded")  # fmt: skip
        return ids

    def encoded_prediction(text: str) -> list[int]:
        """A chat's predicted output as tokens of its answer (no special tokens), checked as a prompt is."""
        try:
            ids = served.encode(text, add_special_tokens=False)
        except KVCacheError as err:
            raise ApiError(400, f"the prediction cannot be encoded: {err}", param="prediction") from None
        if len(ids) > limits.max_prompt_tokens:
            raise ApiError(400, f"the prediction has {len(ids)} tokens, more than the {limits.max_prompt_tokens} "
                           "this server takes", param="prediction")  # fmt: skip
        return ids

    def room(prompt: list[int], params: Params, chat: bool) -> int:
        """The new tokens a prompt's answer may have: `max_tokens`, or where the request left it
        out the server's default cut to what the model's context leaves (a 400 where it leaves
        less than asked, as OpenAI and vLLM answer it)."""
        context, least = limits.context_length, 0 if params.echo else 1
        if context is None:
            return params.max_tokens
        left = context - len(prompt)
        if left >= (params.max_tokens if params.max_tokens_asked else least):
            return min(params.max_tokens, left)
        asked = f"{len(prompt) + params.max_tokens} tokens ({len(prompt)} in the prompt, {params.max_tokens} " \
                "in the completion)" if params.max_tokens_asked else f"{len(prompt)} tokens in the prompt alone"
        raise ApiError(400, f"this model's maximum context length is {context} tokens, but the request asks for "
                       f"{asked}: send a shorter prompt or a smaller max_tokens",
                       param="max_tokens" if params.max_tokens_asked else "messages" if chat else "prompt",
                       code="context_length_exceeded")  # fmt: skip

    def submit(params: Params, chat: bool) -> list[Completion]:
        """One engine request per choice: `n` per prompt, choice j of a prompt seeded `seed + j`
        (so seeded samples differ and repeat), indexed prompt by prompt."""
        prompts = [encoded(p, chat, keep=params.truncate) for p in params.prompts]
        rooms = [room(p, params, chat) for p in prompts]
        if engine.active["waiting"] + len(prompts) * params.n > limits.max_waiting:
            raise ApiError(429, "the server is busy: too many requests are waiting, retry later")
        if any(token >= served.vocab_size for token, _ in params.logit_bias):
            raise ApiError(400, f"logit_bias token ids must be in [0, {served.vocab_size})", param="logit_bias")
        if any(token >= served.vocab_size for token in params.stop_token_ids):
            raise ApiError(400, f"stop_token_ids must be in [0, {served.vocab_size})", param="stop_token_ids")
        sampling = Sampling(params.temperature > 0, params.temperature or 1.0, params.top_k, params.top_p,
                            params.min_p, params.logit_bias, params.presence_penalty, params.frequency_penalty,
                            params.repetition_penalty)  # fmt: skip
        predicted = None if params.prediction is None else encoded_prediction(params.prediction)
        choices = []
        for i, (prompt, original, most) in enumerate(zip(prompts, params.prompts, rooms, strict=True)):
            for j in range(params.n):
                seed = None if params.seed is None else (params.seed + j + 2**63) % 2**64 - 2**63
                request = Request(prompt=prompt, max_tokens=most, sampling=sampling, seed=seed,
                                  logprobs=params.logprobs, grammar=params.grammar, stop_ids=params.stop_token_ids,
                                  ignore_eos=params.ignore_eos, min_tokens=min(params.min_tokens, most),
                                  prompt_logprobs=params.logprobs if params.echo else None,
                                  prediction=predicted)  # fmt: skip
                shown = original if isinstance(original, str) and params.truncate is None else served.decode(prompt)
                echo = shown if params.echo else None
                choices.append(Completion(served, engine, request, params.stop, chat=chat, index=i * params.n + j,
                                          include_stop=params.include_stop,
                                          counts_prompt=j == 0, echo=echo, tools=params.tools,
                                          reasoning=params.reasoning, reasoning_tags=params.reasoning_tags,
                                          call_style=params.call_style,
                                          opening=params.opening, closing=params.closing))  # fmt: skip
                metrics.prompt_tokens.inc(len(prompt))
                engine.submit(request)
        return choices

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

    def checked(body: dict[str, Any], chat: bool) -> Params:
        """A request's parameters, a chat's prompt rendered by the model's template."""
        params = (chat_params if chat else completion_params)(body, names, limits)
        if chat:
            messages = params.messages or []
            if params.tools is not None or any(m["role"] == "tool" or "tool_calls" in m for m in messages):
                refused = tools_refused(served)
                if refused:
                    raise ApiError(400, refused, param="tools" if params.tools is not None else "messages")
            try:
                prompt = served.chat_prompt(messages, params.tools, params.template_options,
                                            generation_prompt=params.generation_prompt,
                                            continue_final=params.continue_final)  # fmt: skip
            except KVCacheError as err:
                raise ApiError(400, str(err), param="chat_template_kwargs" if served.kind == "bundled" else "messages"
                               ) from None  # fmt: skip
            tags = params.reasoning_tags = reasoning_tags(served)
            params.reasoning = None if tags is None else opened_in(prompt, tags)
            params.call_style = None if params.tools is None else call_style(served)
            if params.forced_tool is not None or params.grammar is not None:
                # the answer starts with the call, or is held to a format: no reasoning (an empty thought)
                if params.forced_tool is not None:  # (the tools' schemas hold the call's rest, where they can)
                    style = params.call_style or "json"  # (a forced call: tools offered)
                    params.opening = call_opening(style, params.forced_tool)
                    params.grammar = call_grammar(style, params.tools or [], params.forced_tool, served.token_id)
                    held = params.grammar is not None  # (a held call ends before its template's closing tag)
                    params.closing = HELD_CLOSINGS.get(style, "") if held else ""
                prompt += (closing(tags) if tags is not None and params.reasoning else "") + params.opening
                params.reasoning = None
            params.prompts = [prompt]
        return params

    async def generate(http: HttpRequest, chat: bool) -> Response:
        params = checked(await read(http), chat)
        choices = submit(params, chat)
        head = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}", "created": int(time.time()),
                "model": shown}  # fmt: skip
        logprobs = params.logprobs is not None
        if params.stream:
            return StreamingResponse(stream(choices, head, chat, params.include_usage, logprobs),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})  # fmt: skip
        shaped = await whole(http, choices, chat, logprobs)
        kind = "chat.completion" if chat else "text_completion"
        return JSONResponse({**head, "object": kind, "choices": shaped, "usage": usage(choices)})

    async def completions(http: HttpRequest) -> Response:
        return await generate(http, chat=False)

    async def chat_completions(http: HttpRequest) -> Response:
        return await generate(http, chat=True)

    async def response(http: HttpRequest) -> Response:
        body = await read(http)
        try:
            params = checked(responses.chat_body(body), chat=True)
        except ApiError as err:
            raise responses.renamed(err) from None
        shape = responses.ResponseShape(body, shown, limits.sampling)
        (choice,) = submit(params, chat=True)
        if params.stream:
            return StreamingResponse(responses.events(choice, shape), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})  # fmt: skip
        watcher = asyncio.create_task(watch(http, [choice]))
        try:
            return JSONResponse(await responses.whole(choice, shape))
        finally:
            watcher.cancel()

    card = {"id": shown, "object": "model", "created": 0, "owned_by": "kvcache",
            **({} if limits.context_length is None else {"max_model_len": limits.context_length})}  # (vLLM's field)

    async def models(http: HttpRequest) -> Response:
        return JSONResponse({"object": "list", "data": [card]})

    async def model(http: HttpRequest) -> Response:
        name = http.path_params["name"]
        if name not in names:
            raise ApiError(404, f"the model {name!r} does not exist; this server serves {shown!r}",
                           param="model", code="model_not_found")  # fmt: skip
        return JSONResponse(card)

    async def tokenize(http: HttpRequest) -> Response:
        body, flags = split_tokenize_body(await read(http))
        chat = "messages" in body
        params = checked(body, chat)
        ids = encoded(params.prompts[0], chat, flags["add_special_tokens"])
        return JSONResponse(tokenized(served, ids, limits.context_length, bool(flags["return_token_strs"])))

    async def detokenize(http: HttpRequest) -> Response:
        body = await read(http)
        if body.get("model") is not None and body["model"] not in names:
            raise ApiError(404, f"the model {body['model']!r} does not exist; this server serves {shown!r}",
                           param="model", code="model_not_found")  # fmt: skip
        return JSONResponse({"prompt": served.decode(detokenize_ids(body, served.vocab_size))})

    async def version(http: HttpRequest) -> Response:
        return JSONResponse({"version": __version__})

    async def health(http: HttpRequest) -> Response:
        return JSONResponse({"status": "ok", "model": shown, **engine.active,
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
        Route("/v1/responses", endpoint("responses", response, auth=True), methods=["POST"]),
        Route("/v1/models", endpoint("models", models, auth=True), methods=["GET"]),
        Route("/v1/models/{name:path}", endpoint("models", model, auth=True), methods=["GET"]),
        Route("/tokenize", endpoint("tokenize", tokenize, auth=True), methods=["POST"]),
        Route("/detokenize", endpoint("detokenize", detokenize, auth=True), methods=["POST"]),
        Route("/health", endpoint("health", health, auth=False), methods=["GET"]),
        Route("/version", endpoint("version", version, auth=False), methods=["GET"]),
        Route("/metrics", endpoint("metrics", metrics_text, auth=False), methods=["GET"]),
    ]
    middleware = [Middleware(RefuseAmbiguousFraming)]
    if allowed_origins:  # preflights answered before the API key is asked for (browsers send none with them)
        middleware.append(Middleware(CORSMiddleware, allow_origins=list(allowed_origins), allow_methods=["GET", "POST"],
                                     allow_headers=["authorization", "content-type"]))  # fmt: skip
    return Starlette(routes=routes, lifespan=lifespan, exception_handlers={HTTPException: http_error},
                     middleware=middleware)  # fmt: skip


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
