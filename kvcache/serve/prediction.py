"""OpenAI's predicted outputs in a chat request: `prediction: {"type": "content", "content": ...}`,
the text the answer is expected to largely repeat. The engine drafts from it (where the server
speculates: `generation.prediction.PredictionDrafter`), so the answer is the one the request gets
without it, sooner; usage says how many predicted tokens the answer took."""

from __future__ import annotations

from typing import Any

from .api_error import ApiError


def predicted_text(value: Any) -> str | None:
    """The predicted text of a request's `prediction` (null: none): its content, a string or a list
    of text parts."""
    if value is None:
        return None
    if not isinstance(value, dict) or value.get("type") != "content" or set(value) - {"type", "content"}:
        raise ApiError(400, 'prediction must be {"type": "content", "content": <text>}', param="prediction")
    content = value.get("content")
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):  # fmt: skip
        content = "".join(p["text"] for p in content)
    if not isinstance(content, str):
        raise ApiError(400, "prediction.content must be a string or a list of text parts", param="prediction")
    return content or None
