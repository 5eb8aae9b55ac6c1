"""`kvcache inspect FILE`: the table, `--json`, and one-line errors with exit status 2."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvcache import (
    Cache,
    DynamicCache,
    EncoderDecoderCache,
    HybridLayer,
    RecurrentLayer,
    SlidingWindowLayer,
    StaticCache,
    StaticLayer,
    save_cache,
)
from kvcache.cli import main


def _cache() -> Cache:
    cache = Cache([SlidingWindowLayer(4), StaticLayer(32), HybridLayer(SlidingWindowLayer(3), RecurrentLayer())])
    cache.activate_past_recording()
    for _ in range(3):
        for idx in range(3):
            keys, values = torch.randn(2, 1, 2, 3, 8, dtype=torch.bfloat16)
            cache.update(keys, values, idx)
    cache.update_recurrent_state(torch.randn(1, 16), 2)
    return cache


@pytest.fixture
def saved(tmp_path: Path) -> Path:
    path = tmp_path / "prompt.safetensors"
    save_cache(_cache(), path, metadata={"model": "tiny-llama", "prompt_tokens": [1, 15043, 29892]})
    return path


def test_table_lists_layers_tensors_totals_and_metadata(saved: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", str(saved)]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0] == f"{saved}: Cache"
    for text in ("SlidingWindowLayer", "StaticLayer", "HybridLayer", '"sliding_window": 4', '"max_cache_len": 32'):
        assert text in out
    # per tensor: name, dtype, shape and bytes computed from them (SlidingWindow(4) keeps 3 + 8 recorded)
    assert any(line.split()[:3] == ["keys", "BF16", "[1,"] and "[1, 2, 9, 8]" in line for line in lines)
    assert any("[1, 2, 9, 8]" in line and line.rstrip().endswith(f"{1 * 2 * 9 * 8 * 2:,d} B") for line in lines)
    assert any(line.split()[:2] == ["recurrent.recurrent.0", "F32"] for line in lines)
    layer_rows = [line.split() for line in lines if line.split()[:1] in (["0"], ["1"], ["2"])]
    assert [row[1:3] for row in layer_rows] == [["SlidingWindowLayer", "9"], ["StaticLayer", "9"], ["HybridLayer", "9"]]
    assert all(row[3] == "yes" for row in layer_rows)
    assert 'model: "tiny-llama"' in out and "prompt_tokens: [1, 15043, 29892]" in out


def test_json_output_matches_the_file(saved: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from safetensors import safe_open

    assert main(["inspect", "--json", str(saved)]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["metadata"] == {"model": "tiny-llama", "prompt_tokens": [1, 15043, 29892]}
    assert summary["cache_class"] == "Cache"
    layers = summary["parts"][0]["layers"]
    assert [layer["class"] for layer in layers] == ["SlidingWindowLayer", "StaticLayer", "HybridLayer"]
    with safe_open(saved, framework="pt") as f:  # independent reader: sizes from the real tensors
        real = {name: f.get_tensor(name) for name in f.keys() if name != "__kvcache_digest__"}  # noqa: SIM118
    listed = {
        f"layers.{layer['index']}.{t['name']}": t for layer in layers for t in layer["tensors"]
    }
    assert set(listed) == set(real)
    for name, tensor in real.items():
        order = listed[name].get("order", list(range(tensor.dim())))
        assert [tensor.shape[order.index(d)] for d in range(tensor.dim())] == listed[name]["shape"]
        assert listed[name]["bytes"] == tensor.nbytes
    assert summary["total_bytes"] == sum(t.nbytes for t in real.values())
    assert summary["num_tensors"] == len(real)


def test_encoder_decoder_and_lazy_static(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cache = EncoderDecoderCache(DynamicCache(), StaticCache(16))
    cache.update(torch.zeros(1, 1, 2, 4), torch.zeros(1, 1, 2, 4), 0)
    cache.cross_attention_cache.update(torch.zeros(1, 1, 5, 4), torch.zeros(1, 1, 5, 4), 0)
    cache.is_updated[0] = True
    path = tmp_path / "ed.safetensors"
    save_cache(cache, path)
    assert main(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    assert "self_attention_cache: DynamicCache (1 layer(s), new layers: DynamicLayer)" in out
    assert "cross_attention_cache: StaticCache (1 layer(s), max_cache_len=16, new layers: StaticLayer)" in out
    assert 'is_updated: {"0": true}' in out
    assert "metadata: (none)" in out


@pytest.mark.parametrize(
    "content",
    [b"", b"not a safetensors file at all", b"\x10\x00\x00\x00\x00\x00\x00\x00{}"],
    ids=["empty", "text", "short"],
)
def test_bad_file_gives_one_line_and_status_2(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "bad.safetensors"
    path.write_bytes(content)
    result = subprocess.run(
        [sys.executable, "-m", "kvcache", "inspect", str(path)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 2
    assert result.stdout == ""
    assert len(result.stderr.strip().splitlines()) == 1
    assert result.stderr.startswith(f"kvcache inspect: error: {path}")
    assert "Traceback" not in result.stderr


def test_truncated_and_missing_files(saved: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = saved.read_bytes()
    saved.write_bytes(data[: len(data) // 2])
    assert main(["inspect", str(saved)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not a valid safetensors file" in err
    assert main(["inspect", str(saved.parent / "absent.safetensors")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "No such file" in err
