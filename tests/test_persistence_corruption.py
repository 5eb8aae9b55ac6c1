"""Damaged, tampered and foreign files: every one raises `CacheFormatError` saying what is wrong.

Edits to the kvcache description are written with a recomputed SHA-256 and a recomputed xxh3 file
digest, so they reach the validation behind the checksums (a forger, or a bug in another writer,
can do the same: neither is keyed; `test_persistence_integrity` covers the keyed MAC).
"""

from __future__ import annotations

import json
import struct
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import event, given
from hypothesis import strategies as st
from safetensors.torch import save_file

from kvcache import (
    Cache,
    CacheFormatError,
    DynamicCache,
    DynamicLayer,
    EncoderDecoderCache,
    HybridLayer,
    RecurrentLayer,
    SlidingWindowLayer,
    StaticCache,
    StaticLayer,
    load_cache,
    save_cache,
)
from kvcache.persistence.composite import describe_cache
from kvcache.persistence.header import FORMAT_VERSION, _digest
from kvcache.persistence.integrity import DIGEST_TENSOR, FileDigest


def _grow(cache: Any, layers: int, steps: int = 3) -> Any:
    gen = torch.Generator().manual_seed(0)
    for i in range(steps):
        for idx in range(layers):
            layer = cache.layers[idx] if idx < len(cache.layers) else None
            if layer is None or layer.has_attention:
                cache.update(torch.randn(1, 2, 2, 4, generator=gen), torch.randn(1, 2, 2, 4, generator=gen), idx)
            if layer is not None and layer.has_recurrent:
                cache.update_conv_state(torch.randn(1, 3, 2, generator=gen), idx, conv_kernel_size=3)
                cache.update_recurrent_state(torch.randn(1, 5, generator=gen), idx)
        if i == 0:
            cache.activate_past_recording()
    return cache


def mixed_cache() -> Cache:
    """One layer of every kind, recording, with rollback history."""
    hybrid = HybridLayer(DynamicLayer(), RecurrentLayer())
    layers = [DynamicLayer(), SlidingWindowLayer(3), StaticLayer(16), RecurrentLayer(), hybrid]
    return _grow(Cache(layers), 5)


def small_cache() -> DynamicCache:
    return _grow(DynamicCache(["full_attention", "sliding_attention"], sliding_window=3), 2)


@pytest.fixture
def saved(tmp_path: Path) -> Path:
    path = tmp_path / "cache.safetensors"
    save_cache(mixed_cache(), path, metadata={"model": "tiny", "tokens": [5, 6, 7]})
    return path


# ------------------------------------------------------------------------- raw file editing
def split(data: bytes) -> tuple[dict[str, Any], bytes]:
    """(safetensors header as a dict, data section)."""
    (n,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8 : 8 + n]), data[8 + n :]


def join(header: dict[str, Any], body: bytes) -> bytes:
    """A file of `header` and `body`, its whole-file digest (if it has one) recomputed."""
    encoded = json.dumps(header).encode()
    encoded += b" " * (-len(encoded) % 8)
    data = struct.pack("<Q", len(encoded)) + encoded + body
    entry = header.get(DIGEST_TENSOR)
    if isinstance(entry, dict) and entry.get("data_offsets") == [len(body) - 16, len(body)]:
        digest = FileDigest(None)
        digest.update(data[:-16])
        data = data[:-16] + digest.digest()
    return data


def header_digest(meta: dict[str, str]) -> str:
    return _digest(meta["format_version"], meta["cache"], meta["user"], meta.get("integrity"))


def edit_description(path: Path, edit: Callable[[dict[str, Any]], Any], *, redigest: bool = True) -> None:
    """Apply `edit` to the cache description in `path` (in place), keeping the checksum valid.
    An `edit` that returns a `Replacement` replaces the whole description."""
    header, body = split(path.read_bytes())
    meta = header["__metadata__"]
    description = json.loads(meta["cache"])
    result = edit(description)
    meta["cache"] = json.dumps(result.value if isinstance(result, Replacement) else description)
    if redigest:
        meta["sha256"] = header_digest(meta)
    path.write_bytes(join(header, body))


class Replacement:
    def __init__(self, value: Any) -> None:
        self.value = value


def edit_header(path: Path, edit: Callable[[dict[str, Any]], None], *, redigest: bool = True) -> None:
    """Apply `edit` to the whole safetensors header (tensor entries and string metadata)."""
    header, body = split(path.read_bytes())
    edit(header)
    meta = header.get("__metadata__", {})
    if redigest and {"cache", "user", "format_version"} <= set(meta):
        meta["sha256"] = header_digest(meta)
    path.write_bytes(join(header, body))


