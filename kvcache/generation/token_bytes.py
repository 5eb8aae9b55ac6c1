"""Which characters of a streamed answer's text may still change, from the bytes its tokens stand
for, where a tokenizer's decoder says: byte-level BPE (GPT-2, Llama 3, Qwen) maps each byte to one
printable character, SentencePiece with byte fallback (Llama 2, Gemma) spells a byte `<0xAB>`.

Only bytes that end inside a character (a lead byte waiting for its continuation bytes) can still
change the text. Byte-level BPE decodes them to one last replacement character; a byte that no
continuation can make valid (a stray continuation byte, 0xF5-0xFF) stands as it is and is shown at
once. Byte fallback decodes a run of byte tokens as a whole, one replacement character per byte
until the run is valid: while the run is open, all of its text waits (a character cut into three
byte tokens would otherwise be shown as a replacement character that the next token turns into
the character). Without the bytes (any other tokenizer) the last replacement character waits for
the next token.
"""

from __future__ import annotations

import codecs
import json
import re
from collections.abc import Callable
from functools import lru_cache
from typing import Any

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@lru_cache(maxsize=1)
def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE's character for each byte, reversed: printable Latin-1 characters stand for
    themselves, the other 68 bytes for the code points from 256 on, in byte order."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    shifted = [b for b in range(256) if b not in kept]
    return {**{chr(b): b for b in kept}, **{chr(256 + i): b for i, b in enumerate(shifted)}}


def _decoder_kinds(backend: Any) -> set[str]:
    try:
        decoder = json.loads(backend.to_str()).get("decoder") or {}
    except (ValueError, AttributeError, TypeError):
        return set()
    parts = decoder.get("decoders") or [] if decoder.get("type") == "Sequence" else [decoder]
    return {part.get("type", "") for part in parts if isinstance(part, dict)}


def _special_ids(tokenizer: Any) -> frozenset[int]:
    if hasattr(tokenizer, "all_special_ids"):  # transformers: its special tokens and added ones marked special
        added = getattr(tokenizer, "added_tokens_decoder", {})
        return frozenset(tokenizer.all_special_ids) | {i for i, token in added.items() if token.special}
    added = tokenizer.get_added_tokens_decoder()  # a `tokenizers.Tokenizer`
    return frozenset(i for i, token in added.items() if token.special)


class TokenBytes:
    """`read(id)`: a token's bytes; `runs`: whether the decoder decodes runs of byte tokens whole
    (byte fallback) rather than byte by byte."""

    def __init__(self, read: Callable[[int], bytes], runs: bool) -> None:
        self.read, self.runs = read, runs

    def held(self, tokens: list[int], text: str) -> int:
        """How many last characters of `text`, the decoded text of `tokens`, may still change."""
        if not text.endswith("\ufffd") or not incomplete(b"".join(map(self.read, tokens))):
            return 0
        return len(text) if self.runs else 1


def byte_reader(tokenizer: Any, skip_special_tokens: bool = False, keep: frozenset[int] = frozenset()
                ) -> TokenBytes | None:  # fmt: skip
    """The `TokenBytes` of `tokenizer` (a transformers fast tokenizer or a `tokenizers.Tokenizer`
    with a byte-level or byte-fallback decoder), or None where the decoder does not say. With
    `skip_special_tokens` (as the text is decoded) a special token stands for no bytes, except
    those of `keep`."""
    backend = getattr(tokenizer, "backend_tokenizer", tokenizer)
    piece_of = getattr(tokenizer, "convert_ids_to_tokens", None) or getattr(tokenizer, "id_to_token", None)
    kinds = _decoder_kinds(backend) if piece_of is not None else set()
    special = _special_ids(tokenizer) - keep if skip_special_tokens and kinds else frozenset()
    if "ByteLevel" in kinds:
        alphabet = _byte_level_alphabet()

        def spelled(piece: str) -> bytes:
            if all(c in alphabet for c in piece):
                return bytes(alphabet[c] for c in piece)
            return piece.encode()  # an added token: decoded as written
    elif "ByteFallback" in kinds:

        def spelled(piece: str) -> bytes:
            byte = _BYTE_TOKEN.fullmatch(piece)
            return bytes([int(byte.group(1), 16)]) if byte else piece.encode()
    else:
        return None

    @lru_cache(maxsize=65536)
    def read(token: int) -> bytes:
        piece = None if token in special else piece_of(int(token))
        return b"" if piece is None else spelled(piece)

    return TokenBytes(read, runs="ByteLevel" not in kinds)


def incomplete(data: bytes) -> bool:
    """Whether `data` ends inside a character that more bytes could still complete (UTF-8)."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    decoder.decode(data, final=False)
    return bool(decoder.getstate()[0])
