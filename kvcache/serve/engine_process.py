"""The engine in a process of its own: what `kvcache serve` runs by default (`--engine process`).

In one process the engine thread and the web server's event loop take turns on one interpreter
lock: the model's forwards release it inside every torch operation and want it back after, while
the event loop wants it for each chunk it writes. On the 2-core machine that cost 30-40% of the
engine's steps at 32 streaming clients (the same load in process: ~2,800 tokens/s, through HTTP
~1,800; `benchmarks/serve_anchor.py`). Here the engine runs in a spawned child with the model,
the prefix store and the drafters, and the server process keeps HTTP, tokenizing and
detokenizing; they talk over a pipe, one message per request one way and one per engine turn
(every row's events, and the engine's counts) the other.

The child ignores SIGINT and SIGTERM: the server shuts it down when its own graceful shutdown
ends (requests still running are answered "unavailable", as the engine in a thread answers them),
and it exits by itself when the pipe closes (the server died). A child that ends unexpectedly
fails the requests in flight and every later one with 503s; the server keeps answering
`/health` and `/metrics`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import multiprocessing
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

from ..errors import GenerationError, KVCacheError
from .engine import Request
from .events import BatchedSink
from .metrics import Metrics

#: Event kinds that end a request.
ENDS = frozenset({"done", "error", "unavailable"})


class EngineProcess:
    """An `Engine`, built by `build(args)` in a spawned process, with the interface the web side
    uses: `submit`, `finish_early`, `active`, `store_writes_pending`, `metrics` (kept here, from the
    child's events), `start`, `stop`. `build` is a module-level function (the child imports it by
    name), returning `(served model, engine)`: the command line passes its `build_engine`."""

    def __init__(self, args: argparse.Namespace, build: Callable[[argparse.Namespace], tuple[Any, Any]],
                 metrics: Metrics | None = None) -> None:  # fmt: skip
        self.args, self.build = args, build
        self.metrics = metrics or Metrics()
        self.store_location = ""
        self._requests: dict[str, Request] = {}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()  # the pipe's sending end and the request table
        self._status: dict[str, int] = {"waiting": 0, "prefilling": 0, "running": 0, "batch_cache": 0,
                                        "received": 0, "store_writes_pending": 0, "draft_tokens": 0,
                                        "draft_accepted": 0}  # fmt: skip
        self._sent = 0
        self._process: Any = None
        self._conn: Any = None
        self._loop: Any = None  # the event loop that reads the child's messages (`start`)
        self._reading = False
        self._done = threading.Event()  # the child's messages ended (it stopped or died)
        self._ended: str | None = None  # why requests can no longer be served
        self._stopping = False
        self._closing = threading.Lock()  # `stop`'s join and close of the pipe, by one caller

    # ------------------------------------------------------------------------- lifetime
    def launch(self) -> None:
        """Spawn the child (it loads the model meanwhile: `wait_ready`)."""
        if self._process is not None:
            return
        context = multiprocessing.get_context("spawn")  # fork is unsafe once torch's threads exist
        self._conn, child_end = context.Pipe()
        self._process = context.Process(target=child_main, args=(child_end, self.args, self.build),
                                        name="kvcache-engine")
        self._process.start()
        child_end.close()  # the child's end lives in the child alone: its exit is our end-of-file

    def wait_ready(self) -> None:
        """Block until the child has built its engine; its error (one line) if it could not."""
        assert self._process is not None and self._conn is not None
        if self.store_location:
            return
        while not self._conn.poll(0.2):
            if not self._process.is_alive():
                self._conn.close()
                raise GenerationError(f"the engine process ended before it was ready (exit code "
                                      f"{self._process.exitcode}); its error is above")  # fmt: skip
        try:
            kind, value = self._conn.recv()
        except (EOFError, OSError):
            kind, value = "failed", GenerationError("the engine process ended before it was ready")
        if kind == "failed":
            self._process.join(30)
            self._conn.close()
            raise value if isinstance(value, KVCacheError) else GenerationError(str(value))
        self.store_location = value["store"]

    def start(self) -> None:
        """Spawn the child if not yet, wait until it serves, and read its messages on the running
        event loop (no thread between the pipe and the requests' queues), else on a thread."""
        self.launch()
        self.wait_ready()
        if self._reading:
            return
        self._reading = True
        try:
            self._loop = asyncio.get_running_loop()
            self._loop.add_reader(self._conn.fileno(), self._readable)
        except (RuntimeError, NotImplementedError):  # no running loop, or one without add_reader
            self._loop = None
            threading.Thread(target=self._drain, name="kvcache-engine-events", daemon=True).start()

    def stop(self, timeout: float = 30.0) -> None:
        """End the child: requests still running are answered "unavailable"; then it exits. Safe to
        call again, and at once from the event loop and another thread (the shutdown's deadline
        stops the engine from a worker thread while the app's lifespan stops it on the loop)."""
        if self._process is None:
            return
        if not self._stopping:
            self._stopping = True
            self._post(("stop", timeout), always=True)
        if self._done.is_set():
            pass  # its messages ended: nothing left to read (and the pipe may be closed already)
        elif self._loop is not None and _on_thread_of(self._loop):  # the loop cannot read while we wait
            self._loop.remove_reader(self._conn.fileno())
            self._drain(timeout + 10)
        elif self._reading:
            self._done.wait(timeout + 10)
        else:
            self._drain(timeout + 10)
        with self._closing:  # one caller at a time: two closing the pipe at once could close its
            self._process.join(timeout + 10)  # descriptor's number twice, the second time whatever
            if self._process.is_alive():  # this process opened under that number in between
                self._process.kill()
                self._process.join(10)
            if not self._conn.closed:
                self._conn.close()

    # -------------------------------------------------------------------------- events
    def _readable(self) -> None:
        """On the event loop: the messages waiting in the pipe."""
        while not self._done.is_set():
            try:
                if not self._conn.poll():
                    return
                message = self._conn.recv()
            except (EOFError, OSError):
                message = ("stopped", None)
            if not self._handle(message):
                self._loop.remove_reader(self._conn.fileno())

    def _drain(self, timeout: float | None = None) -> None:
        """Read the child's messages until it ends (or `timeout` seconds pass)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._done.is_set():
            left = None if deadline is None else deadline - time.monotonic()
            try:
                if left is not None and (left <= 0 or not self._conn.poll(left)):
                    break
                message = self._conn.recv()
            except (EOFError, OSError):
                message = ("stopped", None)
            self._handle(message)
        self._end()

    def _handle(self, message: tuple) -> bool:
        """One message of the child; False (and every request left answered) once it ended."""
        if message[0] == "events":
            self._dispatch(message[1])
            drafts = [message[2]["draft_tokens"] - self._status["draft_tokens"],
                      message[2]["draft_accepted"] - self._status["draft_accepted"]]  # fmt: skip
            self._status = message[2]
            self.metrics.batch_size.set(message[2]["running"])
            self.metrics.add_drafts(*drafts)
            return True
        self._end()
        return False

    def _end(self) -> None:
        if self._done.is_set():
            return
        why = "the server is shutting down: the request was not finished" if self._stopping else \
            "the engine process ended unexpectedly; see the server's log"  # fmt: skip
        if not self._stopping:
            print(f"kvcache serve: {why}", file=sys.stderr, flush=True)
        with self._lock:
            self._ended = why
            left, self._requests = list(self._requests.values()), {}
        self._status = {**self._status, "waiting": 0, "prefilling": 0, "running": 0, "batch_cache": 0}
        self._sent = self._status["received"]
        for request in left:
            request.on_event(("unavailable", why))
        self._done.set()

    # ------------------------------------------------------------------------ requests
    def submit(self, request: Request) -> Request:
        with self._lock:
            request.id = f"req-{next(self._ids)}"
            if self._ended is None:
                self._requests[request.id] = request
                request.on_cancel = lambda: self._post(("cancel", request.id))
                try:
                    self._conn.send(("submit", request.id, _fields(request)))
                    self._sent += 1
                    return request
                except (OSError, ValueError) as exc:  # the pipe broke: the reader ends everything
                    self._requests.pop(request.id, None)
                    # (before the reader has seen the pipe close: the same words as it would say)
                    self._ended = self._ended or f"the engine process ended unexpectedly ({exc}); see the server's log"
        request.on_event(("unavailable", self._ended))
        return request

    def finish_early(self, request: Request, reason: str = "stop") -> None:
        """A stop string appeared on the web side: the row leaves at the engine's next step."""
        request.cancelled, request.finish_reason = True, reason
        self._post(("finish", request.id, reason))

    @property
    def active(self) -> dict[str, int]:
        status = self._status
        in_pipe = max(self._sent - status["received"], 0)  # sent, not yet seen by the engine
        return {"waiting": status["waiting"] + in_pipe, "prefilling": status["prefilling"],
                "running": status["running"], "batch_cache": status["batch_cache"]}  # fmt: skip

    @property
    def store_writes_pending(self) -> int:
        return self._status["store_writes_pending"]

    def _post(self, message: tuple, always: bool = False) -> None:
        with self._lock:
            if self._ended is None or always:
                with contextlib.suppress(OSError, ValueError):  # the reader sees the end, answers what is in flight
                    self._conn.send(message)

    def _dispatch(self, events: list[tuple[str, tuple[str, Any], int | None]]) -> None:
        outbox: dict[Any, list] = {}
        now = time.monotonic()
        metrics = self.metrics
        for rid, event, cached in events:
            request = self._requests.get(rid)
            if request is None:
                continue
            if request.first_token_at is None and cached is not None:  # its first event: its lookup's
                request.first_token_at, request.cached_tokens = now, cached
                metrics.prefix_lookups.inc()
                if cached:
                    metrics.prefix_hits.inc()
                    metrics.tokens_reused.inc(cached)
                if event[0] == "token":
                    metrics.time_to_first_token.observe(now - request.created)
            if event[0] == "token":
                metrics.generated_tokens.inc()
            elif event[0] in ENDS:
                request.finish_reason = request.finish_reason or event[1]
                with self._lock:
                    self._requests.pop(rid, None)
            sink = request.on_event
            if isinstance(sink, BatchedSink):
                outbox.setdefault(sink.channel, []).append((sink.target, event))
            else:
                sink(event)
        for channel, items in outbox.items():
            channel.deliver(items)


def _on_thread_of(loop: asyncio.AbstractEventLoop) -> bool:
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False


def _fields(request: Request) -> dict[str, Any]:
    return {"prompt": request.prompt, "max_tokens": request.max_tokens, "sampling": request.sampling,
            "seed": request.seed, "stop_ids": request.stop_ids, "logprobs": request.logprobs,
            "prompt_logprobs": request.prompt_logprobs, "grammar": request.grammar,
            "ignore_eos": request.ignore_eos, "min_tokens": request.min_tokens,
            "prediction": request.prediction}  # fmt: skip


# ------------------------------------------------------------------------------ the child
class _Relay:
    """In the child: requests from the pipe into the engine, each turn's events back."""

    def __init__(self, engine: Any, send: Callable[[tuple], None]) -> None:
        self.engine, self.send = engine, send
        self.requests: dict[str, Request] = {}
        self.received = 0

    def deliver(self, items: list[tuple[Request, tuple[str, Any]]]) -> None:
        """On the engine's thread, once per turn: every row's events in one message."""
        events = []
        for request, event in items:
            looked_up = request.session is not None or request.cached_tokens
            events.append((request.id, event, request.cached_tokens if looked_up else None))
            if event[0] in ENDS:
                self.requests.pop(request.id, None)
        self.send(("events", events, self.status()))

    def status(self) -> dict[str, int]:
        return {**self.engine.active, "received": self.received,
                "store_writes_pending": self.engine.store_writes_pending,
                "draft_tokens": self.engine.drafts[0], "draft_accepted": self.engine.drafts[1]}  # fmt: skip

    def serve(self, conn: Any) -> None:
        """Take the server's messages until it says stop or goes away."""
        while True:
            try:
                message = conn.recv()
            except (EOFError, OSError):  # the server died: end what runs, then exit
                self.engine.stop(5.0)
                return
            kind = message[0]
            if kind == "submit":
                _, rid, fields = message
                request = Request(**fields, id=rid)
                request.on_event = BatchedSink(self, request)
                self.requests[rid] = request
                self.received += 1
                self.engine.submit(request)
            elif kind == "cancel" and (request := self.requests.get(message[1])) is not None:
                request.cancel()
            elif kind == "finish" and (request := self.requests.get(message[1])) is not None:
                self.engine.finish_early(request, message[2])
            elif kind == "stop":
                self.engine.stop(message[1])
                return


def child_main(conn: Any, args: argparse.Namespace, build: Callable[[argparse.Namespace], tuple[Any, Any]]) -> None:
    """The engine process: build the engine as the flags say, serve the pipe, close the store."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the server's shutdown ends this process
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    lock = threading.Lock()

    def send(message: tuple) -> None:
        with lock, contextlib.suppress(OSError, ValueError):  # the server is gone: the relay sees it too
            conn.send(message)

    try:
        _, engine = build(args)
    except KVCacheError as exc:
        send(("failed", exc))
        return
    except Exception as exc:  # a bug or an unusable model: its traceback on stderr, one line to the server
        traceback.print_exc()
        send(("failed", GenerationError(f"{type(exc).__name__}: {exc}")))
        return
    relay = _Relay(engine, send)
    send(("ready", {"store": engine.store.location}))
    engine.start()
    try:
        relay.serve(conn)
    finally:
        engine.store.close()
        send(("stopped", None))
        conn.close()
