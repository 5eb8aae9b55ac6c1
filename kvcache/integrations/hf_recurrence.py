"""Per-token recurrent states in a multi-token forward of a transformers model, so that its cache can
be cropped per row inside that forward.

transformers' Mamba2 and gated-delta-net (Qwen3-Next) mixers hand the cache only the state at the
end of a multi-token forward, so a crop that lands inside it has no state to go back to. Batched
speculative decoding needs exactly that: rows accept different numbers of draft tokens of one
verify forward. While switched on, `PerTokenRecurrence` gives each such mixer a forward for chunks
fed onto a held state that runs the mixer's own projections, conv and norms over the whole chunk
and its recurrence as one vectorized scan emitting the state after every token (`hf_scans`); the
cache gets them as `intermediate_states`, so every token of the chunk is a place a crop can land.
Prefills (no held state) and single tokens take the mixer's own forward.

transformers' Mamba (Mamba1) mixers, also in Falcon-Mamba and Jamba, are another case: their
multi-token path scans from a zero state whatever the cache holds (transformers' own TODO says so),
so a chunk fed onto a held state (a prefill in blocks, a prompt continuing a stored prefix, a
verify forward) computes the wrong thing. Those mixers do run a chunk token by token from the held
state, with the same update a decode step uses, when the cache asks them to keep that many
per-token states (`get_recurrent_states_to_keep`); `stepwise_layers` finds them, and the adapter
asks (`TransformersCache.stepwise_layers`). Every token's state is then recorded anyway.

Other mixers whose modeling code hands over the states the cache asks for (transformers >= 5.25)
get per-token recurrence the same way while it is switched on: their own single-token update,
token by token over the chunk, slower than a vectorized scan. Only the classes checked against a
forward of the whole prompt are taken (`ASKED_MIXER_CLASSES`): Zamba2's, asked for every token's
state, scans an empty chunk and loses the held state.
"""

from __future__ import annotations

import inspect
import sys
import types
from typing import Any

import torch
import torch.nn.functional as F
from transformers.activations import ACT2FN

from .hf_scans import gated_delta_states, mamba2_states

#: The mixer classes this gives a chunk forward (checked against transformers 5.24 and 5.25).
MIXER_CLASSES = ("Mamba2Mixer", "Qwen3NextGatedDeltaNet")


#: Mixers whose multi-token forward ignores a held state, but runs token by token from it when
#: asked to keep every token's state (transformers 5.25; where their code does not ask, `wrap_model`
#: feeds such a chunk one token per forward).
STEPWISE_MIXER_CLASSES = ("MambaMixer", "FalconMambaMixer", "JambaMambaMixer")


def stepwise_layers(model: Any) -> frozenset[int]:
    """The layer indices of `model`'s mixers of `STEPWISE_MIXER_CLASSES` (empty when it has none)."""
    return frozenset(int(m.layer_idx) for m in model.modules() if type(m).__name__ in STEPWISE_MIXER_CLASSES)


#: Mixers that hand over every token's state of a chunk on a held state when the cache asks
#: (`get_recurrent_states_to_keep`), checked against transformers 5.25 (tests/test_transformers_families.py).
ASKED_MIXER_CLASSES = ("FalconH1Mixer", "BambaMixer", "GraniteMoeHybridMambaLayer", "NemotronHMamba2Mixer",
                       "Qwen3_5GatedDeltaNet", "Qwen3_5MoeGatedDeltaNet")  # fmt: skip


def asked_layers(model: Any) -> frozenset[int]:
    """The layer indices of `model`'s mixers of `ASKED_MIXER_CLASSES`, where its code asks the cache
    for states (transformers >= 5.25; empty otherwise)."""
    found = frozenset(int(m.layer_idx) for m in model.modules() if type(m).__name__ in ASKED_MIXER_CLASSES)
    return found if found and asks_for_states(model) else frozenset()


def asks_for_states(model: Any) -> bool:
    """Whether `model`'s modeling code asks the cache how many per-token recurrent states a
    multi-token forward should hand over (`get_recurrent_states_to_keep`, transformers >= 5.25)."""
    module = sys.modules.get(type(model).__module__)
    try:
        return module is not None and "get_recurrent_states_to_keep(" in inspect.getsource(module)
    except (OSError, TypeError):  # no source to read (a frozen install): not relied on
        return False


def recurrent_mixers(model: Any) -> list[Any]:
    """The model's recurrent mixers of a known class (empty when it has none)."""
    return [m for m in model.modules() if type(m).__name__ in MIXER_CLASSES]


class PerTokenRecurrence:
    """Switches a transformers model's recurrent mixers between their own multi-token path and the
    chunk forward that records every token's state (for chunks on a cache that holds their state)."""

    def __init__(self, model: Any) -> None:
        self.mixers = recurrent_mixers(model)
        self.enabled = False

    def __bool__(self) -> bool:
        return bool(self.mixers)

    def set(self, enabled: bool) -> None:
        """Install (or remove) the chunk forward on every mixer instance."""
        if enabled == self.enabled:
            return
        for mixer in self.mixers:
            if enabled:
                mixer.forward = types.MethodType(_chunk_forward, mixer)
            else:
                del mixer.forward  # back to the class's own forward
        self.enabled = enabled


