"""`kvcache serve`: serve the bundled model (or a transformers model directory) over an
OpenAI-compatible HTTP API on 127.0.0.1 (docs/serve.md)."""

from __future__ import annotations

import argparse
import functools
import os
import sys
from pathlib import Path
from typing import Any

from ..errors import GenerationError
from .model_args import (
    AUTO_DRAFT_ROWS,
    AUTO_DRAFT_TOKENS,
    add_model_arguments,
    check_model_arguments,
    load_drafter,
    load_model,
)

API_KEY_ENV = "KVCACHE_API_KEY"
#: max_tokens of a request that gives none, where neither the flag nor the model's files say
DEFAULT_MAX_TOKENS = 128


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "serve",
        help="serve a model over an OpenAI-compatible HTTP API",
        description="Serve the bundled model (or --model DIR, a local transformers model) over an OpenAI-compatible "
        "HTTP API: /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics.",
    )
    add_model_arguments(parser, draft_model=True, speculative_default=(
        f". Default: prompt lookup of up to {AUTO_DRAFT_TOKENS} tokens, drafted while at most {AUTO_DRAFT_ROWS} "
        "request(s) run and only as far as it pays, for models whose rejected drafts can be rolled back"))
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    parser.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 picks a free one)")
    parser.add_argument("--allowed-origins", nargs="+", default=(), metavar="ORIGIN",
                        help="web origins whose pages may call the server from a browser (CORS), e.g. "
                        "http://localhost:3000, or * for any (vLLM's flag; default: none, so a web page elsewhere "
                        "cannot read answers)")
    parser.add_argument("--prefix-store", metavar="DIR_OR_URL",
                        help="a directory or Redis URL for prefixes (shared, survives restarts); default: memory")
    parser.add_argument("--prefix-store-bytes", type=int, default=1 << 30, metavar="N",
                        help="the prefix store's byte budget (default 1 GiB)")
    parser.add_argument("--prefix-store-key-file", metavar="FILE", help="MAC key of the prefix store (see generate)")
    parser.add_argument("--chunk-size", type=int, default=16,
                        help="prefix-store chunk: prefixes are reused in whole chunks (default 16)")
    parser.add_argument("--api-key", help=f"require 'Authorization: Bearer KEY' (or set ${API_KEY_ENV}, or use "
                        "--api-key-file: a flag's value is visible to other users of this machine)")
    parser.add_argument("--api-key-file", metavar="FILE", help="read the API key from FILE")
    parser.add_argument("--kv-bits", type=int, choices=(8, 4, 2), default=None,
                        help="quantize the attention cache to 8, 4 or 2 bits (as generate --kv-bits; each request "
                        "quantized as when it runs alone); default: full precision")
    parser.add_argument("--max-batch", "--max-num-seqs", type=int, default=32,
                        help="(vLLM's --max-num-seqs) requests decoded together at most (default 32)")
    parser.add_argument("--max-step-tokens", "--max-num-batched-tokens", type=int, default=None,
                        help="(vLLM's --max-num-batched-tokens) tokens one engine step computes at most: every "
                        "running row's decode token plus prefill blocks of waiting prompts (default 256)")
    parser.add_argument("--max-model-len", type=int, default=None, metavar="N",
                        help="the most tokens a prompt and its answer hold together (default: the context "
                        "the model's config names, which is also the most taken)")
    parser.add_argument("--max-prompt-tokens", type=int, default=8192, help="longest prompt taken (default 8192)")
    parser.add_argument("--max-tokens", type=int, default=4096, help="largest max_tokens taken (default 4096)")
    parser.add_argument("--default-max-tokens", type=int, default=None,
                        help=f"max_tokens when a request gives none (default {DEFAULT_MAX_TOKENS}, or --model DIR's "
                        "generation_config.json max_new_tokens, as vLLM takes it; at most --max-tokens)")
    parser.add_argument("--max-waiting", type=int, default=256,
                        help="requests queued (not yet prefilling) at most; more get a 429 (default 256)")
    parser.add_argument("--max-body-bytes", type=int, default=1 << 20, help="largest request body (default 1 MiB)")
    parser.add_argument("--threads", type=int, default=None,
                        help="CPU threads for torch (default: one fewer than the cores, at least 1: the HTTP side "
                        "keeps a core)")
    parser.add_argument("--shutdown-timeout", type=float, default=10.0,
                        help="seconds in-flight requests may take to finish after SIGTERM (default 10)")
    parser.add_argument("--keep-alive", type=float, default=30.0,
                        help="seconds an idle client connection stays open (default 30; uvicorn's 5 s closes "
                        "connections that busy clients are about to reuse)")
    parser.add_argument("--served-model-name", nargs="+", metavar="NAME", default=None,
                        help="the model id(s) requests may name, the first the one answers show (default: the "
                        "model directory's name; the --model path as given, and in full, is taken too)")
    parser.add_argument("--enable-auto-tool-choice", action="store_true",
                        help="taken for vLLM's command lines: tool_choice auto is always served")
    parser.add_argument("--tool-call-parser", metavar="NAME",
                        help="taken for vLLM's command lines: the call format the model's template asks for "
                        "(hermes, qwen3_xml, llama3_json, pythonic, mistral, ...), checked at startup; calls are "
                        "read in the template's own format either way")
    parser.add_argument("--reasoning-parser", metavar="NAME",
                        help="taken for vLLM's command lines: the reasoning tags the model's template writes "
                        "(deepseek_r1, qwen3, mistral, ...), checked at startup; answers are read for reasoning "
                        "in the template's own tags either way")
    parser.add_argument("--access-log", action="store_true", help="log every HTTP request on stderr")
    parser.add_argument("--engine", choices=("process", "thread"), default="process",
                        help="where the model runs: a process of its own (default; the web server and the model "
                        "do not share one interpreter lock) or a thread of the server's process")
    names = {"max_bytes": "--prefix-store-bytes", "chunk_size": "--chunk-size"}
    parser.set_defaults(func=run, flag_names=names)

    def one_line_error(message: str) -> None:  # argparse prints the whole usage block otherwise
        parser.exit(2, f"kvcache serve: error: {message} (see kvcache serve -h)\n")

    parser.error = one_line_error  # type: ignore[method-assign]


