"""The layer kinds the layer scenarios compare: kvcache's and, when installed, transformers' equivalents.

Every kind builds an object with `update(keys, values)` = what one model layer hands its cache in
one forward over `n` tokens, so one timing loop serves all kinds. Attention layers take the keys and
values as they are. Recurrent layers (and the recurrent half of hybrid layers) sit behind
`StateStep`, which turns the call into what a Mamba2 / gated-delta-net layer does: conv inputs
`[1, channels, n]` through `update_conv_state`, then the new state through `update_recurrent_state`.
The state and conv sizes are those of `recurrent_rollback.py` (a 1 MiB fp32 state, 4352 conv
channels, kernel 4). transformers' layers answer the same calls (that is the protocol), so they sit
behind the same adapter.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from kvcache import DynamicLayer, HybridLayer, RecurrentLayer, SlidingWindowLayer, StaticLayer

from .recurrent_rollback import CONV_CHANNELS, KERNEL, STATE_SHAPE

#: What a decode step hands a recurrent layer: one conv input column and the new state. Built once,
#: shared by every layer (the timing is of the cache, not of producing its inputs).
_CONV_COLUMN = torch.randn(1, CONV_CHANNELS, 1, generator=torch.Generator().manual_seed(2))
_STATE = torch.randn(STATE_SHAPE, generator=torch.Generator().manual_seed(3))


class StateStep:
    """A recurrent (or hybrid) layer behind `update(keys, values)`: one call = one model forward."""

    def __init__(self, layer: Any, attention: bool) -> None:
        self.layer = layer
        self.attention = attention

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor) -> Any:
        n = key_states.shape[2]
        self.layer.update_conv_state(_CONV_COLUMN.expand(-1, -1, n), conv_kernel_size=KERNEL)
        self.layer.update_recurrent_state(_STATE)
        return self.layer.update(key_states, value_states) if self.attention else None

    def crop(self, tokens_to_remove: int) -> None:
        self.layer.crop(tokens_to_remove)

    def activate_past_recording(self) -> None:
        self.layer.activate_past_recording()

    @property
    def is_croppable(self) -> bool:
        return bool(self.layer.is_croppable)

    def __deepcopy__(self, memo: dict[int, Any]) -> StateStep:
        return StateStep(copy.deepcopy(self.layer, memo), self.attention)


@dataclass(frozen=True)
class Kind:
    """One layer kind of one library; `make(context)` builds an empty layer for that context."""

    family: str  # what pairs ours with theirs: "full", "sliding", "static", "recurrent", "hybrid"
    library: str  # "kvcache" or "transformers"
    label: str
    make: Callable[[int], Any]

    @property
    def name(self) -> str:
        return f"{self.library} {self.label}"


def kvcache_kinds(window: int, room: int) -> list[Kind]:
    """Our layer kinds; a static layer holds the context plus `room` tokens."""
    return [
        Kind("full", "kvcache", "DynamicLayer", lambda c: DynamicLayer()),
        Kind("sliding", "kvcache", f"SlidingWindowLayer(W={window})", lambda c: SlidingWindowLayer(window)),
        Kind("static", "kvcache", "StaticLayer", lambda c: StaticLayer(c + room)),
        Kind("recurrent", "kvcache", "RecurrentLayer", lambda c: StateStep(RecurrentLayer(), attention=False)),
        Kind(
            "hybrid",
            "kvcache",
            "HybridLayer(DynamicLayer, RecurrentLayer)",
            lambda c: StateStep(HybridLayer(DynamicLayer(), RecurrentLayer()), attention=True),
        ),
    ]


def transformers_kinds(window: int, room: int) -> list[Kind]:
    """transformers' layer for each family, or [] when transformers is not installed."""
    try:
        from transformers import cache_utils as hf
    except ImportError:
        return []
    return [
        Kind("full", "transformers", "DynamicLayer", lambda c: hf.DynamicLayer()),
        Kind(
            "sliding",
            "transformers",
            f"DynamicSlidingWindowLayer(W={window})",
            lambda c: hf.DynamicSlidingWindowLayer(window),
        ),
        Kind("static", "transformers", "StaticLayer", lambda c: hf.StaticLayer(c + room)),
        Kind(
            "recurrent",
            "transformers",
            "LinearAttentionLayer",
            lambda c: StateStep(hf.LinearAttentionLayer(), attention=False),
        ),
        Kind(
            "hybrid",
            "transformers",
            "LinearAttentionAndFullAttentionLayer",
            lambda c: StateStep(hf.LinearAttentionAndFullAttentionLayer(), attention=True),
        ),
    ]


def all_kinds(window: int, room: int) -> list[Kind]:
    """Ours and theirs, each of ours followed by its transformers counterpart."""
    theirs = {k.family: k for k in transformers_kinds(window, room)}
    out = []
    for kind in kvcache_kinds(window, room):
        out.append(kind)
        if kind.family in theirs:
            out.append(theirs[kind.family])
    return out


def transformers_version() -> str | None:
    try:
        import transformers
    except ImportError:
        return None
    return transformers.__version__