def _chunk_forward(
    self: Any, hidden_states: torch.Tensor, cache: Any = None, attention_mask: torch.Tensor | None = None,
    **kwargs: Any,
) -> torch.Tensor:  # fmt: skip
    if cache is None or hidden_states.shape[1] == 1 or not cache.has_previous_state(self.layer_idx):
        return type(self).forward(self, hidden_states, cache=cache, attention_mask=attention_mask, **kwargs)
    if attention_mask is not None and attention_mask.dim() == 2:  # padding tokens feed nothing
        hidden_states = (hidden_states * attention_mask[:, :, None]).to(hidden_states.dtype)
    else:
        attention_mask = None
    chunk = _mamba2_chunk if type(self).__name__ == "Mamba2Mixer" else _gated_delta_chunk
    return chunk(self, hidden_states, cache, attention_mask)


def _conv(self: Any, inputs: torch.Tensor, cache: Any) -> torch.Tensor:
    """The causal depthwise conv of the chunk `inputs` `[batch, channels, T]` after the held window
    (which the cache extends and records), activated: `[batch, channels, T]`."""
    seq_len = inputs.shape[-1]
    window = cache.update_conv_state(inputs, self.layer_idx, conv_kernel_size=self.conv_kernel_size)
    weight = self.conv1d.weight
    out = F.conv1d(window.to(weight.dtype), weight, self.conv1d.bias, padding=weight.shape[-1] - 1,
                   groups=weight.shape[0])[:, :, : window.shape[-1]]  # fmt: skip
    return ACT2FN[self.activation](out).to(inputs.dtype)[:, :, -seq_len:]


def _store(self: Any, cache: Any, states: torch.Tensor) -> None:
    """Hand the cache the chunk's per-token states `[batch, T, ...]` (the last is the new state)."""
    held = cache.get_recurrent_state(self.layer_idx)
    states = states.to(held.dtype)
    cache.update_recurrent_state(states[:, -1], self.layer_idx, intermediate_states=states)


def _mamba2_chunk(self: Any, hidden_states: torch.Tensor, cache: Any, mask: torch.Tensor | None) -> torch.Tensor:
    batch, seq_len, _ = hidden_states.shape
    gate, x_b_c, dt = self.in_proj(hidden_states).split([self.intermediate_size, self.conv_dim, self.num_heads], -1)
    x_b_c = _conv(self, x_b_c.transpose(1, 2), cache).transpose(1, 2)
    if mask is not None:
        x_b_c = (x_b_c * mask[:, :, None]).to(x_b_c.dtype)
    groups = self.n_groups * self.ssm_state_size
    x, B, C = x_b_c.split([self.intermediate_size, groups, groups], dim=-1)
    dt = F.softplus(dt + self.dt_bias).clamp(*self.time_step_limit)
    out, states = mamba2_states(
        x.reshape(batch, seq_len, self.num_heads, self.head_dim), dt, -torch.exp(self.A_log.float()),
        B.reshape(batch, seq_len, self.n_groups, -1), C.reshape(batch, seq_len, self.n_groups, -1), self.D,
        cache.get_recurrent_state(self.layer_idx),
    )  # fmt: skip
    _store(self, cache, states)
    out = self.norm(out.reshape(batch, seq_len, -1), gate)  # float32 in, as the mixer's own chunk path
    return self.out_proj(out.to(hidden_states.dtype))


def _gated_delta_chunk(self: Any, hidden_states: torch.Tensor, cache: Any, mask: torch.Tensor | None) -> torch.Tensor:
    batch, seq_len, _ = hidden_states.shape
    query, key, value, z, b, a = self.fix_query_key_value_ordering(
        self.in_proj_qkvz(hidden_states), self.in_proj_ba(hidden_states)
    )
    mixed = torch.cat([t.reshape(batch, seq_len, -1) for t in (query, key, value)], dim=-1)
    mixed = _conv(self, mixed.transpose(1, 2), cache).transpose(1, 2)
    query, key, value = mixed.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
    out, states = gated_delta_states(
        query.reshape(batch, seq_len, -1, self.head_k_dim), key.reshape(batch, seq_len, -1, self.head_k_dim),
        value.reshape(batch, seq_len, -1, self.head_v_dim),
        -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias), b.sigmoid(),
        cache.get_recurrent_state(self.layer_idx),
    )  # fmt: skip
    _store(self, cache, states)
    out = self.norm(out.to(hidden_states.dtype).reshape(-1, self.head_v_dim), z.reshape(-1, self.head_v_dim))
    return self.out_proj(out.reshape(batch, seq_len, -1))
