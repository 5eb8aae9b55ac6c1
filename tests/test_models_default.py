"""The bundled character-level default model and its tokenizer."""

from __future__ import annotations

import json
import math
import re
import shutil

import pytest
import torch
import torch.nn.functional as F

from kvcache import CacheFormatError, CacheInputError, SlidingWindowLayer
from kvcache.models import CharTokenizer, DecoderLM, default_model_info, load_default_model
from kvcache.models.default import WEIGHTS_DIR

ENGLISH = (
    "The default value of the argument is used when the function is called without it. "
    "If the object has an attribute with that name, the value of the attribute is returned."
)


@pytest.fixture(scope="module")
def default():
    return load_default_model()


def test_weights_ship_in_the_package_and_are_small():
    size = (WEIGHTS_DIR / "default.safetensors").stat().st_size
    assert 100_000 < size <= 3_000_000
    info = default_model_info()
    assert {"config", "alphabet", "recipe", "final_train_loss", "final_val_loss"} <= set(info)


def test_default_model_mixes_full_and_sliding_layers(default):
    model, tokenizer = default
    assert isinstance(model, DecoderLM) and not model.training
    assert model.vocab_size == tokenizer.vocab_size
    cache = model.new_cache()
    assert any(isinstance(layer, SlidingWindowLayer) for layer in cache.layers)
    assert any(not isinstance(layer, SlidingWindowLayer) for layer in cache.layers)


@torch.no_grad()
def test_default_model_has_learned_english(default):
    """Next-character loss on plain English far below the uniform `log(vocab)`, and below the
    unigram entropy of the text itself (what a model that ignores context could reach at best)."""
    model, tokenizer = default
    ids = torch.tensor([tokenizer.encode(ENGLISH)])
    loss = F.cross_entropy(model(ids[:, :-1])[0], ids[0, 1:]).item()
    counts = torch.bincount(ids[0], minlength=tokenizer.vocab_size).float()
    probs = counts[counts > 0] / counts.sum()
    unigram_entropy = -(probs * probs.log()).sum().item()
    assert loss < 0.6 * unigram_entropy < math.log(tokenizer.vocab_size)


@torch.no_grad()
def test_greedy_text_with_cache_equals_recomputation_and_reads_like_english(default):
    model, tokenizer = default
    prompt = "The value of the "
    ids = torch.tensor([tokenizer.encode(prompt)])
    cache = model.new_cache()
    logits = model(ids, cache=cache)
    cached = []
    for _ in range(120):
        nxt = logits[:, -1].argmax(-1, keepdim=True)
        cached.append(int(nxt))
        logits = model(nxt, cache=cache)
    # the independent reference: the full forward over the whole text, no cache
    seq = ids
    for _ in range(120):
        seq = torch.cat([seq, model(seq)[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert cached == seq[0, ids.shape[1] :].tolist()

    text = tokenizer.decode(cached)
    words = re.findall(r"[A-Za-z]{2,}", text)
    from pydoc_data.topics import topics

    known = set(re.findall(r"[A-Za-z]{2,}", " ".join(topics.values())))
    assert len(words) >= 10, text
    assert sum(w in known for w in words) >= 0.8 * len(words), text
    assert sum(ch.isalpha() or ch.isspace() for ch in text) >= 0.7 * len(text), text


def test_tokenizer_round_trip_and_unknown_characters(default):
    _, tokenizer = default
    assert tokenizer.decode(tokenizer.encode(ENGLISH)) == ENGLISH
    assert tokenizer.decode(tokenizer.encode("a\u2603b")) == "a b"  # snowman is not in the alphabet
    with pytest.raises(CacheInputError):
        tokenizer.decode([tokenizer.vocab_size])
    with pytest.raises(CacheInputError):
        CharTokenizer("aab")


def test_corrupt_weights_raise_cache_format_error(tmp_path):
    shutil.copy(WEIGHTS_DIR / "default.json", tmp_path / "default.json")
    (tmp_path / "default.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}")
    with pytest.raises(CacheFormatError):
        load_default_model(weights_dir=tmp_path)
    info = json.loads((WEIGHTS_DIR / "default.json").read_text(encoding="utf-8"))
    info["alphabet"] = info["alphabet"][:-1]
    (tmp_path / "default.json").write_text(json.dumps(info), encoding="utf-8")
    with pytest.raises(CacheFormatError):
        load_default_model(weights_dir=tmp_path)
