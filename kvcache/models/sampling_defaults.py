"""The sampling settings a model directory recommends, read from its `generation_config.json`.

Model authors write there how their model is meant to be sampled (Qwen3: temperature 0.6, top-k
20, top-p 0.95; Llama 3: temperature 0.6, top-p 0.9; Gemma 3: top-k 64, top-p 0.95; some a
repetition penalty; some how long an answer may run, `max_new_tokens`), and transformers'
`generate`, `transformers serve` and vLLM start from it:
a request or a flag that names a setting overrides it, one that does not gets the model's. Only
what the file writes is taken (as vLLM takes it), so a directory that says nothing keeps the
caller's own defaults; a file that sets `do_sample` to false asks for greedy decoding
(temperature 0), as transformers reads it. A value out of range is left out with a warning: the
model still loads, as it does in transformers.
"""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path
from typing import Any

#: The file's settings taken, each with the range it must lie in (`low_open`: the low end excluded).
RANGES: dict[str, tuple[float, float, bool]] = {"temperature": (0.0, 2.0, False), "top_p": (0.0, 1.0, True),
                                                "top_k": (0, 1 << 31, False), "min_p": (0.0, 1.0, False),
                                                "repetition_penalty": (0.0, 2.0, True),
                                                "max_new_tokens": (1, 1 << 31, False)}  # fmt: skip


def _valid(name: str, value: Any) -> bool:
    low, high, low_open = RANGES[name]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return False
    if name in ("top_k", "max_new_tokens") and not isinstance(value, int):
        return False
    return (low < value if low_open else low <= value) and value <= high


def read_sampling_defaults(directory: str | Path) -> dict[str, float | int]:
    """`{"temperature": ..., "top_p": ..., "top_k": ..., "min_p": ..., "repetition_penalty": ...,
    "max_new_tokens": ...}`, the ones the directory's `generation_config.json` sets (none without the file); `do_sample:
    false` there gives a temperature of 0. A file that is not a JSON object, or a value that is not
    a number in range, is left out with a warning naming it."""
    path = Path(directory) / "generation_config.json"
    if not path.is_file():
        return {}
    try:
        written = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        warnings.warn(f"{path}: not read ({exc}); sampling defaults are the caller's own", stacklevel=2)
        return {}
    if not isinstance(written, dict):
        warnings.warn(f"{path}: not a JSON object; sampling defaults are the caller's own", stacklevel=2)
        return {}
    out: dict[str, float | int] = {}
    for name in RANGES:
        if name not in written or written[name] is None:
            continue
        if _valid(name, written[name]):
            out[name] = written[name]
        else:
            low, high, low_open = RANGES[name]
            span = f"({low}, {high}]" if low_open else f"[{low}, {high}]"
            warnings.warn(f"{path}: {name}={written[name]!r} is not a number in {span}; left out", stacklevel=2)
    if written.get("do_sample") is False:
        out["temperature"] = 0.0
    return out


def describe(defaults: dict[str, float | int]) -> str:
    """`defaults` as a line says them: "temperature 0.6, top_k 20" ("" for none)."""
    return ", ".join(f"{name} {defaults[name]:g}" for name in RANGES if name in defaults)
