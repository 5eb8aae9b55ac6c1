"""How the engine's events (tokens, ends, errors) reach the web side: each request's asyncio
queue, fed on its event loop's thread, one call per loop and engine turn."""

from __future__ import annotations

import asyncio
from typing import Any


class AsyncioSink:
    """An `on_event` that hands the engine's events to `queue` on `loop` (thread-safe). The engine
    collects the events of one turn for every such sink and hands them over in one call per event
    loop (`Engine._flush`): one wake-up of the web server per step, not one per row and token."""

    def __init__(self, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue) -> None:
        self.loop, self.queue = loop, queue

    def __call__(self, event: tuple[str, Any]) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, event)


def asyncio_sink(loop: asyncio.AbstractEventLoop, queue: asyncio.Queue) -> AsyncioSink:
    return AsyncioSink(loop, queue)


def deliver(items: list[tuple[asyncio.Queue, tuple[str, Any]]]) -> None:
    """Run on the loop: put a turn's events into their requests' queues, in order."""
    for queue, event in items:
        queue.put_nowait(event)
