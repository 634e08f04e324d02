"""Linear side of NAtS-L: the chunked gated delta rule with routes (plain PyTorch).

Per token, with the state ``S`` of shape ``[Dk, Dv]``:
``S_t = a_t (I - b_t k_t k_t^T) S_{t-1} + b_t k_t v_t^T`` and ``o_t = scale * S_t^T q_t``.

Chunk form (one routing chunk at a time, the WY/UT transform within it): with the
within-chunk cumulative log gate ``G``, ``Gamma_t = exp(G_t)`` and the chunk-start state
``S_c``, the rows ``W_t = b_t (v_t - a_t S_{t-1}^T k_t)`` solve
``(I + A) W = diag(b) V - diag(b Gamma) K S_c`` with
``A_ts = b_t exp(G_t - G_s) k_t.k_s`` for ``s < t``. Then

* ``o_t = scale (Gamma_t S_c^T q_t + sum_{s<=t} exp(G_t - G_s) (q_t.k_s) W_s)``
* ``S_{c+1} = Gamma_L S_c + z[c, LA] * sum_s exp(G_L - G_s) k_s W_s^T``

so every chunk decays the carried state, and only the write is weighted by the route.
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


def hybrid_gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                            beta: torch.Tensor, routes: torch.Tensor, chunk_size: int,
                            scale: float | None = None, initial_state: torch.Tensor | None = None,
                            output_final_state: bool = False, *,
                            route_grad: RouteGrad = "selected",
                            cu_seqlens: torch.Tensor | None = None,
                            ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Linear branch of NAtS-L.

    q, k ``[B, T, H, Dk]`` (L2-normalised by the caller), v ``[B, T, H, Dv]``, g
    ``[B, T, H]`` log decay (<= 0), beta ``[B, T, H]``, routes ``[B, N, H, 2]`` one-hot
    (index 1 = linear), state ``[B, H, Dk, Dv]`` (float32). Returns ``(o, final_state)``;
    the final state is the one carried past the last chunk, after its route.
    Only ``routes[..., 1]`` receives a gradient.

    ``cu_seqlens`` (int offsets ``[n_seq + 1]``, batch of 1) packs several sequences along
    T, FlashAttention style: each has its own chunks, routes are ``[1, N_total, H, 2]``
    with the sequences' chunks concatenated, and states are ``[n_seq, H, Dk, Dv]``.
    """
    if cu_seqlens is not None:
        return run_packed(hybrid_gated_delta_rule, (q, k, v, g, beta), routes, chunk_size,
                          initial_state, output_final_state, cu_seqlens, scale=scale,
                          route_grad=route_grad)
    batch, seq_len, heads, d_k = check_token_inputs(q, k, v, {"g": g, "beta": beta},
                                                    initial_state)
    check_chunk_size(chunk_size)
    check_routes(routes, batch, seq_len, chunk_size, heads)
    d_v = v.shape[-1]
    scale = d_k**-0.5 if scale is None else scale
    dt = compute_dtype(q)
    n, c = num_chunks(seq_len, chunk_size), chunk_size

    q, k, v, g, beta = (pad_to_chunks(x, c, dt) for x in (q * scale, k, v, g, beta))
    gc = g.cumsum(-1)
    incl = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()
    strict = incl.tril(-1)
    decay = (gc[..., :, None] - gc[..., None, :]).masked_fill(~incl, float("-inf")).exp()
    a = (beta[..., :, None] * decay * (k @ k.transpose(-1, -2))).masked_fill(~strict, 0)
    eye = torch.eye(c, dtype=dt, device=q.device)
    t_inv = torch.linalg.solve_triangular(eye + a, eye.expand_as(a), upper=False,
                                          unitriangular=True)
    u = t_inv @ (beta[..., None] * v)
    w = t_inv @ ((beta * gc.exp())[..., None] * k)
    qk = (q @ k.transpose(-1, -2)) * decay
    q_decayed = q * gc.exp()[..., None]
    k_to_end = k * (gc[..., -1:] - gc).exp()[..., None]
    z = route_weight(routes[..., LINEAR], route_grad).to(dt).permute(0, 2, 1)  # [B, H, N]

    state = (torch.zeros(batch, heads, d_k, d_v, dtype=dt, device=q.device)
             if initial_state is None else initial_state.to(dt))
    chunk_decay = gc[..., -1, None, None].exp()
    # Chunk-major copies, one chunk at a time: slicing [B, H, N, ...] per chunk would make
    # autograd zero-fill a full-size gradient for every slice.
    per_chunk = (x.movedim(2, 0).contiguous().unbind(0)
                 for x in (u, w, q_decayed, qk, k_to_end, chunk_decay, z[..., None, None]))
    outs = []
    for u_i, w_i, qd_i, qk_i, ke_i, decay_i, z_i in zip(*per_chunk, strict=True):
        w_rows = u_i - w_i @ state
        outs.append(qd_i @ state + qk_i @ w_rows)
        state = decay_i * state + z_i * (ke_i.transpose(-1, -2) @ w_rows)
    o = torch.stack(outs, 2).reshape(batch, heads, n * c, d_v)[:, :, :seq_len].transpose(1, 2)
    return o.to(v.dtype), state if output_final_state else None


def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                     beta: torch.Tensor, scale: float | None = None,
                     initial_state: torch.Tensor | None = None, output_final_state: bool = False,
                     chunk_size: int = 64) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Plain chunked gated delta rule (every chunk writes): the Gated DeltaNet baseline."""
    batch, seq_len, heads, _ = q.shape
    routes = torch.zeros(batch, num_chunks(seq_len, chunk_size), heads, 2, dtype=q.dtype,
                         device=q.device)
    routes[..., LINEAR] = 1
    return hybrid_gated_delta_rule(q, k, v, g, beta, routes, chunk_size, scale, initial_state,
                                   output_final_state)

