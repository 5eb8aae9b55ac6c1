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
