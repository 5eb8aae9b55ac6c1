"""`--model ORG/NAME`: a model downloaded into the local Hugging Face cache, named by its hub id as
transformers and vLLM users name it, at `--revision` when given; the same text as its directory,
the hub id as the served model's id, and one-line errors (nothing downloaded) for what is not
there. The cache here is a temporary one laid out as `huggingface_hub` lays it out."""

from __future__ import annotations

from pathlib import Path

import pytest
from serve_kit import ServeProcess, tiny_model_dir

from kvcache.cli import main

pytest.importorskip("transformers", minversion="5.24")
hub_constants = pytest.importorskip("huggingface_hub.constants")

pytestmark = pytest.mark.usefixtures("one_thread")

MAIN = "0123456789abcdef0123456789abcdef01234567"
TAGGED = "fedcba9876543210fedcba9876543210fedcba98"
PROMPT = "The value of the cache"


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Hugging Face cache holding `org/tiny` at two commits: `main`'s (a Llama) and the tag
    `v2`'s (a Gemma 3, so the two answer differently)."""
    root = tmp_path_factory.mktemp("hub")
    repo = root / "models--org--tiny"
    tiny_model_dir(repo / "snapshots" / MAIN, "llama")
    tiny_model_dir(repo / "snapshots" / TAGGED, "gemma3")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(MAIN)
    (repo / "refs" / "v2").write_text(TAGGED)
    return root


@pytest.fixture
def in_cache(hub_cache: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(hub_cache))
    return hub_cache


def generate(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(["generate", *args, PROMPT, "--temperature", "0", "--max-new-tokens", "12", "--device", "cpu"])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_a_hub_id_in_the_cache_prints_what_its_directory_prints(in_cache: Path, capsys) -> None:
    snapshots = in_cache / "models--org--tiny" / "snapshots"
    by_id = generate(capsys, "--model", "org/tiny")
    by_dir = generate(capsys, "--model", str(snapshots / MAIN))
    assert by_id[0] == by_dir[0] == 0 and by_id[1] == by_dir[1]
    tagged = generate(capsys, "--model", "org/tiny", "--revision", "v2")
    tagged_dir = generate(capsys, "--model", str(snapshots / TAGGED))
    assert tagged[0] == 0 and tagged[1] == tagged_dir[1]
    assert tagged[1] != by_id[1]  # (the two commits hold different models)
    assert generate(capsys, "--model", "org/tiny", "--revision", TAGGED)[1] == tagged[1]
    # a draft model by hub id too: the same greedy text
    drafted = generate(capsys, "--model", "org/tiny", "--draft-model", "org/tiny")
    assert drafted[0] == 0 and drafted[1] == by_id[1]


def test_what_is_not_there_is_a_one_line_error(in_cache: Path, capsys, tmp_path: Path) -> None:
    cases = {
        ("--model", "org/missing"): ["org/missing", str(in_cache), "hf download org/missing"],
        ("--model", "org/tiny", "--revision", "v9"): ["revision 'v9'", "--revision v9"],
        ("--model", "org/tiny", "--draft-model", "org/other"): ["--draft-model org/other", "hf download org/other"],
        ("--model", str(tmp_path / "absent")): ["not a directory"],
        ("--model", str(in_cache / "models--org--tiny" / "snapshots" / MAIN), "--revision", "v2"): ["is a directory"],
        ("--revision", "v2"): ["bundled model"],
    }
    for args, words in cases.items():
        code, out, err = generate(capsys, *args)
        assert code != 0 and out == "", args
        assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
        assert all(word in err for word in words), (args, err)


def test_the_server_serves_a_hub_id_under_that_id(hub_cache: Path, tmp_path: Path, capsys, monkeypatch) -> None:
    """The model card and answers name the hub id; the answer is the CLI's for the same model."""
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(hub_cache))
    expected = generate(capsys, "--model", "org/tiny", "--revision", "v2")[1]
    server = ServeProcess("--model", "org/tiny", "--revision", "v2", "--threads", "1", "--speculative", "0",
                          env={"HF_HUB_CACHE": str(hub_cache), "HF_HUB_OFFLINE": "1"})  # fmt: skip
    server.start(tmp_path / "stderr.log")
    try:
        client = server.client()
        assert [card.id for card in client.models.list().data] == ["org/tiny"]
        answer = client.completions.create(model="org/tiny", prompt=PROMPT, max_tokens=12, temperature=0)
        assert answer.model == "org/tiny"
        assert answer.choices[0].text == expected.rstrip("\n")
    finally:
        assert server.terminate() == 0, server.log()
