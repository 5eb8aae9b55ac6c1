"""A prefix store's background writer: the encoding, MACs and backend writes of new entries, off
the thread that decodes.

A server's engine captures a chunk's state (a copy) when a row reaches a boundary and hands the
insert to this writer, so a decode step never waits for a serializer, a disk or a Redis round
trip. The queue is bounded in entries and in bytes: when it is full the chunk is not stored (the
request's path in the store ends there, as after a refused insert), and decoding goes on. Inserts
run one at a time in the order they were handed over, so a chunk's parent is written before it.

The engine pauses the writer while it prefills (`paused`): encoding holds the interpreter lock in
long stretches, and a prefill forward's many small operations each wait for it, so a cold
prompt's first token would pay for its own chunks' writing (1.6-1.9x a prefill without a store,
measured). Inserts wait for the pause to end, at most `MAX_PAUSE_S` at a time, so back-to-back
prefills cannot starve the queue; decode steps never pause it.
"""

from __future__ import annotations

import queue
import threading
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager

#: Inserts waiting at most, and their payload bytes at most.
MAX_PENDING, MAX_PENDING_BYTES = 1024, 256 << 20
#: The longest an insert waits for a pause to end (seconds).
MAX_PAUSE_S = 0.25


class StoreWriter:
    """One daemon thread running inserts handed over by `submit`, bounded (see the module docstring)."""

    def __init__(self, max_pending: int = MAX_PENDING, max_bytes: int = MAX_PENDING_BYTES) -> None:
        self.max_bytes = max_bytes
        self._jobs: queue.Queue[tuple[Callable[[], None], int] | None] = queue.Queue(max_pending)
        self._bytes = 0
        self._lock = threading.Lock()
        self.skipped = 0  # inserts refused because the queue was full
        self._running = threading.Event()  # cleared while paused
        self._running.set()
        self._thread = threading.Thread(target=self._run, name="kvcache-store-writer", daemon=True)
        self._thread.start()

    def submit(self, job: Callable[[], None], nbytes: int) -> bool:
        """Queue `job` (an insert of `nbytes` payload bytes); False, and nothing queued, when full."""
        with self._lock:
            if self._bytes + nbytes > self.max_bytes and self._bytes:
                self.skipped += 1
                return False
            try:
                self._jobs.put_nowait((job, nbytes))
            except queue.Full:
                self.skipped += 1
                return False
            self._bytes += nbytes
        return True

    @property
    def pending(self) -> int:
        return self._jobs.qsize()

    @contextmanager
    def paused(self) -> Iterator[None]:
        """No insert starts inside this block (for `MAX_PAUSE_S` at most); one already running finishes."""
        self._running.clear()
        try:
            yield
        finally:
            self._running.set()

    def flush(self, timeout: float | None = None) -> None:
        """Wait until every insert queued so far is done."""
        done = threading.Event()
        self._jobs.put((done.set, 0))  # type: ignore[arg-type]
        done.wait(timeout)

    def close(self, timeout: float | None = 30.0) -> None:
        """Finish the queued inserts (for up to `timeout` seconds) and end the thread."""
        self._jobs.put(None)
        self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            item = self._jobs.get()
            if item is None:
                return
            job, nbytes = item
            self._running.wait(MAX_PAUSE_S)
            try:
                job()
            except Exception:  # a bug in an insert: logged, the writer goes on
                traceback.print_exc()
            finally:
                with self._lock:
                    self._bytes -= nbytes