#: uvicorn's HTTP parser, named rather than "auto": with httptools installed (uvicorn[standard]),
#: "auto" takes it, and it refuses some malformed requests itself with a plain-text 400 before the
#: app's OpenAI error could (a request with two framings); the same parser everywhere, the one the
#: tests run. httptools and uvloop measured no faster here (32 streaming clients, Llama-shaped
#: directory: 2,838-3,068 against 2,818-2,891 tokens/s, TTFT 92-109 against 109-119 ms).
HTTP_PROTOCOL = "h11"


def _graceful_server_class() -> Any:
    import contextlib
    import signal
    import threading

    import uvicorn

    class GracefulServer(uvicorn.Server):
        """uvicorn's server, except that after a graceful shutdown on SIGTERM/SIGINT the command
        exits with status 0 (uvicorn re-raises the signal, which kills the process), and that the
        requests still running just before the shutdown's deadline are ended by `before_cancel`
        (the engine answers each with an OpenAI error) rather than cut by uvicorn (a plain-text
        500, a traceback per stream)."""

        before_cancel: Any = None

        async def shutdown(self, sockets: Any = None) -> None:
            import asyncio

            ender = None
            if self.before_cancel is not None:
                timeout = self.config.timeout_graceful_shutdown or 0.0

                async def end_requests() -> None:
                    await asyncio.sleep(max(timeout - min(1.0, timeout / 2), 0.0))
                    await asyncio.to_thread(self.before_cancel)

                ender = asyncio.create_task(end_requests())
            try:
                await super().shutdown(sockets)
            finally:
                if ender is not None:
                    ender.cancel()

        @contextlib.contextmanager
        def capture_signals(self) -> Any:  # type: ignore[override]
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)

    return GracefulServer


def api_key(args: argparse.Namespace) -> str | None:
    """The API key from --api-key-file, --api-key or $KVCACHE_API_KEY (in that order); None when
    none is given. One given empty is an error, never an open server."""
    if args.api_key_file:
        key, source = Path(args.api_key_file).read_text().strip(), f"--api-key-file {args.api_key_file}"
    elif args.api_key is not None:
        key, source = args.api_key.strip(), "--api-key"
    elif API_KEY_ENV in os.environ:
        key, source = os.environ[API_KEY_ENV].strip(), f"${API_KEY_ENV}"
    else:
        return None
    if not key:
        raise GenerationError(f"the API key given by {source} is empty (leave it out to serve without a key)")
    return key


def default_threads() -> int:
    """Torch's threads for serving: one fewer than torch's default (one per core), at least one, so
    the HTTP side keeps a core: on the 2-core machine time to first token at 8 and 32 clients was
    0.73x-0.81x of transformers serve's with one thread and 1.19x-1.40x with two
    (`benchmarks/serve_anchor.py`; tokens/s moved less than the runs' noise)."""
    import torch

    return max(1, torch.get_num_threads() - 1)


