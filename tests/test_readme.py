"""Every Python code block of the README runs as written.

A block runs in a fresh namespace, unless its first line is `# continues the block above`: then it
runs in the namespace of the block before it, as a reader pasting them in order would. Blocks run
in a temporary directory (they save files) on the bundled model and tiny random models only.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from typing import Any

import pytest

README = Path(__file__).parents[1] / "README.md"
CONTINUES = "# continues the block above"
#: Blocks that talk to a running server: tests/test_serve.py runs them against one of its own.
NEEDS_SERVER = "# needs `kvcache serve` running"


def python_blocks() -> list[tuple[int, str]]:
    """(line number, source) of each ```python block."""
    text = README.read_text()
    return [(text[: m.start()].count("\n") + 2, m.group(1)) for m in re.finditer(r"```python\n(.*?)```", text, re.S)]


def chains() -> list[list[tuple[int, str]]]:
    """The blocks grouped into runs that share a namespace."""
    groups: list[list[tuple[int, str]]] = []
    for line, source in python_blocks():
        if source.startswith(NEEDS_SERVER):
            continue
        if source.startswith(CONTINUES):
            assert groups, f"README line {line}: the first block cannot continue another"
            groups[-1].append((line, source))
        else:
            groups.append([(line, source)])
    return groups


def test_the_readme_has_code_blocks_to_run() -> None:
    assert len(python_blocks()) >= 6 and len(chains()) >= 3


@pytest.mark.parametrize("chain", chains(), ids=lambda chain: f"line{chain[0][0]}")
def test_readme_block_runs(chain: list[tuple[int, str]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    needs_transformers = any("from transformers" in source for _, source in chain)
    if needs_transformers and importlib.util.find_spec("transformers") is None:
        pytest.skip("needs the transformers extra")
    monkeypatch.chdir(tmp_path)
    namespace: dict[str, Any] = {"__name__": "__readme__"}
    for line, source in chain:
        code = compile(source, f"README.md:{line}", "exec")
        exec(code, namespace)
