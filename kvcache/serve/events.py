"""How the engine's events (tokens, ends, errors) leave its thread: each request's `on_event`.

A `BatchedSink` names a channel and a target; the engine collects a turn's events per channel and
hands them over in one `channel.deliver(items)` call (`Engine._flush`): one wake-up of the web
server's event loop per step (`LoopChannel`), or one message to the server process when the
engine runs in a process of its own (`engine_process`), not one per row and token.
"""

from __future__ import annotations

import asyncio
from typing import Any


class BatchedSink:
    """An `on_event` whose events the engine batches per turn for `channel` (`channel.deliver`
    takes `[(target, event), ...]`). Called directly, it delivers one event at once."""

    def __init__(self, channel: Any, target: Any) -> None:
        self.channel, self.target = channel, target

    def __call__(self, event: tuple[str, Any]) -> None:
        self.channel.deliver([(self.target, event)])


class LoopChannel:
    """The asyncio queues of one event loop (thread-safe): a batch is put into its queues, in
    order, by one call on the loop. Channels of one loop are equal (one batch per loop)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop

    def deliver(self, items: list[tuple[asyncio.Queue, tuple[str, Any]]]) -> None:
        self.loop.call_soon_threadsafe(deliver, items)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, LoopChannel) and other.loop is self.loop

    def __hash__(self) -> int:
        return id(self.loop)


def asyncio_sink(loop: asyncio.AbstractEventLoop, queue: asyncio.Queue) -> BatchedSink:
    """An `on_event` that puts the engine's events into `queue` on `loop`."""
    return BatchedSink(LoopChannel(loop), queue)


def deliver(items: list[tuple[asyncio.Queue, tuple[str, Any]]]) -> None:
    """Run on the loop: put a turn's events into their requests' queues, in order."""
    for queue, event in items:
        queue.put_nowait(event)
