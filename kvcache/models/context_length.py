"""How many positions a model takes, read from its configuration as vLLM derives `max_model_len`.

A transformers config names its context in one of several fields (`max_position_embeddings` for
most, `n_positions` for GPT-2, `seq_length`, ...). A model with learned position embeddings
cannot compute past it at all (its embedding lookup fails), and a rotary one was not trained past
it, so the server refuses a request whose prompt and `max_tokens` need more (a 400, as vLLM and
OpenAI answer it) and `kvcache generate` stops there, instead of failing mid-answer. A YaRN rope
extends the context to its original length times its factor, as vLLM reads it; other scalings are
taken as the config writes the length (Gemma 3 and Llama 3.1 write the extended one).
"""

from __future__ import annotations

from typing import Any

#: The fields that name a context length, the smallest present taken.
FIELDS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "max_sequence_length",
          "max_seq_length", "seq_len")  # fmt: skip


def context_length(config: Any) -> tuple[int, str] | None:
    """`(positions, field)`: the most positions `config`'s model takes and the field that says so
    (its text model's, for an image-text-to-text one); None where no field names one."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    found = [(value, name) for name in FIELDS
             if isinstance(value := getattr(text, name, None), int) and not isinstance(value, bool) and value > 0]
    if not found:
        return None
    length, name = min(found)
    rope = getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None)
    if isinstance(rope, dict) and rope.get("rope_type", rope.get("type")) == "yarn":
        factor, original = rope.get("factor"), rope.get("original_max_position_embeddings") or length
        if isinstance(factor, (int, float)) and factor > 1 and isinstance(original, int):
            return max(length, int(original * factor)), f"{name} and its YaRN rope's factor"
    return length, name
