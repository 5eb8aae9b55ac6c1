"""Model switches speculative decoding turns on for its run and restores after: per-token
recurrent states handed to the cache (`set_return_intermediate_states`, the reference models) and
per-token recurrence (`set_per_token_recurrence`, wrapped transformers Mamba2 / Qwen3-Next).

Each switch returns its own undo; callers push the undos on a `contextlib.ExitStack`, so they run
in reverse order and a model that is both target and draft ends as it started."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..errors import GenerationError


def holds_recurrent_states(cache: Any) -> bool:
    """Whether a layer of `cache` (after a forward) holds a recurrent state (Mamba, gated delta rule),
    which a crop inside a forward needs per-token states for: conv windows alone (LFM2's short
    convolutions) keep their columns and roll back to any token anyway."""
    for layer in getattr(cache, "self_attention_cache", cache):
        part = getattr(layer, "recurrent", layer)
        if hasattr(part, "get_recurrent_state") and any(
            part.get_recurrent_state(s) is not None for s in range(part.num_states)
        ):  # fmt: skip
            return True
    return False


def intermediate_states_switch(target: Any, wanted: bool | None) -> Callable[[bool], Callable[[], None]]:
    """A function that sets the target's intermediate-states switch (or its per-token recurrence)
    and returns its undo."""
    setter = getattr(target, "set_return_intermediate_states", None)
    if wanted is not None and not isinstance(wanted, bool):
        raise GenerationError(f"intermediate_states must be None, True or False, got {wanted!r}")
    if setter is None and wanted is not False and getattr(target, "has_per_token_recurrence", False):
        return row_states(target, wanted)[1]
    if wanted and setter is None:
        raise GenerationError(
            f"intermediate_states=True but {type(target).__name__} has no set_return_intermediate_states()"
        )
    if setter is None or wanted is False:
        return lambda enabled: lambda: None

    def switch(enabled: bool) -> Callable[[], None]:
        flagged = [m for m in getattr(target, "modules", list)() if hasattr(m, "return_intermediate_states")]
        before = [m.return_intermediate_states for m in flagged]
        setter(enabled)

        def restore() -> None:
            for module, value in zip(flagged, before, strict=True):
                module.return_intermediate_states = value

        return restore

    return switch


def row_states(model: Any, wanted: bool | None) -> tuple[bool, Callable[[bool], Callable[[], None]]]:
    """Whether `model` can record every token's recurrent state in a multi-token forward, and the
    switch that turns it on (returning its undo): per-token states handed to the cache
    (`set_return_intermediate_states`, the reference models), or per-token recurrence
    (`set_per_token_recurrence`, wrapped transformers Mamba2 / Qwen3-Next). `wanted=False`: neither."""
    if wanted is not False and hasattr(model, "set_return_intermediate_states"):
        return True, intermediate_states_switch(model, None)
    if wanted is not False and getattr(model, "has_per_token_recurrence", False):
        def switch(enabled: bool) -> Callable[[], None]:
            before = bool(getattr(model, "per_token_recurrence", False))
            model.set_per_token_recurrence(enabled)
            return lambda: model.set_per_token_recurrence(before)

        return True, switch
    return False, lambda enabled: lambda: None
