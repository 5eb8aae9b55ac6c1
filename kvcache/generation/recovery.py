"""What `generate` leaves behind when it is interrupted (an exception from the model or the
streamer, Ctrl-C): a cache that is committed, not recording, and consistent with what the caller
has seen.

"Consistent" means the cache holds a prefix of `prompt + streamed tokens` without its last token,
so that `generate(model, prompt + streamed, cache=cache)` continues correctly (it feeds whatever
the cache lacks). The preferred point is exactly that sequence but its last token; when the layers
cannot be cropped back to it (a step already committed, a layer that cannot roll back), the cache
goes back to what it held on entry, and failing that it is emptied. Emptying is always possible
and always consistent.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..cache import Cache
from ..errors import RollbackError
from .stop import self_attention_layers
from .streamers import Streamer


class StreamCounter:
    """The caller's streamer, counting the steps it accepted and noting whether it raised."""

    def __init__(self, streamer: Streamer) -> None:
        self.streamer, self.accepted, self.raised = streamer, 0, False

    def put(self, tokens: torch.Tensor) -> None:
        try:
            self.streamer.put(tokens)
        except BaseException:
            self.raised = True
            raise
        self.accepted += 1

    def end(self) -> None:
        self.streamer.end()


def _crop_to(layers: Sequence[Any], target: int) -> bool:
    """Crop every layer back to `target` tokens if every one can get there exactly; else change nothing."""
    amounts = [layer.get_seq_length() - target for layer in layers]
    if any(n < 0 for n in amounts):
        return False
    try:
        for layer, n in zip(layers, amounts, strict=True):
            if n:
                layer.check_crop(-n)
    except RollbackError:
        return False
    for layer, n in zip(layers, amounts, strict=True):
        if n:
            layer.crop(-n)
    return True


def recover(cache: Any, targets: Sequence[int], recording_on_entry: list[bool]) -> None:
    """Bring `cache` to the first of `targets` (token counts) that every layer can reach exactly,
    else empty it; then commit and stop recording as `generate` always leaves it."""
    layers = self_attention_layers(cache)
    if not any(_crop_to(layers, target) for target in targets):
        for layer in layers:
            layer.reset()
    settle(cache, recording_on_entry)


def settle(cache: Cache, recording_on_entry: list[bool]) -> None:
    """Leave the cache as both stop checks do: layers that were recording on entry keep their
    history; all others are committed (`crop(0)`) and not recording."""
    for i, layer in enumerate(self_attention_layers(cache)):
        if i < len(recording_on_entry) and recording_on_entry[i]:
            continue
        if layer.record_past:
            layer.record_past = False
        else:
            layer.crop(0)
