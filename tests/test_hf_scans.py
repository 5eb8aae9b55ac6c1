"""The vectorized chunk scans behind batched speculation on transformers' Mamba2 and Qwen3-Next:
against transformers' own kernels (its one-token recurrence and its chunked scan), and, inside the
models, the chunk forward against the mixers' own forwards and against one-token decoding.

The scans compute the same recurrences as the kernels, but in another order (a decay-weighted sum
over the chunk instead of token after token), so they agree up to float32 rounding, not bit for
bit. Largest differences measured on the 2-core x86-64 CI machine, equal at 1 and 2 torch threads:
GDN 2.7e-7 (values of magnitude about 1), Mamba2 7.6e-6 (outputs of magnitude about 10-20), whole
models 7.2e-7 (logits and states); the tolerances below leave 3-7x of room for other CPUs' kernels.
What is the same computation is checked bitwise: prefills and single tokens take the mixers' own
forward unchanged, and a crop inside a verify chunk lands exactly on the state the scan recorded
there.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytest.importorskip("transformers", minversion="5.24")

from test_transformers_models import tiny_model
from transformers.models.mamba2.modeling_mamba2 import mamba2_chunk_scan, mamba2_selective_state_update
from transformers.models.qwen3_next.modeling_qwen3_next import (
    torch_chunk_gated_delta_rule,
    torch_recurrent_gated_delta_rule,
)

from kvcache.integrations.hf_scans import gated_delta_states, mamba2_states
from kvcache.integrations.transformers import wrap_model

pytestmark = pytest.mark.usefixtures("one_thread")

GDN_TOL = {"atol": 1e-6, "rtol": 1e-6}
MAMBA2_TOL = {"atol": 2e-5, "rtol": 1e-5}
MODEL_TOL = {"atol": 5e-6, "rtol": 1e-5}


def _close(a: torch.Tensor, b: torch.Tensor, tol: dict[str, float]) -> None:
    torch.testing.assert_close(a, b, **tol)


@pytest.mark.parametrize(("length", "value_heads"), [(1, 4), (5, 4), (9, 2)])
def test_gated_delta_scan_matches_transformers_kernels(length: int, value_heads: int) -> None:
    gen = torch.Generator().manual_seed(length)
    batch, key_heads, dim = 3, 2, 16
    query, key = (torch.randn(batch, length, key_heads, dim, generator=gen) for _ in range(2))
    value = torch.randn(batch, length, value_heads, dim, generator=gen)
    decay = -2 * torch.rand(batch, length, value_heads, generator=gen)
    beta = torch.rand(batch, length, value_heads, generator=gen)
    start = torch.randn(batch, value_heads, dim, dim, generator=gen)
    out, states = gated_delta_states(query, key, value, decay, beta, start)
    assert out.shape == value.shape and states.shape == (batch, length, value_heads, dim, dim)
    kwargs = {"g": decay, "beta": beta, "initial_state": start, "output_final_state": True,
              "use_qk_l2norm_in_kernel": True}  # fmt: skip
    chunked, final = torch_chunk_gated_delta_rule(query, key, value, **kwargs)
    _close(out, chunked, GDN_TOL)
    _close(states[:, -1], final, GDN_TOL)
    state = start
    for t in range(length):  # token by token: every intermediate state
        step = {**kwargs, "g": decay[:, t : t + 1], "beta": beta[:, t : t + 1], "initial_state": state}
        one, state = torch_recurrent_gated_delta_rule(query[:, t : t + 1], key[:, t : t + 1], value[:, t : t + 1],
                                                      **step)  # fmt: skip
        _close(out[:, t : t + 1], one, GDN_TOL)
        _close(states[:, t], state, GDN_TOL)


@pytest.mark.parametrize(("length", "groups"), [(1, 1), (5, 1), (9, 2)])
def test_mamba2_scan_matches_transformers_kernels(length: int, groups: int) -> None:
    gen = torch.Generator().manual_seed(10 + length)
    batch, heads, head_dim, size = 3, 8, 16, 16
    x = torch.randn(batch, length, heads, head_dim, generator=gen)
    dt = torch.nn.functional.softplus(torch.randn(batch, length, heads, generator=gen))
    A = -4 * torch.rand(heads, generator=gen)
    B, C = (torch.randn(batch, length, groups, size, generator=gen) for _ in range(2))
    D = torch.randn(heads, generator=gen)
    start = torch.randn(batch, heads, head_dim, size, generator=gen)
    out, states = mamba2_states(x, dt, A, B, C, D, start)
    chunked, final = mamba2_chunk_scan(x, dt, A, B, C, chunk_size=16, D=D, initial_states=start,
                                       return_final_states=True)  # fmt: skip
    _close(out, chunked, MAMBA2_TOL)
    _close(states[:, -1], final, MAMBA2_TOL)
    state = start.clone()
    expand = (-1, head_dim)
    for t in range(length):
        one = mamba2_selective_state_update(
            state, x[:, t], dt[:, t, :, None].expand(-1, -1, head_dim), A[:, None, None].expand(-1, head_dim, size),
            B[:, t], C[:, t], D[:, None].expand(*expand),
        )  # fmt: skip
        _close(out[:, t], one, MAMBA2_TOL)
        _close(states[:, t], state, MAMBA2_TOL)


def _prefilled(wrapped: Any, prompt: torch.Tensor) -> Any:
    cache = wrapped.new_cache()
    with torch.no_grad():
        wrapped(prompt, cache=cache)
    return cache


def _states(cache: Any) -> list[torch.Tensor]:
    return [layer.get_recurrent_state(0).clone() for layer in cache.layers if layer.has_recurrent]


def _forward(wrapped: Any, ids: torch.Tensor, cache: Any) -> torch.Tensor:
    start = cache.get_seq_length()
    positions = torch.arange(start, start + ids.shape[1]).expand(ids.shape[0], -1)
    with torch.no_grad():
        return wrapped(ids, cache=cache, position_ids=positions)


@pytest.mark.parametrize("kind", ["mamba2", "qwen3_next"])
def test_chunk_forward_matches_the_mixers_own_paths(kind: str) -> None:
    """A 5-token verify chunk onto a prefilled cache: logits and final states as the mixers' own
    multi-token forward gives them; the state after each token as one-token decoding gives it; a
    per-row crop inside the chunk lands bitwise on the state recorded there; prefills and single
    tokens are the mixers' own forward, bit for bit."""
    wrapped = wrap_model(tiny_model(kind))
    gen = torch.Generator().manual_seed(4)
    prompt, chunk = torch.randint(3, 128, (2, 9), generator=gen), torch.randint(3, 128, (2, 5), generator=gen)
    own = _prefilled(wrapped, prompt)
    theirs = _forward(wrapped, chunk, own)
    stepped = _prefilled(wrapped, prompt)
    per_token = []
    for t in range(chunk.shape[1]):
        _forward(wrapped, chunk[:, t : t + 1], stepped)
        per_token.append(_states(stepped))
    wrapped.set_per_token_recurrence(True)
    try:
        ours_cache = _prefilled(wrapped, prompt)
        assert all(torch.equal(a, b) for a, b in zip(_states(ours_cache), _states(_prefilled(wrapped, prompt)),
                                                      strict=True))  # fmt: skip
        ours_cache.activate_past_recording()
        ours = _forward(wrapped, chunk, ours_cache)
        _close(ours, theirs, MODEL_TOL)
        for a, b in zip(_states(ours_cache), _states(own), strict=True):
            _close(a, b, MODEL_TOL)
        for t in range(chunk.shape[1]):
            copy = ours_cache.copy()
            copy.crop(torch.tensor([-(chunk.shape[1] - 1 - t), 0]))  # row 0 back to token t, row 1 whole
            for layer, want, whole in zip((x for x in copy.layers if x.has_recurrent), per_token[t], per_token[-1],
                                          strict=True):  # fmt: skip
                held = layer.get_recurrent_state(0)
                _close(held[0], want[0], MODEL_TOL)
                _close(held[1], whole[1], MODEL_TOL)
            recorded = [layer._slots[0].steps[-1].inter for layer in ours_cache.layers if layer.has_recurrent]
            if t < chunk.shape[1] - 1:
                assert all(torch.equal(layer.get_recurrent_state(0)[0], inter[0, t])
                           for layer, inter in zip((x for x in copy.layers if x.has_recurrent), recorded,
                                                   strict=True))  # fmt: skip
        one = torch.randint(3, 128, (2, 1), generator=gen)
        single = _forward(wrapped, one, ours_cache.copy())
    finally:
        wrapped.set_per_token_recurrence(False)
    assert torch.equal(single, _forward(wrapped, one, ours_cache.copy()))
