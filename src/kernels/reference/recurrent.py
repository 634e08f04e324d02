"""Token-by-token forms of every operator: the independent test oracles.

Each walks the sequence one token at a time, exactly as NATSL.md words it, and shares
no operator code with the chunked references (only the guard against ``0 * inf``).
They are slow (a Python loop over T) and meant for tests and tiny shapes. Routes act
as plain weights here, so autograd gives the true derivative at both options (the
references' ``route_grad="both"``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .chunks import LINEAR, SOFTMAX, compute_dtype, weighted_exp


def _softmax_attention_loop(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            key_weight, scale: float | None) -> torch.Tensor:
    """Query by query; ``key_weight(i)`` gives ``[B, i+1, Hq]`` weights of keys ``0..i``."""
    dt = compute_dtype(q)
    q, k, v = q.to(dt), k.to(dt), v.to(dt)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    outs = []
    for i in range(q.shape[1]):
        s = torch.einsum("bhd,bjhd->bjh", q[:, i], k[:, : i + 1]) * scale
        w = key_weight(i)
        m = s.masked_fill(w.detach() <= 0, float("-inf")).amax(1, keepdim=True).detach()
        p = weighted_exp(s - m, w)
        outs.append(torch.einsum("bjh,bjhd->bhd", p, v[:, : i + 1]) / p.sum(1)[..., None])
    return torch.stack(outs, 1)


def causal_softmax_attention_recurrent(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                       scale: float | None = None) -> torch.Tensor:
    """Causal softmax attention, one query at a time."""
    def all_keys(i: int) -> torch.Tensor:
        return torch.ones(q.shape[0], i + 1, q.shape[2], dtype=compute_dtype(q), device=q.device)
    return _softmax_attention_loop(q, k, v, all_keys, scale).to(v.dtype)


def hybrid_softmax_attention_recurrent(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                       routes: torch.Tensor, chunk_size: int,
                                       scale: float | None = None) -> torch.Tensor:
    """Softmax branch, one query at a time: own chunk up to ``i``, earlier SM chunks."""
    heads_sm, heads = q.shape[2], routes.shape[2]
    z_sm = routes[..., SOFTMAX].to(compute_dtype(q)).repeat_interleave(heads_sm // heads, dim=2)

    def key_weight(i: int) -> torch.Tensor:
        own = i // chunk_size
        ones = torch.ones_like(z_sm[:, 0])
        weights = [z_sm[:, j // chunk_size] if j // chunk_size < own else ones
                   for j in range(i + 1)]
        return torch.stack(weights, 1)
    return _softmax_attention_loop(q, k, v, key_weight, scale).to(v.dtype)


def _delta_step(state: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                beta: torch.Tensor) -> torch.Tensor:
    """``S <- a (I - b k k^T) S + b k v^T`` for ``S`` of shape ``[B, H, Dk, Dv]``."""
    a, b = g.exp()[..., None, None], beta[..., None, None]
    decayed = a * state
    kk_s = k[..., :, None] * torch.einsum("bhk,bhkv->bhv", k, decayed)[..., None, :]
    return decayed - b * kk_s + b * k[..., :, None] * v[..., None, :]


def _initial_state(q: torch.Tensor, v: torch.Tensor, initial_state: torch.Tensor | None,
                   ) -> torch.Tensor:
    batch, _, heads, d_k = q.shape
    if initial_state is None:
        return torch.zeros(batch, heads, d_k, v.shape[-1], dtype=q.dtype, device=q.device)
    return initial_state.to(q.dtype)


def gated_delta_rule_recurrent(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                               beta: torch.Tensor, scale: float | None = None,
                               initial_state: torch.Tensor | None = None,
                               output_final_state: bool = False,
                               ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The gated delta rule, token by token (no routes)."""
    out_dtype, dt = v.dtype, compute_dtype(q)
    q, k, v, g, beta = (x.to(dt) for x in (q, k, v, g, beta))
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    state = _initial_state(q, v, initial_state)
    outs = []
    for t in range(q.shape[1]):
        state = _delta_step(state, k[:, t], v[:, t], g[:, t], beta[:, t])
        outs.append(scale * torch.einsum("bhk,bhkv->bhv", q[:, t], state))
    return torch.stack(outs, 1).to(out_dtype), state if output_final_state else None


