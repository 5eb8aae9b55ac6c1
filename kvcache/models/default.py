"""The bundled default model: a small character-level `DecoderLM` whose weights ship with the
package (`weights/default.safetensors` + `weights/default.json`), trained by
`scripts/train_default_model.py` on CPython's help-topic text."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from ..errors import CacheFormatError
from .decoder import DecoderConfig, DecoderLM
from .tokenizer import CharTokenizer

WEIGHTS_DIR = Path(__file__).resolve().parent / "weights"


def default_model_info(weights_dir: Path = WEIGHTS_DIR) -> dict[str, Any]:
    """The JSON shipped with the weights: config, alphabet, training recipe and final losses."""
    path = weights_dir / "default.json"
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise CacheFormatError(f"cannot read the default model's config {path}: {exc}") from exc


def load_default_model(
    *, device: str | torch.device | None = None, dtype: torch.dtype = torch.float32, weights_dir: Path = WEIGHTS_DIR
) -> tuple[DecoderLM, CharTokenizer]:
    """`(model, tokenizer)` of the bundled character-level model, in eval mode."""
    info = default_model_info(weights_dir)
    try:
        config = DecoderConfig.from_dict(info["config"])
        tokenizer = CharTokenizer(info["alphabet"], info.get("unknown", " "))
    except (KeyError, TypeError) as exc:
        raise CacheFormatError(f"the default model's config is malformed: {exc!r}") from exc
    if tokenizer.vocab_size != config.vocab_size:
        raise CacheFormatError(f"alphabet has {tokenizer.vocab_size} characters, config says {config.vocab_size}")
    model = DecoderLM(config)
    try:
        state = load_file(str(weights_dir / "default.safetensors"))
        missing, unexpected = model.load_state_dict({k: v.float() for k, v in state.items()}, strict=False)
    except Exception as exc:  # safetensors raises its own error type for a corrupt file
        raise CacheFormatError(f"cannot load the default model's weights: {exc}") from exc
    missing = [k for k in missing if not (k == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        raise CacheFormatError(f"default weights do not fit the model: missing {missing}, unexpected {unexpected}")
    return model.to(device=device, dtype=dtype).eval(), tokenizer
