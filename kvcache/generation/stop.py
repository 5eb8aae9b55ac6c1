"""When to stop decoding: at once (`StopCheck`) or one step late without waiting (`DeferredStopCheck`).

Each step the driver hands the check the per-row "unfinished" flags (on the device, None when
there is no end-of-sequence token) and the step's tokens. `StopCheck` reads the flags right away,
which makes the host wait for the device every step. `DeferredStopCheck` copies them
asynchronously (pinned host memory, an event) and reads them at the next step, while that step's
forward pass is already queued; the step taken past a stop is then undone: its token and score are
dropped by the driver (`finish` says how many steps), its cache entries by `crop(-1)`, and its
random draw by restoring the generator. Tokens are streamed one step late, so the extra token is
never streamed. On devices that run synchronously (CPU) the same code runs with plain copies.
"""

from __future__ import annotations

from typing import Any

import torch

from ..cache import Cache
from .streamers import Streamer

#: Device types whose kernels run asynchronously to the host, where deferring pays.
ASYNC_DEVICE_TYPES = frozenset({"cuda", "mps", "xpu"})


def is_async_device(device: torch.device) -> bool:
    """Whether work queued on `device` runs behind the host's back (so a read would stall)."""
    return device.type in ASYNC_DEVICE_TYPES


def self_attention_layers(cache: Cache) -> list[Any]:
    """The layers that grow with the decoded tokens: all of them, or the self-attention part of
    an `EncoderDecoderCache` (its cross-attention part is written once and never cropped)."""
    return list(getattr(cache, "self_attention_cache", cache).layers)


class StopCheck:
    """Reads the stop decision of each step immediately (one host/device sync per step).

    With `cache` and `commit=True` (the driver started recording for this call) every streamed step
    is committed with `crop(0)`: the cache then keeps one step of history, so an interrupted run
    can be cropped back to exactly what was streamed (`recovery`)."""

    def __init__(self, streamer: Streamer | None = None, *, cache: Cache | None = None, commit: bool = False) -> None:
        self.streamer = streamer
        self.cache = cache
        self.commit = commit

    def before_step(self) -> None:
        """Called before a step picks its tokens (the deferred check snapshots the generator)."""

    def __call__(self, unfinished: torch.Tensor | None, tokens: torch.Tensor, *, last: bool) -> bool:
        """Whether to stop after this step; `last` is True on the final step `max_new_tokens` allows."""
        if self.streamer is not None:
            self.streamer.put(tokens.cpu())
        done = last or (unfinished is not None and not bool(unfinished.any()))
        if not done and self.commit and self.cache is not None:
            self.cache.crop(0)
        return done

    def finish(self) -> int:
        """Flush what is held back; return how many of the last steps the driver must drop."""
        return 0


class _Slot:
    """Host-side landing place of one step's stop flag and tokens, and the event marking arrival."""

    __slots__ = ("done", "event", "rng_state", "tokens")

    def __init__(self, batch_size: int, device: torch.device) -> None:
        pinned = device.type == "cuda" and torch.cuda.is_available()
        self.done = torch.zeros((), dtype=torch.bool, pin_memory=pinned)
        self.tokens = torch.zeros(batch_size, dtype=torch.long, pin_memory=pinned)
        self.event = torch.Event(device=device) if is_async_device(device) else None
        self.rng_state: torch.Tensor | None = None


class DeferredStopCheck(StopCheck):
    """Reads each step's stop decision one step late so the host never waits on the device.

    `cache` (recording, croppable) is rolled back by the extra step when one was taken. With
    `commit=True` (the driver started the recording for this call) every kept step is committed
    with `crop(0)`, so rollback memory stays at one step; the driver turns recording off after.
    `generator` (when sampling) is restored to its state before the extra step.
    """

    def __init__(
        self,
        batch_size: int,
        device: torch.device,
        *,
        cache: Cache | None = None,
        commit: bool = True,
        generator: torch.Generator | None = None,
        streamer: Streamer | None = None,
    ) -> None:
        super().__init__(streamer, cache=cache, commit=commit)
        self.generator = generator
        self.slots = (_Slot(batch_size, device), _Slot(batch_size, device))
        self.step = 0  # steps seen so far; slot `step % 2` receives the current one
        self.stop_reported = False
        self.ended = False

    def before_step(self) -> None:
        if self.generator is not None:
            self.slots[self.step % 2].rng_state = self.generator.get_state()

    def __call__(self, unfinished: torch.Tensor | None, tokens: torch.Tensor, *, last: bool) -> bool:
        current, previous = self.slots[self.step % 2], self.slots[(self.step + 1) % 2]
        if unfinished is not None:
            current.done.copy_(~unfinished.any(), non_blocking=True)
        if self.streamer is not None:
            current.tokens.copy_(tokens, non_blocking=True)
        if current.event is not None:
            current.event.record()
        if self.step > 0:
            if previous.event is not None:
                previous.event.synchronize()  # the previous step's copy, long since queued
            if self.streamer is not None:
                self.streamer.put(previous.tokens.clone())
            if unfinished is not None and bool(previous.done):
                self.stop_reported = True  # this step went one too far; `finish` undoes it
                self.step += 1
                return True
        self.step += 1
        if not last and self.commit and self.cache is not None:
            self.cache.crop(0)  # the step's cache entries are final: keep rollback memory at one step
        return last

    def finish(self) -> int:
        """Undo the extra step (cache, generator) when one was taken, else stream the last step's
        tokens. Returns the number of steps the driver must drop (0 or 1)."""
        if self.ended:
            raise RuntimeError("DeferredStopCheck.finish called twice")
        self.ended = True
        last = self.slots[(self.step + 1) % 2]  # the slot of the final step taken
        if last.event is not None:
            last.event.synchronize()
        undo = 1 if self.stop_reported else 0
        if undo:
            if self.cache is not None:
                self.cache.crop(-1)
            if self.generator is not None and last.rng_state is not None:
                self.generator.set_state(last.rng_state)
        elif self.streamer is not None and self.step > 0:
            self.streamer.put(last.tokens.clone())
        return undo
