"""Linear attention with the ELU+1 feature map and its normaliser (Katharopoulos et al.,
"Transformers are RNNs"), routed, built on gated linear attention.

Per token, with ``phi(x) = elu(x) + 1`` applied to q and k inside the operator:
``S_t = S_{t-1} + phi(k_t) v_t^T``, ``z_t = z_{t-1} + phi(k_t)`` and
``o_t = phi(q_t)^T S_t / (phi(q_t)^T z_t + eps)``.

``S`` and ``z`` are one recurrence: gated linear attention with ``g = 0``, scale 1 and
the values ``[v_t, 1]``. So the **state is ``[B, H, Dk, Dv + 1]`` (float32): columns
``:Dv`` are ``S``, the last column is ``z``**, and ``z`` follows the routes exactly as
``S`` does (decoding and the inference cache keep this layout).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from .chunks import LINEAR, RouteGrad, compute_dtype, num_chunks
from .gated_linear_attention import hybrid_gated_linear_attention

GatedLinearAttention = Callable[..., tuple[torch.Tensor, torch.Tensor | None]]


def elu_feature_map(x: torch.Tensor) -> torch.Tensor:
    """``phi(x) = elu(x) + 1``: positive, so the normaliser ``phi(q)^T z`` stays positive."""
    return F.elu(x) + 1


def normalised_linear_attention(gla: GatedLinearAttention, q: torch.Tensor, k: torch.Tensor,
                                v: torch.Tensor, routes: torch.Tensor, chunk_size: int,
                                initial_state: torch.Tensor | None = None,
                                output_final_state: bool = False, *, eps: float = 1e-6,
                                route_grad: RouteGrad = "selected",
                                cu_seqlens: torch.Tensor | None = None, width_multiple: int = 1,
                                ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Linear attention through ``gla`` (a ``hybrid_gated_linear_attention`` of any
    backend), so that every backend shares this one composition.

    ``width_multiple``: the values ``[v, 1]`` (and the state) are zero-padded to a multiple
    of it inside, which changes nothing but speed: the Triton kernels load rows of 129
    columns unaligned, so they get 64 (timings: docs/LINEAR_OPS.md).
    """
    d_v = v.shape[-1]
    if initial_state is not None and initial_state.shape[-1] != d_v + 1:
        raise ValueError(f"initial_state must be [B, H, Dk, Dv + 1] (last column: the "
                         f"normaliser z) with Dv = {d_v}, got {list(initial_state.shape)}")
    pad = -(d_v + 1) % width_multiple
    values = torch.cat([v, v.new_ones(*v.shape[:-1], 1), v.new_zeros(*v.shape[:-1], pad)], -1)
    if initial_state is not None and pad:
        initial_state = F.pad(initial_state, (0, pad))
    no_decay = torch.zeros(q.shape[:3], dtype=torch.float32, device=q.device)
    o, state = gla(elu_feature_map(q), elu_feature_map(k), values, no_decay, routes,
                   chunk_size, 1.0, initial_state, output_final_state, route_grad=route_grad,
                   cu_seqlens=cu_seqlens)
    numerator, normaliser = o[..., : d_v + 1].to(compute_dtype(o)).split([d_v, 1], -1)
    if state is not None and pad:
        state = state[..., : d_v + 1].contiguous()
    return (numerator / (normaliser + eps)).to(v.dtype), state


def hybrid_linear_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            routes: torch.Tensor, chunk_size: int,
                            initial_state: torch.Tensor | None = None,
                            output_final_state: bool = False, *, eps: float = 1e-6,
                            route_grad: RouteGrad = "selected",
                            cu_seqlens: torch.Tensor | None = None,
                            ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Routed ELU+1 linear attention. q, k ``[B, T, H, Dk]`` (raw: phi is applied here),
    v ``[B, T, H, Dv]``, routes ``[B, N, H, 2]``, state ``[B, H, Dk, Dv + 1]`` (see the
    module docstring). Returns ``(o [B, T, H, Dv], final_state)``."""
    return normalised_linear_attention(hybrid_gated_linear_attention, q, k, v, routes,
                                       chunk_size, initial_state, output_final_state, eps=eps,
                                       route_grad=route_grad, cu_seqlens=cu_seqlens)


def linear_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     initial_state: torch.Tensor | None = None, output_final_state: bool = False,
                     eps: float = 1e-6, chunk_size: int = 64,
                     ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Plain ELU+1 linear attention (every chunk writes): the all-linear baseline."""
    batch, seq_len, heads, _ = q.shape
    routes = torch.zeros(batch, num_chunks(seq_len, chunk_size), heads, 2, dtype=q.dtype,
                         device=q.device)
    routes[..., LINEAR] = 1
    return hybrid_linear_attention(q, k, v, routes, chunk_size, initial_state,
                                   output_final_state, eps=eps)
