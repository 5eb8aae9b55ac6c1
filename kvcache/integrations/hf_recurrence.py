"""Per-token recurrence in a multi-token forward of a transformers model, so that its cache can be
cropped per row inside that forward.

transformers' Mamba2 and gated-delta-net (Qwen3-Next) mixers hand the cache only the state at the
end of a multi-token forward, so a crop that lands inside it has no state to go back to. Batched
speculative decoding needs exactly that: rows accept different numbers of draft tokens of one
verify forward. While switched on, `PerTokenRecurrence` runs each such mixer one token at a time
inside the forward (its own single-token decode path), so every token is a recorded step of the
kvcache `RecurrentLayer`; attention layers still see the whole chunk at once. The states are then
those of plain one-token decoding, at the price of `k + 1` mixer steps per verify forward.
"""

from __future__ import annotations

import types
from typing import Any

import torch

#: The mixer classes whose `forward(hidden_states, cache=None, attention_mask=None, **kwargs)` this
#: wraps (checked against transformers 5.24).
MIXER_CLASSES = ("Mamba2Mixer", "Qwen3NextGatedDeltaNet")


def recurrent_mixers(model: Any) -> list[Any]:
    """The model's recurrent mixers of a known class (empty when it has none)."""
    return [m for m in model.modules() if type(m).__name__ in MIXER_CLASSES]


class PerTokenRecurrence:
    """Switches a transformers model's recurrent mixers between their own multi-token path and one
    token at a time (in multi-token forwards on a cache that already holds their state)."""

    def __init__(self, model: Any) -> None:
        self.mixers = recurrent_mixers(model)
        self.enabled = False

    def __bool__(self) -> bool:
        return bool(self.mixers)

    def set(self, enabled: bool) -> None:
        """Install (or remove) the per-token forward on every mixer instance."""
        if enabled == self.enabled:
            return
        for mixer in self.mixers:
            if enabled:
                mixer.forward = types.MethodType(_per_token_forward, mixer)
            else:
                del mixer.forward  # back to the class's own forward
        self.enabled = enabled


def _per_token_forward(
    self: Any, hidden_states: torch.Tensor, cache: Any = None, attention_mask: torch.Tensor | None = None,
    **kwargs: Any,
) -> torch.Tensor:  # fmt: skip
    forward = type(self).forward
    if cache is None or hidden_states.shape[1] == 1 or not cache.has_previous_state(self.layer_idx):
        return forward(self, hidden_states, cache=cache, attention_mask=attention_mask, **kwargs)
    outputs = []
    for i in range(hidden_states.shape[1]):
        mask = attention_mask[:, i : i + 1] if attention_mask is not None and attention_mask.dim() == 2 else None
        outputs.append(forward(self, hidden_states[:, i : i + 1], cache=cache, attention_mask=mask, **kwargs))
    return torch.cat(outputs, dim=1)
