"""`kvcache.progress.Progress`: a tqdm bar on a terminal, periodic plain lines otherwise, silence
for short work and when disabled."""

from __future__ import annotations

import io

from kvcache import progress
from kvcache.progress import Progress


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_plain_lines_come_at_most_every_period(monkeypatch) -> None:
    stream = io.StringIO()
    with Progress(100, "prefill", unit="tok", stream=stream) as p:
        for _ in range(10):
            p.update(10)
    assert stream.getvalue() == ""  # a short run: nothing at all
    monkeypatch.setattr(progress, "LINE_EVERY_S", 0.0)
    with Progress(100, "prefill", unit="tok", stream=stream) as p:
        for _ in range(4):
            p.update(25)
    lines = stream.getvalue().splitlines()
    assert len(lines) == 4 and lines[-1].startswith("prefill: 100/100 tok (100%)") and "tok/s" in lines[-1]


def test_a_terminal_gets_a_bar_and_disabled_progress_prints_nothing(monkeypatch) -> None:
    monkeypatch.setattr(progress, "BAR_DELAY_S", 0.0)
    terminal = Terminal()
    with Progress(10, "store", unit="chunk", stream=terminal) as p:
        p.update(10)
    assert terminal.getvalue().startswith("\rstore:") and "|" in terminal.getvalue()  # tqdm's bar, then cleared
    quiet = Terminal()
    monkeypatch.setattr(progress, "LINE_EVERY_S", 0.0)
    with Progress(10, "store", enabled=False, stream=quiet) as p:
        p.update(10)
    assert quiet.getvalue() == "" and p.done == 10
