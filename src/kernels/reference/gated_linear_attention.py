"""Gated linear attention with routes: the chunked form in plain PyTorch.

Per token, with the state ``S`` of shape ``[Dk, Dv]`` and a scalar data-dependent decay
``a_t = exp(g_t)`` (the Mamba2 / RetNet family, no delta correction):
``S_t = a_t S_{t-1} + k_t v_t^T`` and ``o_t = scale * S_t^T q_t``.

Chunk form: with the within-chunk cumulative log gate ``G`` and the chunk-start state
``S_c``,

* ``o_t = scale (exp(G_t) S_c^T q_t + sum_{s<=t} exp(G_t - G_s) (q_t.k_s) v_s)``
* ``S_{c+1} = exp(G_L) S_c + z[c, LA] * sum_s exp(G_L - G_s) k_s v_s^T``

so, as for the gated delta rule (NATSL.md), every chunk decays the carried state, only
linear-routed chunks write to it, and every query sees its own chunk from ``S_c``.
"""

from __future__ import annotations

import torch

from .chunks import (
    LINEAR,
    RouteGrad,
    check_chunk_size,
    check_routes,
    check_token_inputs,
    compute_dtype,
    num_chunks,
    pad_to_chunks,
    route_weight,
    run_packed,
)


def hybrid_gated_linear_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                  g: torch.Tensor, routes: torch.Tensor, chunk_size: int,
                                  scale: float | None = None,
                                  initial_state: torch.Tensor | None = None,
                                  output_final_state: bool = False, *,
                                  route_grad: RouteGrad = "selected",
                                  cu_seqlens: torch.Tensor | None = None,
                                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Routed gated linear attention.

    q, k ``[B, T, H, Dk]``, v ``[B, T, H, Dv]``, g ``[B, T, H]`` log decay (<= 0), routes
    ``[B, N, H, 2]`` one-hot (index 1 = linear), state ``[B, H, Dk, Dv]`` (float32).
    Returns ``(o, final_state)``; the final state is the one carried past the last chunk,
    after its route. Only ``routes[..., 1]`` receives a gradient: the derivative w.r.t.
    the chunk's 0/1 write weight. ``cu_seqlens`` packs sequences along T exactly as for
    :func:`~.gated_delta_rule.hybrid_gated_delta_rule`.
    """
    if cu_seqlens is not None:
        return run_packed(hybrid_gated_linear_attention, (q, k, v, g), routes, chunk_size,
                          initial_state, output_final_state, cu_seqlens, scale=scale,
                          route_grad=route_grad)
    batch, seq_len, heads, d_k = check_token_inputs(q, k, v, {"g": g}, initial_state)
    check_chunk_size(chunk_size)
    check_routes(routes, batch, seq_len, chunk_size, heads)
    d_v = v.shape[-1]
    scale = d_k**-0.5 if scale is None else scale
    dt, out_dtype = compute_dtype(q), v.dtype
    n, c = num_chunks(seq_len, chunk_size), chunk_size
    q, k, v, g = (pad_to_chunks(x, c, dt) for x in (q * scale, k, v, g))
    gc = g.cumsum(-1)
    causal = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()
    decay = (gc[..., :, None] - gc[..., None, :]).masked_fill(~causal, float("-inf")).exp()
    qk = (q @ k.transpose(-1, -2)) * decay
    q_decayed = q * gc.exp()[..., None]
    k_to_end = k * (gc[..., -1:] - gc).exp()[..., None]
    z = route_weight(routes[..., LINEAR], route_grad).to(dt).permute(0, 2, 1)  # [B, H, N]

    state = (torch.zeros(batch, heads, d_k, d_v, dtype=dt, device=q.device)
             if initial_state is None else initial_state.to(dt))
    outs = []
    for i in range(n):
        outs.append(q_decayed[:, :, i] @ state + qk[:, :, i] @ v[:, :, i])
        write = k_to_end[:, :, i].transpose(-1, -2) @ v[:, :, i]
        state = gc[:, :, i, -1, None, None].exp() * state + z[:, :, i, None, None] * write
    o = torch.stack(outs, 2).reshape(batch, heads, n * c, d_v)[:, :, :seq_len].transpose(1, 2)
    return o.to(out_dtype), state if output_final_state else None


def gated_linear_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                           scale: float | None = None, initial_state: torch.Tensor | None = None,
                           output_final_state: bool = False, chunk_size: int = 64,
                           ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Plain chunked gated linear attention (every chunk writes): the all-linear baseline."""
    batch, seq_len, heads, _ = q.shape
    routes = torch.zeros(batch, num_chunks(seq_len, chunk_size), heads, 2, dtype=q.dtype,
                         device=q.device)
    routes[..., LINEAR] = 1
    return hybrid_gated_linear_attention(q, k, v, g, routes, chunk_size, scale, initial_state,
                                         output_final_state)