def expect_format_error(path: Path, match: str) -> CacheFormatError:
    with pytest.raises(CacheFormatError, match=match) as info:
        load_cache(path)
    assert str(path) in str(info.value)  # the message names the file
    return info.value


def test_helpers_reproduce_a_valid_file(saved: Path) -> None:
    """The editing helpers alone (no edit) give a loadable file, so the failures below are the edits'."""
    edit_description(saved, lambda d: None)
    edit_header(saved, lambda h: None)
    cache = load_cache(saved)
    assert json.dumps(describe_cache(cache)[0]) == json.dumps(describe_cache(mixed_cache())[0])


# -------------------------------------------------------------------------- truncation/flips
def test_every_truncation_is_detected(saved: Path) -> None:
    data = saved.read_bytes()
    header_end = 8 + struct.unpack("<Q", data[:8])[0]
    lengths = [*range(64), *range(64, header_end, 5), *range(header_end - 8, header_end + 8)]
    lengths += [*range(header_end + 8, len(data), 61), len(data) - 1]
    for length in lengths:
        saved.write_bytes(data[:length])
        with pytest.raises(CacheFormatError):
            load_cache(saved)
    saved.write_bytes(data + b"\0" * 8)  # trailing bytes no tensor accounts for
    with pytest.raises(CacheFormatError):
        load_cache(saved)


@pytest.mark.parametrize("mask", [0x01, 0x02, 0x20, 0x80])
def test_every_flipped_header_byte_is_detected(tmp_path: Path, mask: int) -> None:
    path = tmp_path / "c.safetensors"
    save_cache(small_cache(), path, metadata={"note": "abc"})
    data = path.read_bytes()
    header_end = 8 + struct.unpack("<Q", data[:8])[0]
    undetected = []
    for pos in range(header_end):
        damaged = bytearray(data)
        damaged[pos] ^= mask
        path.write_bytes(bytes(damaged))
        try:
            load_cache(path)
        except CacheFormatError:
            continue
        undetected.append((pos, data[max(0, pos - 10) : pos + 10]))
    assert not undetected


# ------------------------------------------------------------------------- edited metadata
def _layer(d: dict[str, Any], i: int) -> dict[str, Any]:
    return d["layers"][i]


EDITS: list[tuple[str, Callable[[dict[str, Any]], Any], str]] = [
    ("negative length", lambda d: _layer(d, 0)["meta_state"].update(seq_length=-3), "seq_length"),
    ("length too long", lambda d: _layer(d, 0)["meta_state"].update(seq_length=9), "layer 0"),
    ("length not int", lambda d: _layer(d, 0)["meta_state"].update(seq_length="6"), "seq_length"),
    ("bool length", lambda d: _layer(d, 0)["meta_state"].update(seq_length=True), "seq_length"),
    ("record flag coerced", lambda d: _layer(d, 0)["meta_state"].update(record_past="yes"), "record_past"),
    ("record flag as int", lambda d: _layer(d, 0)["meta_state"].update(record_past=1), "record_past"),
    ("unknown meta key", lambda d: _layer(d, 0)["meta_state"].update(extra=1), "does not rebuild"),
    ("window lengths disagree", lambda d: _layer(d, 1)["meta_state"].update(kept_length=2), "inconsistent"),
    ("window zero", lambda d: _layer(d, 1)["meta_state"].update(sliding_window=0), "sliding_window"),
    ("static overflow", lambda d: _layer(d, 2)["meta_state"].update(max_cache_len=3), "exceeds"),
    ("recurrent steps", lambda d: _layer(d, 3)["meta_state"]["slots"][0]["steps"].pop(), "layer 3"),
    ("hybrid part class", lambda d: _layer(d, 4)["meta_state"]["attention"].update({"class": "Hybrid"}), "layer 4"),
    ("shape disagrees", lambda d: _layer(d, 0)["tensors"]["keys"].update(shape=[1, 2, 5, 4]), "says F32"),
    ("shape not ints", lambda d: _layer(d, 0)["tensors"]["keys"].update(shape=[1, 2, -6, 4]), "shape"),
    ("dtype disagrees", lambda d: _layer(d, 0)["tensors"]["values"].update(dtype="F16"), "F16"),
    ("tensor missing from file", lambda d: _layer(d, 0)["tensors"].update(x={"dtype": "F32", "shape": [1]}), "missing"),
    ("tensor not described", lambda d: _layer(d, 0)["tensors"].pop("values"), "no layer describes|values"),
    ("unknown layer class", lambda d: _layer(d, 0).update({"class": "os.system"}), "unknown layer class 'os.system'"),
    ("layer class not str", lambda d: _layer(d, 0).update({"class": ["DynamicLayer"]}), "unknown layer class"),
    ("unknown cache class", lambda d: d.update({"class": "builtins.eval"}), "unknown cache class"),
    ("layers not list", lambda d: d.update(layers={"0": 1}), "'layers' must be a list"),
    ("layer not object", lambda d: d["layers"].__setitem__(0, 5), "layer 0"),
    ("extra key", lambda d: d.update(pickle="cos\nsystem"), "unexpected keys"),
    ("missing key", lambda d: d.pop("layer_factory"), "missing keys"),
    ("record_new_layers not bool", lambda d: d.update(record_new_layers=1), "record_new_layers"),
    ("factory class", lambda d: d.update(layer_factory={"class": "Nope", "meta_state": {}}), "layer_factory"),
    ("description not object", lambda d: Replacement([d]), "must be a JSON object"),
    ("layer dropped", lambda d: d["layers"].pop(), "no layer describes"),
]


