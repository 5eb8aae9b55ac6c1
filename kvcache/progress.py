"""Progress of long work on stderr: a tqdm bar on a terminal, a periodic line otherwise.

A prefill of a long prompt or the maintenance of a large prefix store can take minutes; a user
must see that something moves. On a terminal tqdm draws (and clears) a bar; when stderr is a file
or a pipe (a log, CI) a plain line is printed at most every `LINE_EVERY_S` seconds, and nothing at
all for work that ends sooner than that, so short runs stay quiet in both cases.
"""

from __future__ import annotations

import sys
import time
from types import TracebackType
from typing import IO, Any

#: Seconds between two plain progress lines (stderr not a terminal), and before the first one.
LINE_EVERY_S = 5.0
#: A bar appears only for work still running after this many seconds (tqdm's `delay`).
BAR_DELAY_S = 0.5


class Progress:
    """`with Progress(total, "prefill", unit="tok") as p: ... p.update(n)`.

    `enabled=False` makes every call a no-op (library callers that want silence); `stream`
    defaults to `sys.stderr`, read when the work starts.
    """

    def __init__(self, total: int | None, description: str, *, unit: str = "it", enabled: bool = True,
                 stream: IO[str] | None = None) -> None:  # fmt: skip
        self.total, self.description, self.unit, self.enabled = total, description, unit, enabled
        self.stream = stream
        self.done = 0
        self._bar: Any = None
        self._started = self._last_line = 0.0

    def __enter__(self) -> Progress:
        if not self.enabled:
            return self
        stream = self.stream if self.stream is not None else sys.stderr
        self.stream = stream
        self._started = self._last_line = time.monotonic()
        if getattr(stream, "isatty", lambda: False)():
            from tqdm import tqdm

            self._bar = tqdm(total=self.total, desc=self.description, unit=self.unit, file=stream,
                             delay=BAR_DELAY_S, leave=False, unit_scale=True, dynamic_ncols=True)  # fmt: skip
        return self

    def update(self, n: int) -> None:
        """`n` more units done."""
        self.done += n
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.update(n)
            return
        now = time.monotonic()
        if now - self._last_line >= LINE_EVERY_S:
            self._last_line = now
            self._line(now)

    def _line(self, now: float) -> None:
        elapsed = now - self._started
        rate = self.done / elapsed if elapsed > 0 else 0.0
        of = f"/{self.total:,}" if self.total is not None else ""
        percent = f" ({self.done / self.total:.0%})" if self.total else ""
        print(f"{self.description}: {self.done:,}{of} {self.unit}{percent}, {rate:,.0f} {self.unit}/s, "
              f"{elapsed:.0f} s", file=self.stream, flush=True)  # fmt: skip

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None, tb: TracebackType | None) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
