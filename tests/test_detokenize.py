"""`Detokenizer` against the independent reference: one decode of every token so far.

Token lists are random (hypothesis), fed in random pieces, for a byte-level BPE tokenizer whose
single-byte tokens cut characters in two (random ids make invalid UTF-8 too), a SentencePiece-style
one (a word's leading space depends on what is before it) and the bundled character-level model.
What is streamed must never be taken back, and at the end it must be the decode of everything.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcache import CacheInputError
from kvcache.generation.detokenize import Detokenizer

TEXT = ["The value of the cache is the sum of its tokens. ", "Größe: 5 €, 日本語のテキスト, naïve café. "] * 3


def _byte_level():
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import decoders, models, pre_tokenizers, trainers

    bpe = tokenizers.Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    bpe.train_from_iterator(TEXT, trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "<s>"],
                                                      initial_alphabet=alphabet))  # fmt: skip
    return bpe


def _metaspace():
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import decoders, models, pre_tokenizers, trainers

    sp = tokenizers.Tokenizer(models.BPE(unk_token="<unk>"))
    sp.pre_tokenizer = pre_tokenizers.Metaspace()
    sp.decoder = decoders.Metaspace()
    sp.train_from_iterator(TEXT, trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>", "<s>"]))
    return sp


def _bundled():
    from kvcache.models import load_default_model

    return load_default_model()[1]


TOKENIZERS = {"byte-level BPE": _byte_level, "metaspace": _metaspace, "bundled": _bundled}
_loaded: dict = {}


def tokenizer(name: str):
    if name not in _loaded:
        _loaded[name] = TOKENIZERS[name]()
    return _loaded[name]


def decoder(name: str):
    tok = tokenizer(name)
    if name == "bundled":
        return tok.decode, tok.vocab_size
    return (lambda ids: tok.decode(ids, skip_special_tokens=True)), tok.get_vocab_size()


@pytest.mark.parametrize("name", list(TOKENIZERS))
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_streamed_text_is_the_decode_of_everything(name: str, data) -> None:
    decode, vocab = decoder(name)
    ids = data.draw(st.lists(st.integers(0, vocab - 1), max_size=60))
    if data.draw(st.booleans()) and name != "bundled":  # real text too, not only random ids
        tok = tokenizer(name)
        ids = tok.encode(data.draw(st.sampled_from(TEXT)) * 2).ids[: len(ids) + 5]
    detokenizer, shown = Detokenizer(decode), ""
    at = 0
    while at < len(ids):
        n = data.draw(st.integers(1, 4))
        text = detokenizer.add(ids[at : at + n])
        at += n
        assert text.startswith(shown)  # nothing streamed is taken back
        assert decode(ids[:at]).startswith(text.rstrip("\ufffd")) or "\ufffd" in decode(ids[:at])
        shown = text
    final = detokenizer.finish()
    assert final.startswith(shown) and final == decode(ids)


def test_a_character_cut_in_two_waits_for_its_second_half() -> None:
    tok = tokenizer("byte-level BPE")
    decode = lambda ids: tok.decode(ids, skip_special_tokens=True)  # noqa: E731
    euro = [tok.token_to_id(piece) for piece in ("â", "Ĥ", "¬")]  # the bytes E2 82 AC of "€" (byte-level alphabet)
    assert decode(euro) == "€"
    detokenizer = Detokenizer(decode)
    assert detokenizer.add(tok.encode("5 ").ids) == "5 "
    assert detokenizer.add(euro[:1]) == "5 " and detokenizer.add(euro[1:2]) == "5 "
    assert detokenizer.add(euro[2:]) == "5 €"


def test_decoding_work_per_token_is_flat_in_the_answer_length() -> None:
    """The O(n)-per-token decode this replaces: count the tokens each decode call is given."""
    decode, vocab = decoder("bundled")
    given_tokens = []
    detokenizer = Detokenizer(lambda ids: given_tokens.append(len(ids)) or decode(ids))
    for i in range(2000):
        detokenizer.add([i % (vocab - 1) + 1])
    assert max(given_tokens) <= 8
    assert detokenizer.finish() == decode([i % (vocab - 1) + 1 for i in range(2000)])


def test_replacement_characters_that_cannot_change_are_shown_at_once() -> None:
    """Bytes that form no character (a model's garbage) decode to U+FFFD; only the last one could
    still become part of a character, so each new token shows the one before it."""
    tok = tokenizer("byte-level BPE")
    decode = lambda ids: tok.decode(ids, skip_special_tokens=True)  # noqa: E731
    lone = tok.token_to_id("Ģ")  # the byte 0x80: a continuation byte without a lead
    detokenizer = Detokenizer(decode)
    shown = [detokenizer.add([lone]) for _ in range(5)]
    assert shown == ["\ufffd" * n for n in range(5)]
    assert detokenizer.finish() == decode([lone] * 5) == "\ufffd" * 5


def _byte_fallback():
    """A SentencePiece-style tokenizer with byte fallback (Llama 2, Gemma): a character outside its
    vocabulary is spelled as `<0xAB>` tokens, one per UTF-8 byte."""
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import decoders, models, pre_tokenizers

    pieces = ["<unk>", "<s>", *(f"<0x{b:02X}>" for b in range(256)), "▁", *"Thevalusmofitcnk.", "▁the", "▁value"]
    sp = tokenizers.Tokenizer(models.BPE({p: i for i, p in enumerate(pieces)}, [], unk_token="<unk>",
                                         byte_fallback=True))  # fmt: skip
    sp.pre_tokenizer = pre_tokenizers.Metaspace()
    sp.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                    decoders.Strip(" ", 1, 0)])  # fmt: skip
    return sp


def _pending(data: bytes) -> bool:
    """The reference for a character still open: Python's own incremental UTF-8 decoder holds it."""
    import codecs

    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    decoder.decode(data, final=False)
    return bool(decoder.getstate()[0])


@settings(max_examples=80, deadline=None)
@given(data=st.data())
def test_token_bytes_read_as_the_tokenizer_decodes(data) -> None:
    """`byte_reader` against the tokenizers' own decoders: for byte-level BPE the bytes of any
    token list (random ids: invalid UTF-8 as often as not), decoded with replacement characters,
    are its decoded text; for byte fallback the bytes of any text's tokens are the text's UTF-8."""
    from kvcache.generation.token_bytes import byte_reader

    tok = tokenizer("byte-level BPE")
    read = byte_reader(tok, skip_special_tokens=True)
    ids = data.draw(st.lists(st.integers(0, tok.get_vocab_size() - 1), max_size=40))
    assert b"".join(map(read.read, ids)).decode("utf-8", "replace") == tok.decode(ids, skip_special_tokens=True)
    sp = _byte_fallback()
    text = data.draw(st.text(alphabet="thevalu .€日本語é😀", max_size=20))
    ids = sp.encode(text).ids
    spelled = b"".join(map(byte_reader(sp).read, ids)).decode().replace("▁", " ")
    assert spelled.removeprefix(" ") == sp.decode(ids)  # (the decoder strips one leading space)


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_with_token_bytes_only_what_may_still_change_waits(data) -> None:
    """Streamed with the tokens' bytes, byte-level BPE: the text after every piece is the decode of
    everything so far, less its last character exactly while that character's bytes may still be
    completed (Python's incremental UTF-8 decoder says which): a replacement character nothing can
    change is shown at once. Byte fallback, on text whose characters are spelled in byte tokens:
    nothing shown is taken back, and every piece is a prefix of the whole text."""
    from kvcache.generation.token_bytes import byte_reader

    tok = tokenizer("byte-level BPE")
    decode = lambda ids: tok.decode(ids, skip_special_tokens=True)  # noqa: E731
    read = byte_reader(tok, skip_special_tokens=True)
    ids = data.draw(st.lists(st.integers(0, tok.get_vocab_size() - 1), max_size=50))
    detokenizer, at = Detokenizer(decode, read), 0
    while at < len(ids):
        n = data.draw(st.integers(1, 3))
        text = detokenizer.add(ids[at : at + n])
        at = min(at + n, len(ids))
        whole = decode(ids[:at])
        assert text == (whole[:-1] if _pending(b"".join(map(read.read, ids[:at]))) else whole)
    assert detokenizer.finish() == decode(ids)
    sp = _byte_fallback()
    ids = sp.encode(data.draw(st.text(alphabet="thevalu .€日本語é😀", max_size=20))).ids
    detokenizer, shown, at = Detokenizer(sp.decode, byte_reader(sp)), "", 0
    while at < len(ids):
        n = data.draw(st.integers(1, 3))
        text = detokenizer.add(ids[at : at + n])
        at = min(at + n, len(ids))
        assert text.startswith(shown) and sp.decode(ids).startswith(text)
        shown = text
    assert detokenizer.finish() == sp.decode(ids)


def test_a_byte_no_continuation_can_complete_is_shown_with_its_token() -> None:
    """Lone continuation bytes (what a random model writes) stand as replacement characters: with
    the tokens' bytes each one is shown with its own token, not one token later; a lead byte still
    waits for the bytes of its character, and one that meets a byte it cannot take is shown."""
    from kvcache.generation.token_bytes import byte_reader

    tok = tokenizer("byte-level BPE")
    decode = lambda ids: tok.decode(ids, skip_special_tokens=True)  # noqa: E731
    read = byte_reader(tok, skip_special_tokens=True)
    lone = tok.token_to_id("Ģ")  # 0x80
    detokenizer = Detokenizer(decode, read)
    assert [detokenizer.add([lone]) for _ in range(3)] == ["\ufffd" * n for n in range(1, 4)]
    euro = [tok.token_to_id(piece) for piece in ("â", "Ĥ", "¬")]  # E2 82 AC
    assert detokenizer.add(euro[:1]) == "\ufffd" * 3 and detokenizer.add(euro[1:2]) == "\ufffd" * 3
    assert detokenizer.add(euro[2:]) == "\ufffd" * 3 + "€"
    assert detokenizer.add(euro[:1]) == "\ufffd" * 3 + "€"  # E2 waits ...
    assert detokenizer.add(tok.encode("5").ids) == "\ufffd" * 3 + "€\ufffd5"  # ... and cannot take "5"
    sp = _byte_fallback()
    spelled = [sp.token_to_id(f"<0x{b:02X}>") for b in "€".encode()]  # byte fallback: one token a byte
    for reader in (byte_reader(sp), None):  # with the bytes; without (only a last character waits)
        fallback = Detokenizer(sp.decode, reader)
        shown = [fallback.add([token]) for token in spelled]
        assert shown == (["", "", "€"] if reader else ["", "\ufffd", "€"])  # without: "€" streams as U+FFFD
    assert byte_reader(tokenizer("metaspace")) is None and byte_reader(tokenizer("bundled")) is None
    with pytest.raises(CacheInputError, match="token_bytes must be a TokenBytes"):
        Detokenizer(decode, read.read)  # the function alone, not what byte_reader returns


def test_text_streamer_prints_characters_spelled_in_byte_tokens_whole() -> None:
    """What `generate` prints as tokens arrive: an emoji and a euro sign spelled in byte-fallback
    tokens come out as themselves (before, as U+FFFD that the later tokens could not take back)."""
    import io

    import torch

    from kvcache.generation.streamers import TextStreamer

    sp = _byte_fallback()
    out = io.StringIO()
    streamer = TextStreamer(sp, file=out)
    for token in sp.encode("the 😀 € value").ids:
        streamer.put(torch.tensor([token]))
    streamer.end()
    assert out.getvalue() == sp.decode(sp.encode("the 😀 € value").ids) + "\n" == "the 😀 € value\n"
