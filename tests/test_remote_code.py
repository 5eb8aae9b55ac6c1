"""`--trust-remote-code`: a model directory whose config names modeling code of its own (config.json's
`auto_map`) runs that code only with the flag, and then prints what transformers' greedy
`generate` gives with `trust_remote_code=True`; without it, a one-line error naming the flag (and
never transformers' interactive question)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from hf_reference import greedy_text
from serve_kit import tiny_model_dir

from kvcache.cli import main

transformers = pytest.importorskip("transformers", minversion="5.24")

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPT = "The value of the cache"
NEW = 12
CONFIGURATION = """from transformers import LlamaConfig


class OwnConfig(LlamaConfig):
    model_type = "kvcache_test_own"
"""
#: its own code: Llama whose logits are negated, so its greedy text is not Llama's
MODELING = """from transformers import LlamaForCausalLM

from .configuration_own import OwnConfig


class OwnForCausalLM(LlamaForCausalLM):
    config_class = OwnConfig

    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        out.logits = -out.logits
        return out
"""


@pytest.fixture(scope="module")
def own_code_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    where = tiny_model_dir(tmp_path_factory.mktemp("remote") / "own_code_model", "llama")
    (where / "configuration_own.py").write_text(CONFIGURATION)
    (where / "modeling_own.py").write_text(MODELING)
    config = json.loads((where / "config.json").read_text())
    config.update(model_type="kvcache_test_own", architectures=["OwnForCausalLM"],
                  auto_map={"AutoConfig": "configuration_own.OwnConfig",
                            "AutoModelForCausalLM": "modeling_own.OwnForCausalLM"})  # fmt: skip
    (where / "config.json").write_text(json.dumps(config))
    return where


def transformers_text(where: Path) -> str:
    model = transformers.AutoModelForCausalLM.from_pretrained(where, trust_remote_code=True)
    return greedy_text(model, transformers.AutoTokenizer.from_pretrained(where, trust_remote_code=True), PROMPT, NEW)


def test_own_modeling_code_runs_with_the_flag_as_transformers_runs_it(own_code_dir: Path, capsys) -> None:
    args = ["generate", "--model", str(own_code_dir), PROMPT, "--temperature", "0", "--max-new-tokens", str(NEW),
            "--device", "cpu", "--trust-remote-code"]  # fmt: skip
    assert main(args) == 0
    printed = capsys.readouterr().out
    expected = transformers_text(own_code_dir)
    assert printed.rstrip("\n") == expected
    plain = tiny_model_dir(own_code_dir.parent / "plain", "llama")  # the same weights without the code
    assert main([*args[:2], str(plain), *args[3:-1]]) == 0
    assert capsys.readouterr().out.rstrip("\n") != expected  # (so the code above did run)


def test_without_the_flag_it_is_a_one_line_error_and_nothing_is_asked(own_code_dir: Path) -> None:
    """A separate process with a terminal-less stdin that would answer the question "y"."""
    done = subprocess.run([sys.executable, "-m", "kvcache", "generate", "--model", str(own_code_dir), PROMPT,
                           "--device", "cpu"], input="y\n", capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode != 0 and done.stdout == ""
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "--trust-remote-code" in lines[0] and str(own_code_dir) in lines[0], done.stderr
