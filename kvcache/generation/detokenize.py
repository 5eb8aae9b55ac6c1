"""Text of a growing list of token ids, decoded a few tokens at a time.

Decoding every token list from the start after each new token costs O(n) per token, so O(n^2) per
answer: 0.5 ms a token at 4,096 tokens of a BPE tokenizer, a second of interpreter time for one
long answer, taken from the thread that runs the model. Here each new piece is decoded with the
tokens of the previous piece in front of it, and only what that adds is new text: the context
keeps what depends on a neighbour (a SentencePiece word's leading space, cleaned-up spaces before
punctuation) the same as in a decode of everything. A piece that ends in the middle of a
multi-byte character (`\\ufffd` at its end) is shown without that character and decoded again with
the next token; where the tokenizer says what bytes its tokens stand for (`token_bytes`), exactly
the characters that later bytes can still change wait (`TokenBytes.held`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from ..errors import CacheInputError
from .token_bytes import TokenBytes

#: Tokens kept in front of new ones, at least (a word split over several tokens decodes whole).
CONTEXT_TOKENS = 4


class Detokenizer:
    """`decode`: a token list to text (e.g. `TextModel.decode`); `add(ids)` returns the text so far.
    `token_bytes`: a token's bytes as `decode` reads them (`token_bytes.byte_reader`), or None."""

    def __init__(self, decode: Callable[[list[int]], str], token_bytes: TokenBytes | None = None) -> None:
        if token_bytes is not None and not isinstance(token_bytes, TokenBytes):
            raise CacheInputError(f"token_bytes must be a TokenBytes (token_bytes.byte_reader) or None, got "
                                  f"{type(token_bytes).__name__}")  # fmt: skip
        self.decode, self.token_bytes = decode, token_bytes
        self.tokens: list[int] = []
        self.text = ""  # the text of tokens[: self.read]
        self.context = 0  # tokens[context : read] are decoded again in front of new tokens
        self.read = 0
        self.taken = [0]  # where each taken piece ended: a character boundary, where a context may start

    def add(self, ids: Iterable[int]) -> str:
        """Take `ids`; the text of every token taken so far, less a last character that is still
        cut in two (it waits for its other bytes: only the last replacement character can still
        become another, those before it stand whatever follows)."""
        self.tokens.extend(ids)
        if self.read < len(self.tokens):
            before = self.decode(self.tokens[self.context : self.read])
            after = self.decode(self.tokens[self.context :])
            new = after[len(before) :]
            held = self._held(new)
            if not held:
                self._take(before, after)
            else:  # shown, not taken: the next call decodes these tokens again with what follows
                return self.text + new[: max(len(new) - held, 0)]
        return self.text

    def finish(self) -> str:
        """All the text, an incomplete last character included (the answer ended)."""
        if self.read < len(self.tokens):
            self._take(self.decode(self.tokens[self.context : self.read]), self.decode(self.tokens[self.context :]))
        return self.text

    def _held(self, new: str) -> int:
        """How many last characters of `new` (the untaken tokens' text) may still change (bytes
        unknown: a last replacement character may)."""
        if self.token_bytes is None:
            return int(new.endswith("\ufffd"))
        return self.token_bytes.held(self.tokens[self.read :], new)

    def _take(self, before: str, after: str) -> None:
        # what the new tokens add after their context (by length, as a decode of everything would
        # be sliced: a tokenizer that rewrites its context's text is not undone)
        self.text += after[len(before) :]
        self.read = len(self.tokens)
        self.taken.append(self.read)
        # the context starts where a piece ended, not inside a character: a decoder that decodes
        # runs of byte tokens whole (byte fallback) would read a cut run as invalid
        while len(self.taken) > 1 and self.taken[1] <= self.read - CONTEXT_TOKENS:
            self.taken.pop(0)
        self.context = self.taken[0]