@pytest.mark.parametrize(("edit", "match"), [pytest.param(e, m, id=name) for name, e, m in EDITS])
def test_edited_description_is_refused(saved: Path, edit: Callable[[dict[str, Any]], Any], match: str) -> None:
    edit_description(saved, edit)
    expect_format_error(saved, match)


def test_edits_without_checksum_are_refused(saved: Path) -> None:
    edit_description(saved, lambda d: _layer(d, 1)["meta_state"].update(sliding_window=4), redigest=False)
    expect_format_error(saved, "SHA-256")


def _set_meta(key: str, value: str | None) -> Callable[[dict[str, Any]], None]:
    def edit(header: dict[str, Any]) -> None:
        if value is None:
            del header["__metadata__"][key]
        else:
            header["__metadata__"][key] = value

    return edit


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (_set_meta("format_version", str(FORMAT_VERSION + 1)), "newer"),
        (_set_meta("format_version", "999999999999999999999"), "newer"),
        (_set_meta("format_version", "1.0"), "not a version"),
        (_set_meta("format_version", "0"), "does not exist"),
        (_set_meta("format", "pytorch"), "not a kvcache file"),
        (_set_meta("user", "[1, 2]"), "user metadata must be a JSON object"),
        (_set_meta("user", "{bad json"), "user metadata is not valid JSON"),
        (_set_meta("user", '{"x": NaN}'), "not valid JSON"),
        (_set_meta("cache", "not json"), "cache description is not valid JSON"),
        (_set_meta("cache", "[" * 100000 + "]" * 100000), "not valid JSON"),
        (_set_meta("sha256", None), "missing"),
        (_set_meta("cache", None), "missing"),
        (_set_meta("sha256", "0" * 64), "SHA-256"),
    ],
)
def test_edited_kvcache_metadata_is_refused(saved: Path, edit: Callable[[dict[str, Any]], None], match: str) -> None:
    edit_header(saved, edit, redigest=match not in ("missing", "SHA-256"))
    expect_format_error(saved, match)


def test_tampered_safetensors_entries_are_refused(saved: Path) -> None:
    original = saved.read_bytes()

    def rename(header: dict[str, Any]) -> None:
        header["layers.0.kees"] = header.pop("layers.0.keys")

    def retype(header: dict[str, Any]) -> None:  # same byte size, other dtype
        header["layers.0.keys"]["dtype"] = "I32"

    def reshape(header: dict[str, Any]) -> None:  # same element count, other shape
        shape = header["layers.0.keys"]["shape"]
        header["layers.0.keys"]["shape"] = [shape[0], shape[2], shape[1], shape[3]]

    def offsets(header: dict[str, Any]) -> None:
        header["layers.0.keys"]["data_offsets"][1] += 4

    for edit, match in [(rename, "missing"), (retype, "I32"), (reshape, "says F32"), (offsets, "safetensors")]:
        saved.write_bytes(original)
        edit_header(saved, edit)
        expect_format_error(saved, match)


def test_foreign_safetensors_files_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "plain.safetensors"
    save_file({"weight": torch.zeros(2, 2)}, path)
    expect_format_error(path, "not a kvcache file")
    save_file({"weight": torch.zeros(2, 2)}, path, metadata={"format": "pt"})
    expect_format_error(path, "not a kvcache file")
    save_file({"weight": torch.zeros(2, 2)}, path, metadata={"format": "kvcache"})
    expect_format_error(path, "incomplete")
    for junk in (b"", b"\0" * 7, b"\xff" * 64, b"PK\x03\x04 a zip file", struct.pack("<Q", 2**40) + b"{}"):
        path.write_bytes(junk)
        expect_format_error(path, "not a valid safetensors file")