def model_names(args: argparse.Namespace, name: str) -> tuple[str, ...]:
    """The model ids requests may name, the one answers show first: `--served-model-name`'s, else
    the served model's `name` (a directory's name, or a hub id), then the `--model` path as given and in full,
    which is what clients written for vLLM (whose default id is that path) send."""
    if args.served_model_name:
        return tuple(dict.fromkeys(args.served_model_name))
    given = (args.model, str(Path(args.model).resolve())) if args.model else ()
    if args.model and not Path(args.model).is_dir():  # a hub id: no path to resolve
        given = (args.model,)
    return tuple(dict.fromkeys((name, *given)))


def allowed_origins(given: list[str] | tuple[str, ...]) -> tuple[str, ...]:
    """`--allowed-origins`' origins: each `*` or `scheme://host[:port]`, or a JSON list of them as
    vLLM's flag takes it (`'["http://localhost:3000"]'`)."""
    import json
    from urllib.parse import urlsplit

    origins: list[str] = []
    for value in given:
        try:
            listed = json.loads(value) if value.lstrip().startswith("[") else [value]
        except ValueError:
            raise GenerationError(f"--allowed-origins {value!r}: not a JSON list of origins") from None
        origins += listed if isinstance(listed, list) else [listed]
    for origin in origins:
        parts = urlsplit(origin) if isinstance(origin, str) else None
        if origin != "*" and (parts is None or parts.scheme not in ("http", "https") or not parts.netloc
                              or parts.path not in ("", "/") or parts.query or parts.fragment):  # fmt: skip
            raise GenerationError(f"--allowed-origins: {origin!r} is not an origin (scheme://host[:port], or *)")
    return tuple(origin.rstrip("/") for origin in origins)


def default_max_tokens(args: argparse.Namespace, served: Any) -> int:
    """A request's max_tokens where it gives none: `--default-max-tokens`, else the served
    directory's `generation_config.json` max_new_tokens (vLLM's default), else `DEFAULT_MAX_TOKENS`."""
    if args.default_max_tokens is not None:
        return args.default_max_tokens
    return int(served.sampling.get("max_new_tokens", DEFAULT_MAX_TOKENS))


def context_length(args: argparse.Namespace, served: Any) -> int | None:
    """The most tokens a prompt and its answer may hold together: `--max-model-len`, at most the
    context the model's config names (vLLM's rule), which is the default (None: no limit)."""
    if args.max_model_len is None:
        return served.context[0] if served.context else None
    if served.context and args.max_model_len > served.context[0]:
        raise GenerationError(f"--max-model-len {args.max_model_len}: {served.name} takes at most "
                              f"{served.context[0]} positions (its config's {served.context[1]})")  # fmt: skip
    return args.max_model_len


def build_engine(args: argparse.Namespace) -> tuple[Any, Any]:
    """The served model and its engine (with its prefix store and drafters) as the flags say, `args`
    checked by `run`: what the engine process builds, or `run` itself with `--engine thread`."""
    import torch

    from ..devices import resolve_device
    from ..generation import SuffixCorpus
    from ..serve.engine import Engine
    from ..serve.grammar import grammar_tokenizer
    from ..serve.speculation import can_speculate
    from ..store import PrefixStore, open_store
    from .generate import store_key

    device = resolve_device(args.device)
    torch.set_num_threads(args.threads or default_threads())
    served = load_model(args, device)
    served.model.kv_bits = args.kv_bits  # new_cache() builds quantized attention layers (the store's too)
    speculative = args.draft_tokens if args.draft_model else args.suffix_draft or args.prompt_lookup or 0
    draft_rows = None  # a speculation flag drafts at every batch size (as far as it pays)
    if not args.speculation_chosen and can_speculate(served.model, device):  # the default, where it rolls back
        speculative, draft_rows = AUTO_DRAFT_TOKENS, AUTO_DRAFT_ROWS
    draft_model = load_drafter(args, served)[0] if args.draft_model else None
    corpus = SuffixCorpus() if args.suffix_draft else None  # one per server: one model, one API key
    store_args = {"chunk_size": args.chunk_size, "max_bytes": args.prefix_store_bytes, "namespace": served.identity,
                  "key": store_key(args)}  # fmt: skip
    store = open_store(args.prefix_store, **store_args) if args.prefix_store else PrefixStore(**store_args)
    try:
        engine = Engine(served.model, store, eos=served.eos, speculative=speculative, draft_model=draft_model,
                        draft_rows=draft_rows, suffix_corpus=corpus, max_batch=args.max_batch,
                        max_step_tokens=args.max_step_tokens,
                        grammar_tokenizer=functools.partial(grammar_tokenizer, served))  # fmt: skip
    except BaseException:
        store.close()
        raise
    return served, engine


def _drop_weights(served: Any) -> None:
    """The server process keeps the tokenizer; the weights live in the engine process."""
    from ..store.payloads import model_module

    module = model_module(served.model)
    if module is not None:
        module.to("meta")


