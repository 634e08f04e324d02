"""Token-by-token forms of every operator: the independent test oracles.

Each walks the sequence one token at a time, exactly as NATSL.md words it, and shares
no operator code with the chunked references (only the guard against ``0 * inf``).
They are slow (a Python loop over T) and meant for tests and tiny shapes. Routes act
as plain weights here, so autograd gives the true derivative at both options (the
references' ``route_grad="both"``).
"""

from __future__ import annotations

import torch

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
    """Linear branch, token by token.

    Within a chunk every token runs the delta rule on from the chunk-start state. When
    the chunk ends, the carried state is ``decayed + z[LA] * (written - decayed)``, with
    ``decayed`` the chunk-start state times the chunk's total gate.
    """
    out_dtype, dt = v.dtype, compute_dtype(q)
    q, k, v, g, beta = (x.to(dt) for x in (q, k, v, g, beta))
    z_la = routes[..., LINEAR].to(dt)
    seq_len = q.shape[1]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    state = chunk_start = _initial_state(q, v, initial_state)
    chunk_log_decay = torch.zeros_like(g[:, 0])
    outs = []
    for t in range(seq_len):
        state = _delta_step(state, k[:, t], v[:, t], g[:, t], beta[:, t])
        chunk_log_decay = chunk_log_decay + g[:, t]
        outs.append(scale * torch.einsum("bhk,bhkv->bhv", q[:, t], state))
        if t % chunk_size == chunk_size - 1 or t == seq_len - 1:
            decayed = chunk_log_decay.exp()[..., None, None] * chunk_start
            z = z_la[:, t // chunk_size][..., None, None]
            state = chunk_start = decayed + z * (state - decayed)
            chunk_log_decay = torch.zeros_like(chunk_log_decay)
    return torch.stack(outs, 1).to(out_dtype), state if output_final_state else None