def test_encoder_decoder_edits_are_refused(tmp_path: Path) -> None:
    cache = EncoderDecoderCache(DynamicCache(), StaticCache(8, num_layers=1))
    cache.update(torch.ones(1, 1, 2, 2), torch.ones(1, 1, 2, 2), 0)
    cache.cross_attention_cache.update(torch.ones(1, 1, 3, 2), torch.ones(1, 1, 3, 2), 0)
    path = tmp_path / "c.safetensors"
    save_cache(cache, path)
    original = path.read_bytes()
    for edit, match in [
        (lambda d: d.update(is_updated={"x": True}), "is_updated"),
        (lambda d: d.update(is_updated={"0": 1}), "is_updated"),
        (lambda d: d.update(cross_attention_cache=dict(d)), "cannot be an EncoderDecoderCache"),
        (lambda d: d["cross_attention_cache"].update(max_cache_len=0), "max_cache_len"),
        (lambda d: d["self_attention_cache"].update({"class": "EncoderDecoderCache"}), "cannot be"),
        (lambda d: d.pop("self_attention_cache"), "missing keys"),
    ]:
        path.write_bytes(original)
        edit_description(path, edit)
        expect_format_error(path, match)


# ------------------------------------------------------------------------------------ fuzz
def _paths(value: Any, prefix: tuple = ()) -> list[tuple]:
    """Every location (key/index path) inside a JSON value."""
    out = [prefix]
    if isinstance(value, dict):
        for key, item in value.items():
            out += _paths(item, (*prefix, key))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            out += _paths(item, (*prefix, i))
    return out


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8) | st.sampled_from(["DynamicLayer", "StaticLayer", "F32", "BF16", "DynamicCache", "Cache"]),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=8,
)


@given(data=st.data())
def test_fuzzed_descriptions_load_exactly_or_raise_format_error(data: st.DataObject) -> None:
    """Replace, delete or add one value anywhere in the description: loading either raises
    `CacheFormatError` or gives a cache that describes itself exactly as the edited file does."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "c.safetensors"
        save_cache(_FUZZ_CACHE, path)
        description = json.loads(split(path.read_bytes())[0]["__metadata__"]["cache"])
        location = data.draw(st.sampled_from(_paths(description)))
        action = data.draw(st.sampled_from(["replace", "delete", "add"]))
        new_value = data.draw(JSON_VALUES)

        def edit(d: dict[str, Any]) -> Any:
            if not location:
                return Replacement(new_value)
            parent = d
            for key in location[:-1]:
                parent = parent[key]
            key = location[-1]
            if action == "delete":
                del parent[key]
            elif action == "add" and isinstance(parent, dict):
                parent[data.draw(st.text(max_size=6))] = new_value
            else:
                parent[key] = new_value

        edit_description(path, edit)
        edited = json.loads(split(path.read_bytes())[0]["__metadata__"]["cache"])
        try:
            loaded = load_cache(path)
        except CacheFormatError:
            event("refused")
            return
        event("loaded")
        assert json.dumps(describe_cache(loaded)[0], sort_keys=True) == json.dumps(edited, sort_keys=True)


_FUZZ_LAYERS = [
    DynamicLayer(),
    SlidingWindowLayer(3),
    StaticLayer(8),
    HybridLayer(SlidingWindowLayer(2), RecurrentLayer()),
]
_FUZZ_CACHE = _grow(Cache(_FUZZ_LAYERS), 4, steps=2)


@given(metadata=st.dictionaries(st.text(max_size=10), JSON_VALUES, max_size=5))
def test_fuzzed_user_metadata_round_trips(metadata: dict[str, Any]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "c.safetensors"
        save_cache(DynamicCache(), path, metadata=metadata)
        assert load_cache(path, return_metadata=True)[1] == metadata


@pytest.mark.parametrize("flag", ["false", 1, None, [True]])
def test_every_attention_layer_refuses_a_record_flag_that_is_not_a_bool(flag: Any) -> None:
    """One check (`record_past_flag`) for every layer kind that keeps keys/values: a string
    "false" would otherwise read as True."""
    from kvcache.errors import CacheInputError
    from kvcache.layers import DynamicLayer, QuantizedLayer, SlidingWindowLayer, StaticLayer, StaticSlidingWindowLayer

    layers = [DynamicLayer(), SlidingWindowLayer(4), StaticLayer(8), StaticSlidingWindowLayer(4, 8), QuantizedLayer(8)]
    for layer in layers:
        layer.update(torch.randn(1, 2, 3, 8), torch.randn(1, 2, 3, 8))
        meta = {**layer.meta_state, "record_past": flag}
        with pytest.raises(CacheInputError, match="'record_past' must be a bool"):
            type(layer).from_state(meta, layer.state)

