"""Streamers: receive each generated step's tokens as soon as the driver knows they are final."""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import Any, Protocol, TextIO, runtime_checkable

import torch

from .detokenize import Detokenizer
from .token_bytes import byte_reader


@runtime_checkable
class Streamer(Protocol):
    """What `generate(streamer=...)` calls: `put` once per kept step with that step's tokens
    (a CPU tensor `[batch]`), then `end` once. The prompt is not streamed."""

    def put(self, token_ids: torch.Tensor) -> None: ...

    def end(self) -> None: ...


class TokenCollector:
    """A streamer that keeps every step's tokens: `steps` is a list of `[batch]` lists."""

    def __init__(self) -> None:
        self.steps: list[list[int]] = []
        self.ended = 0

    def put(self, token_ids: torch.Tensor) -> None:
        self.steps.append([int(t) for t in token_ids.reshape(-1).tolist()])

    def end(self) -> None:
        self.ended += 1


def _bytes_of(tokenizer: Any) -> Any:
    """A token's bytes for the detokenizer: a `TextModel` says (`token_bytes`), a transformers
    tokenizer may (`byte_reader`)."""
    if hasattr(tokenizer, "token_bytes"):
        return tokenizer.token_bytes
    return byte_reader(tokenizer)


class TextStreamer:
    """Prints the decoded text of a single sequence (batch size 1) as its tokens arrive.

    Decodes the generated text as it grows and prints what is new, holding back what later bytes
    can still change (a multi-byte character cut between tokens: `Detokenizer`).
    Tokens in `skip_token_ids` (e.g. end of sequence) are not printed.
    """

    def __init__(self, tokenizer: Any, *, file: TextIO | None = None, skip_token_ids: Iterable[int] = ()) -> None:
        self.tokenizer = tokenizer
        self.file = file
        self.skip = {int(t) for t in skip_token_ids}
        self.detokenizer = Detokenizer(tokenizer.decode, _bytes_of(tokenizer))
        self.printed = 0

    @property
    def token_ids(self) -> list[int]:
        """The ids streamed so far (since the last `end`)."""
        return self.detokenizer.tokens

    def put(self, token_ids: torch.Tensor) -> None:
        ids = token_ids.reshape(-1).tolist()
        if len(ids) != 1:
            raise ValueError(f"TextStreamer streams one sequence, got a batch of {len(ids)}")
        if ids[0] not in self.skip:
            self._emit(self.detokenizer.add([int(ids[0])]))

    def end(self) -> None:
        self._emit(self.detokenizer.finish())
        out = self.file if self.file is not None else sys.stdout
        out.write("\n")
        out.flush()
        self.detokenizer, self.printed = Detokenizer(self.tokenizer.decode, _bytes_of(self.tokenizer)), 0

    def _emit(self, text: str) -> None:
        if len(text) > self.printed:
            out = self.file if self.file is not None else sys.stdout
            out.write(text[self.printed :])
            out.flush()
            self.printed = len(text)
