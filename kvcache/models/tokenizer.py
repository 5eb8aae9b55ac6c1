"""A character-level tokenizer: one token per character of a fixed alphabet."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from ..errors import CacheInputError


class CharTokenizer:
    """Maps each character of `alphabet` to its index. Characters outside the alphabet become
    `unknown` (which must be in the alphabet), so any prompt can be encoded."""

    eos_token_id: int | None = None  # a character model has no end-of-text token

    def __init__(self, alphabet: str, unknown: str = " ") -> None:
        if len(set(alphabet)) != len(alphabet) or not alphabet:
            raise CacheInputError("alphabet must be a non-empty string of distinct characters")
        if unknown not in alphabet:
            raise CacheInputError(f"unknown character {unknown!r} is not in the alphabet")
        self.alphabet, self.unknown = alphabet, unknown
        self._index = {ch: i for i, ch in enumerate(alphabet)}

    @classmethod
    def from_text(cls, text: str, unknown: str = " ") -> CharTokenizer:
        """The tokenizer whose alphabet is the sorted set of characters in `text`."""
        return cls("".join(sorted(set(text) | {unknown})), unknown)

    @property
    def vocab_size(self) -> int:
        return len(self.alphabet)

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, one per character."""
        fallback = self._index[self.unknown]
        return [self._index.get(ch, fallback) for ch in text]

    def unknown_characters(self, text: str) -> list[str]:
        """The distinct characters of `text` outside the alphabet (each encodes as `unknown`), in order."""
        return list(dict.fromkeys(ch for ch in text if ch not in self._index))

    def decode(self, ids: Iterable[int] | Sequence[int]) -> str:
        """The text of token ids (an out-of-range id is an error)."""
        chars = []
        for i in ids:
            i = int(i)
            if not 0 <= i < len(self.alphabet):
                raise CacheInputError(f"token id {i} out of range for a vocabulary of {len(self.alphabet)}")
            chars.append(self.alphabet[i])
        return "".join(chars)

    def __call__(self, text: str) -> list[int]:
        return self.encode(text)
