"""`--model FILE.gguf`: a llama.cpp model file (Q8_0 weights, its tokenizer and chat template in the
metadata), read through transformers' GGUF loader, prints what transformers' greedy `generate`
gives on the same file, plain and as a chat, and the server answers the same under the file's
name. Its tokenizer has no unknown token (as Qwen's has none), which the special-token handling
must take."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from gguf_kit import llama_gguf
from hf_reference import greedy_text
from serve_kit import ServeProcess

from kvcache.cli import main

transformers = pytest.importorskip("transformers", minversion="5.24")
pytest.importorskip("gguf")

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT = "The value of the cache"
NEW = 12


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return llama_gguf(tmp_path_factory.mktemp("gguf") / "tiny-q8_0.gguf")


def transformers_text(where: Path, chat: bool) -> str:
    model = transformers.AutoModelForCausalLM.from_pretrained(where.parent, gguf_file=where.name)
    tokenizer = transformers.AutoTokenizer.from_pretrained(where.parent, gguf_file=where.name)
    assert tokenizer.unk_token_id is None
    return greedy_text(model, tokenizer, PROMPT, NEW, chat)


def generate(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(["generate", *args, "--temperature", "0", "--max-new-tokens", str(NEW), "--device", "cpu"])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.parametrize("chat", [False, True], ids=["plain", "chat"])
def test_a_gguf_file_prints_what_transformers_generate_gives(gguf_file: Path, capsys, chat: bool) -> None:
    code, out, err = generate(capsys, "--model", str(gguf_file), PROMPT, *(["--chat"] if chat else []))
    assert code == 0, err
    assert out.rstrip("\n") == transformers_text(gguf_file, chat)


def test_the_server_serves_a_gguf_file_under_its_name(gguf_file: Path, tmp_path: Path, capsys) -> None:
    expected = generate(capsys, "--model", str(gguf_file), PROMPT)[1].rstrip("\n")
    server = ServeProcess("--model", str(gguf_file), "--threads", "1", "--speculative", "0")
    server.start(tmp_path / "stderr.log")
    try:
        client = server.client()
        assert client.models.list().data[0].id == gguf_file.name
        answer = client.completions.create(model=gguf_file.name, prompt=PROMPT, max_tokens=NEW, temperature=0)
        assert answer.choices[0].text == expected
        # the path as given names it too (vLLM's default id)
        assert client.completions.create(model=str(gguf_file), prompt=PROMPT, max_tokens=1).model == gguf_file.name
    finally:
        assert server.terminate() == 0, server.log()


def test_what_cannot_be_read_is_a_one_line_error(gguf_file: Path, capsys, tmp_path: Path, monkeypatch) -> None:
    other = tmp_path / "weights.bin"
    other.write_bytes(b"\0" * 64)
    cases = {
        ("--model", str(gguf_file), "--revision", "main"): "is a file",
        ("--model", str(other)): "not a .gguf model",
    }
    for args, words in cases.items():
        code, out, err = generate(capsys, *args, PROMPT)
        assert code != 0 and out == "" and len(err.strip().splitlines()) == 1 and words in err, (args, err)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else real(name, *a))
    code, out, err = generate(capsys, "--model", str(gguf_file), PROMPT)
    assert code != 0 and 'pip install "kvcache[gguf]"' in err and len(err.strip().splitlines()) == 1, err


def test_another_tokenizer_runs_with_the_file(gguf_file: Path, capsys, tmp_path: Path) -> None:
    """vLLM's `--tokenizer`: the original model's tokenizer with the GGUF file's weights prints what
    transformers' `generate` gives with that pair; a tokenizer whose ids the model lacks is refused."""
    source = gguf_file.parent / f"{gguf_file.stem}-source"  # (the directory gguf_kit converted)
    code, out, err = generate(capsys, "--model", str(gguf_file), "--tokenizer", str(source), PROMPT)
    assert code == 0, err
    model = transformers.AutoModelForCausalLM.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
    assert out.rstrip("\n") == greedy_text(model, transformers.AutoTokenizer.from_pretrained(source), PROMPT, NEW)
    wide = transformers.AutoTokenizer.from_pretrained(source)
    wide.add_tokens([f"<extra_{i}>" for i in range(400)])  # ids past the model's 300
    wide.save_pretrained(tmp_path / "wide")
    capsys.readouterr()  # (transformers' own progress bars above)
    for args, words in (((str(tmp_path / "wide"),), "past the 300 tokens"), ((str(tmp_path / "none"),), "--tokenizer")):
        code, out, err = generate(capsys, "--model", str(gguf_file), "--tokenizer", *args, PROMPT)
        assert code != 0 and out == "" and len(err.strip().splitlines()) == 1 and words in err, err
    code, _, err = generate(capsys, "--tokenizer", str(source), PROMPT)
    assert code != 0 and "--tokenizer is for --model" in err