def run(args: argparse.Namespace) -> int:
    try:
        import uvicorn
    except ImportError as exc:
        raise GenerationError('kvcache serve needs the serve extra: pip install "kvcache[serve]"') from exc
    import torch

    from ..devices import resolve_device
    from ..models.sampling_defaults import describe
    from ..serve import create_app
    from ..serve.engine import MAX_STEP_TOKENS
    from ..serve.engine_process import EngineProcess
    from ..serve.reasoning import reasoning_parser_refused
    from ..serve.schema import Limits
    from ..serve.tools import parser_refused

    server_class = _graceful_server_class()
    if args.max_step_tokens is None:
        args.max_step_tokens = MAX_STEP_TOKENS

    if args.max_model_len is not None and args.max_model_len < 1:
        raise GenerationError(f"--max-model-len must be >= 1, got {args.max_model_len}")
    for name in ("max_batch", "max_step_tokens", "max_prompt_tokens", "max_tokens", "default_max_tokens",
                 "max_body_bytes", "max_waiting"):  # fmt: skip
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise GenerationError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if not 0 <= args.port < 65536:
        raise GenerationError(f"--port must be in [0, 65535], got {args.port}")
    for name in ("keep_alive", "shutdown_timeout"):
        if not getattr(args, name) > 0:  # NaN too
            raise GenerationError(f"--{name.replace('_', '-')} must be > 0 seconds, got {getattr(args, name)}")
    if args.threads is not None and args.threads < 1:
        raise GenerationError(f"--threads must be >= 1, got {args.threads}")
    if args.served_model_name is not None and not all(name.strip() for name in args.served_model_name):
        raise GenerationError("--served-model-name: a name must not be empty")
    args.allowed_origins = allowed_origins(args.allowed_origins)
    args.speculation_chosen = (args.speculative, args.prompt_lookup, args.suffix_draft,
                               args.draft_model) != (None,) * 4  # fmt: skip
    check_model_arguments(args)
    resolve_device(args.device)  # a device that is not there fails here, before any process starts
    key = api_key(args)
    if args.engine == "thread":
        served, engine = build_engine(args)
        store_location = engine.store.location
    else:
        engine = EngineProcess(args, build_engine)
        engine.launch()  # the child loads the model while this process loads its tokenizer
        try:
            torch.set_num_threads(1)  # this process tokenizes and serves HTTP: no model computation
            served = load_model(args, torch.device("cpu"))
            engine.wait_ready()
        except BaseException:
            engine.stop(5.0)
            raise
        _drop_weights(served)
        store_location = engine.store_location
    try:
        context = context_length(args, served)
        refused = None if args.tool_call_parser is None else parser_refused(served, args.tool_call_parser)
        if args.reasoning_parser is not None:
            refused = refused or reasoning_parser_refused(served, args.reasoning_parser)
        if refused:
            raise GenerationError(refused)
    except GenerationError:
        engine.stop(5.0)
        if args.engine == "thread":
            engine.store.close()
        raise
    limits = Limits(max_body_bytes=args.max_body_bytes, max_prompt_tokens=args.max_prompt_tokens,
                    max_tokens=args.max_tokens, max_waiting=args.max_waiting, context_length=context,
                    default_max_tokens=min(default_max_tokens(args, served), args.max_tokens))  # fmt: skip
    names = model_names(args, served.name)
    app = create_app(served, engine, limits=limits, api_key=key, names=names,
                     allowed_origins=tuple(args.allowed_origins))  # fmt: skip
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level="warning", access_log=args.access_log,
                            timeout_graceful_shutdown=args.shutdown_timeout, timeout_keep_alive=args.keep_alive,
                            lifespan="on", http=HTTP_PROTOCOL, loop="asyncio")  # fmt: skip
    server = server_class(config)
    server.before_cancel = engine.stop

    def announce() -> None:
        sockets = [s for srv in getattr(server, "servers", []) for s in srv.sockets]
        port = sockets[0].getsockname()[1] if sockets else args.port
        auth = ", API key required" if key else ""
        said = describe(served.sampling)
        sampling = f"; defaults from its generation_config.json: {said}" if said else ""
        print(f"kvcache serve: {names[0]} on http://{args.host}:{port}/v1 (prefix store {store_location}{auth})"
              f"{sampling}", file=sys.stderr, flush=True)  # fmt: skip

    original = server.startup

    async def startup(sockets: Any = None) -> None:
        await original(sockets=sockets)
        announce()

    server.startup = startup  # type: ignore[method-assign]
    try:
        server.run()
    finally:
        engine.stop()  # (the engine process closes its store itself)
        if args.engine == "thread":
            engine.store.close()  # the writer's queue finished, the index or connections released
    return 0
