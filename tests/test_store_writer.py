"""The prefix store's background writer: inserts in order, bounded, and paused while the engine
prefills (never for longer than `MAX_PAUSE_S` at a time)."""

from __future__ import annotations

import threading
import time

from kvcache.store import writer as writer_module
from kvcache.store.writer import StoreWriter


def test_inserts_run_in_the_order_they_were_handed_over() -> None:
    writer = StoreWriter()
    done: list[int] = []
    try:
        for i in range(50):
            assert writer.submit(lambda i=i: done.append(i), 1)
        writer.flush(10)
    finally:
        writer.close()
    assert done == list(range(50))


def test_no_insert_starts_while_paused_and_all_run_after() -> None:
    writer = StoreWriter()
    ran = threading.Event()
    try:
        with writer.paused():
            assert writer.submit(ran.set, 1)
            assert not ran.wait(0.1)  # well under MAX_PAUSE_S: still waiting
        assert ran.wait(5)
    finally:
        writer.close()


def test_a_long_pause_does_not_starve_the_queue(monkeypatch) -> None:
    monkeypatch.setattr(writer_module, "MAX_PAUSE_S", 0.05)
    writer = StoreWriter()
    ran = threading.Event()
    try:
        with writer.paused():
            start = time.monotonic()
            assert writer.submit(ran.set, 1)
            assert ran.wait(5)  # ran although the pause goes on
            assert time.monotonic() - start >= 0.04
    finally:
        writer.close()