def hybrid_gated_delta_rule_recurrent(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                      g: torch.Tensor, beta: torch.Tensor, routes: torch.Tensor,
                                      chunk_size: int, scale: float | None = None,
                                      initial_state: torch.Tensor | None = None,
                                      output_final_state: bool = False,
                                      ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Linear branch, token by token (see :func:`_routed_scan`)."""
    dt = compute_dtype(q)
    k, v, beta = (x.to(dt) for x in (k, v, beta))

    def step(state: torch.Tensor, t: int, g_t: torch.Tensor) -> torch.Tensor:
        return _delta_step(state, k[:, t], v[:, t], g_t, beta[:, t])
    return _routed_scan(step, q, v, g, routes, chunk_size, scale, initial_state,
                        output_final_state)


def _gla_step(state: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
              ) -> torch.Tensor:
    """``S <- a S + k v^T`` for ``S`` of shape ``[B, H, Dk, Dv]``."""
    return g.exp()[..., None, None] * state + k[..., :, None] * v[..., None, :]


def gated_linear_attention_recurrent(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                     g: torch.Tensor, scale: float | None = None,
                                     initial_state: torch.Tensor | None = None,
                                     output_final_state: bool = False,
                                     ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Gated linear attention, token by token (no routes)."""
    out_dtype, dt = v.dtype, compute_dtype(q)
    q, k, v, g = (x.to(dt) for x in (q, k, v, g))
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    state = _initial_state(q, v, initial_state)
    outs = []
    for t in range(q.shape[1]):
        state = _gla_step(state, k[:, t], v[:, t], g[:, t])
        outs.append(scale * torch.einsum("bhk,bhkv->bhv", q[:, t], state))
    return torch.stack(outs, 1).to(out_dtype), state if output_final_state else None


def hybrid_gated_linear_attention_recurrent(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                            g: torch.Tensor, routes: torch.Tensor,
                                            chunk_size: int, scale: float | None = None,
                                            initial_state: torch.Tensor | None = None,
                                            output_final_state: bool = False,
                                            ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Routed gated linear attention, token by token (see :func:`_routed_scan`)."""
    dt = compute_dtype(q)
    k, v = k.to(dt), v.to(dt)

    def step(state: torch.Tensor, t: int, g_t: torch.Tensor) -> torch.Tensor:
        return _gla_step(state, k[:, t], v[:, t], g_t)
    return _routed_scan(step, q, v, g, routes, chunk_size, scale, initial_state,
                        output_final_state)


def _routed_scan(step, q: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                 routes: torch.Tensor, chunk_size: int, scale: float | None,
                 initial_state: torch.Tensor | None, output_final_state: bool,
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A gated recurrence ``state = step(state, t, g_t)`` read out as ``scale S_t^T q_t``,
    with NATSL.md's routes.

    Within a chunk every token steps on from the chunk-start state. When the chunk ends,
    the carried state is ``decayed + z[LA] * (stepped - decayed)``, with ``decayed`` the
    chunk-start state times the chunk's total gate.
    """
    out_dtype, dt = v.dtype, compute_dtype(q)
    q, g = q.to(dt), g.to(dt)
    z_la = routes[..., LINEAR].to(dt)
    seq_len = q.shape[1]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    state = chunk_start = _initial_state(q, v.to(dt), initial_state)
    chunk_log_decay = torch.zeros_like(g[:, 0])
    outs = []
    for t in range(seq_len):
        state = step(state, t, g[:, t])
        chunk_log_decay = chunk_log_decay + g[:, t]
        outs.append(scale * torch.einsum("bhk,bhkv->bhv", q[:, t], state))
        if t % chunk_size == chunk_size - 1 or t == seq_len - 1:
            decayed = chunk_log_decay.exp()[..., None, None] * chunk_start
            z = z_la[:, t // chunk_size][..., None, None]
            state = chunk_start = decayed + z * (state - decayed)
            chunk_log_decay = torch.zeros_like(chunk_log_decay)
    return torch.stack(outs, 1).to(out_dtype), state if output_final_state else None


def linear_attention_recurrent(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                               initial_state: torch.Tensor | None = None,
                               output_final_state: bool = False, eps: float = 1e-6,
                               ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """ELU+1 linear attention with its normaliser, token by token, as Katharopoulos et al.
    write it: ``S_t = S_{t-1} + phi(k_t) v_t^T``, ``z_t = z_{t-1} + phi(k_t)``,
    ``o_t = phi(q_t)^T S_t / (phi(q_t)^T z_t + eps)``. The state in and out is
    ``[B, H, Dk, Dv + 1]``: ``S``, then ``z`` as the last column."""
    return _linear_attention_scan(q, k, v, None, 0, initial_state, output_final_state, eps)


def hybrid_linear_attention_recurrent(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                      routes: torch.Tensor, chunk_size: int,
                                      initial_state: torch.Tensor | None = None,
                                      output_final_state: bool = False, eps: float = 1e-6,
                                      ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Routed ELU+1 linear attention, token by token: ``S`` and ``z`` both restart each
    chunk from the chunk-start values and carry the chunk's writes on only where it went
    to linear (no gate, so nothing decays)."""
    return _linear_attention_scan(q, k, v, routes, chunk_size, initial_state,
                                  output_final_state, eps)


def _linear_attention_scan(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           routes: torch.Tensor | None, chunk_size: int,
                           initial_state: torch.Tensor | None, output_final_state: bool,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    out_dtype, dt = v.dtype, compute_dtype(q)
    q, k, v = F.elu(q.to(dt)) + 1, F.elu(k.to(dt)) + 1, v.to(dt)
    batch, seq_len, heads, d_k = q.shape
    s = torch.zeros(batch, heads, d_k, v.shape[-1], dtype=dt, device=q.device)
    z = torch.zeros(batch, heads, d_k, dtype=dt, device=q.device)
    if initial_state is not None:
        s, z = initial_state[..., :-1].to(dt), initial_state[..., -1].to(dt)
    s_start, z_start = s, z
    outs = []
    for t in range(seq_len):
        s = s + k[:, t, :, :, None] * v[:, t, :, None, :]
        z = z + k[:, t]
        numerator = torch.einsum("bhk,bhkv->bhv", q[:, t], s)
        outs.append(numerator / ((q[:, t] * z).sum(-1, keepdim=True) + eps))
        if routes is not None and (t % chunk_size == chunk_size - 1 or t == seq_len - 1):
            w = routes[:, t // chunk_size, :, LINEAR].to(dt)
            s = s_start = s_start + w[..., None, None] * (s - s_start)
            z = z_start = z_start + w[..., None] * (z - z_start)
    state = torch.cat([s, z[..., None]], -1)
    return torch.stack(outs, 1).to(out_dtype), state if output_final_state else None
