"""Recurrences over a short chunk that emit the state after every token, in one vectorized pass.

A verify forward of batched speculative decoding feeds `k + 1` tokens onto a held recurrent state,
and rows then keep different numbers of them, so the cache needs the state after each token.
transformers' Mamba2 and gated-delta-net kernels return only the final state. These functions
compute the same recurrences in closed form over the chunk: with `c_t` the running sum of the
log-decays, the state after token t is

    S_t = exp(c_t) S_0 + sum_{s <= t} exp(c_t - c_s) u_s

where `u_s` is token s's update. For Mamba2 that update is the input's outer product with `B`.
For the gated delta rule it depends on the state it corrects, and the chunk's updates are the
solution of one unit-lower-triangular system (the "UT transform" the chunked kernels also use).
Every state is then one masked, decay-weighted sum, and each output reads its own state. The work
is quadratic in the chunk length, which is a handful of tokens here; long prefills keep
transformers' chunked kernels.

Inputs follow the kernels' layouts (`[batch, seq, heads, dim]`); everything is computed in float32,
as those kernels do. The results equal the kernels' up to rounding (the sums run in another
order); tests/test_hf_scans.py measures by how much.
"""

from __future__ import annotations

import torch


def _decay_matrix(log_decay: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For log-decays `[..., T]`: `exp(c_t)` `[..., T]` and the causal matrix `exp(c_t - c_s)` (zero
    for s > t) `[..., T, T]`, with `c` their running sum."""
    cum = log_decay.cumsum(-1)
    pairwise = cum[..., :, None] - cum[..., None, :]
    future = torch.ones(pairwise.shape[-2:], dtype=torch.bool, device=pairwise.device).triu(1)
    return cum.exp(), pairwise.masked_fill(future, float("-inf")).exp()


def mamba2_states(
    x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor, D: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Mamba2's selective scan over a chunk, from `state`.

    `x` `[batch, T, heads, head_dim]`; `dt` `[batch, T, heads]` (bias, softplus and limits
    applied); `A` `[heads]` (negative); `B`, `C` `[batch, T, groups, state_size]`; `D` `[heads]`;
    `state` `[batch, heads, head_dim, state_size]`. Returns the outputs `[batch, T, heads,
    head_dim]` (float32, the D skip included) and the state after every token `[batch, T, heads,
    head_dim, state_size]` (float32).
    """
    heads = x.shape[2]
    x, dt = x.float(), dt.float()
    B = B.float().repeat_interleave(heads // B.shape[2], dim=2)
    C = C.float().repeat_interleave(heads // C.shape[2], dim=2)
    start, within = _decay_matrix((dt * A.float()).transpose(1, 2))  # [b, h, T], [b, h, T, T]
    updates = torch.einsum("bhts,bshp,bshn->bthpn", within, dt[..., None] * x, B)
    states = start.transpose(1, 2)[..., None, None] * state.float()[:, None] + updates
    out = torch.einsum("bthpn,bthn->bthp", states, C) + D.float()[:, None] * x
    return out, states


def gated_delta_states(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """The gated delta rule over a chunk, from `state`, queries and keys L2-normalized in float32.

    `query`, `key` `[batch, T, k_heads, k_dim]`; `value` `[batch, T, v_heads, v_dim]`; `g` (log
    decay, <= 0) and `beta` `[batch, T, v_heads]`; `state` `[batch, v_heads, k_dim, v_dim]`. Per
    token: the state decays by `exp(g)`, then moves towards storing `value` under `key` by `beta`
    of the error it makes there, and the output reads it with the scaled query. Returns the
    outputs `[batch, T, v_heads, v_dim]` and the state after every token `[batch, T, v_heads,
    k_dim, v_dim]` (both float32).
    """
    repeat = value.shape[2] // key.shape[2]
    if repeat > 1:  # grouped value heads share their query/key head
        query, key = query.repeat_interleave(repeat, dim=2), key.repeat_interleave(repeat, dim=2)
    q, k, v, beta, g = (t.transpose(1, 2).float() for t in (query, key, value, beta, g))  # heads first
    q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6) * q.shape[-1] ** -0.5
    k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    start, within = _decay_matrix(g)  # [b, h, T], [b, h, T, T]
    s0 = state.float()
    # Token s's update u_s = beta_s (v_s - k_s . S'_s), with S'_s the state it finds after decaying:
    # exp(c_s) S_0 plus the earlier updates, each decayed since. Moving the earlier updates to the
    # left gives (I + L) u = beta (v - exp(c) k S_0), L strictly lower triangular.
    lower = (beta[..., None] * (k @ k.transpose(-1, -2)) * within).tril(-1)
    system = lower + torch.eye(lower.shape[-1], dtype=lower.dtype, device=lower.device)
    rhs = beta[..., None] * (v - start[..., None] * (k @ s0))
    updates = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    states = start[..., None, None] * s0[:, :, None] + torch.einsum("bhts,bhsk,bhsv->bhtkv", within, k, updates)
    out = torch.einsum("bhtkv,bhtk->bhtv", states, q)
    return out.transpose(1, 2), states.transpose(1, 2)
