"""Softmax side of NAtS-L as a dense masked computation (plain PyTorch).

A query in chunk ``c`` sees the keys of every earlier chunk routed to softmax, plus the
keys ``j <= i`` of its own chunk. The route enters as a 0/1 weight on ``exp(score)`` in
numerator and denominator (NATSL.md, "Gradient of the route"), so autograd yields the
route gradient directly. Memory is ``O(T^2)``: this is the reference, not the fast path.
"""

from __future__ import annotations

import torch

from .chunks import (
    SOFTMAX,
    RouteGrad,
    check_chunk_size,
    check_routes,
    chunk_ids,
    compute_dtype,
    packed_chunk_counts,
    packed_lengths,
    route_weight,
    weighted_exp,
)


def weighted_softmax_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                               weights: torch.Tensor, scale: float) -> torch.Tensor:
    """``o_i = sum_j w_ij e^{s_ij} v_j / sum_j w_ij e^{s_ij}`` over dense key weights.

    q, k ``[B, T, Hq, Dk]``, v ``[B, T, Hq, Dv]``, weights broadcastable to
    ``[B, Hq, T, T]`` (0 where a key is invisible). Every query must see itself. An
    invisible key enters as ``0 * exp(capped score)``: finite scores never reach a query
    that cannot see them, a NaN would.
    """
    dt = compute_dtype(q)
    s = torch.einsum("bihd,bjhd->bhij", q.to(dt) * scale, k.to(dt))
    # Subtracting the max over visible keys keeps exp() in range; it cancels exactly.
    # Invisible keys (the future, earlier chunks routed to linear) keep their weight 0 in
    # the product, so that the "both" route gradient exists at earlier chunks.
    m = s.detach().masked_fill(weights.detach() <= 0, float("-inf")).amax(-1, keepdim=True)
    p = weighted_exp(s - m, weights.to(dt))
    o = torch.einsum("bhij,bjhd->bihd", p, v.to(dt)) / p.sum(-1).transpose(1, 2).unsqueeze(-1)
    return o.to(v.dtype)


def _causal(seq_len: int, device: torch.device) -> torch.Tensor:
    return torch.ones(seq_len, seq_len, dtype=torch.bool, device=device).tril()


def hybrid_key_weights(routes_sm: torch.Tensor, seq_len: int, chunk_size: int) -> torch.Tensor:
    """Dense key weights ``[B, H, T, T]`` from softmax routes ``[B, N, H]``.

    Own chunk, ``j <= i``: 1. Earlier chunk ``c'``: ``z[c', SM]``. Otherwise 0.
    """
    cid = chunk_ids(seq_len, chunk_size, routes_sm.device)
    same = (cid[:, None] == cid[None, :]) & _causal(seq_len, routes_sm.device)
    earlier = cid[None, :] < cid[:, None]
    z_key = routes_sm[:, cid].permute(0, 2, 1)[:, :, None, :]  # [B, H, 1, T]: route of key's chunk
    return torch.where(earlier, z_key, same.to(routes_sm.dtype))


def hybrid_softmax_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             routes: torch.Tensor, chunk_size: int, scale: float | None = None,
                             *, route_grad: RouteGrad = "selected",
                             cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
    """Softmax branch of NAtS-L.

    q, k ``[B, T, H*r, Dk]``, v ``[B, T, H*r, Dv]``, routes ``[B, N, H, 2]`` one-hot
    (index 0 = softmax). The ``r`` softmax heads ``h*r .. h*r+r-1`` share route ``h``.
    Returns ``[B, T, H*r, Dv]``. Only ``routes[..., 0]`` receives a gradient.

    With ``cu_seqlens`` (``[n_seq+1]`` cumulative offsets, FlashAttention convention),
    B is 1 and T holds the sequences back to back; each has its own chunks, and routes
    is ``[1, N_total, H, 2]`` with the sequences' chunks concatenated in order.
    """
    if cu_seqlens is not None:
        return _varlen(q, k, v, routes, chunk_size, scale, route_grad, cu_seqlens)
    _check_qkv(q, k, v)
    check_chunk_size(chunk_size)
    batch, seq_len, heads_sm, d_k = q.shape
    heads = check_routes(routes, batch, seq_len, chunk_size)
    if heads_sm % heads:
        raise ValueError(f"q has {heads_sm} heads, not a multiple of the {heads} routing heads")
    scale = d_k**-0.5 if scale is None else scale
    z = route_weight(routes[..., SOFTMAX], route_grad)
    weights = hybrid_key_weights(z, seq_len, chunk_size)
    weights = weights.repeat_interleave(heads_sm // heads, dim=1)
    return weighted_softmax_attention(q, k, v, weights, scale)


def _varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, routes: torch.Tensor,
            chunk_size: int, scale: float | None, route_grad: RouteGrad,
            cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Packed sequences: the dense operator on each sequence, outputs concatenated."""
    _check_qkv(q, k, v)
    lengths = packed_lengths(cu_seqlens, q.shape[0], q.shape[1])
    chunks = packed_chunk_counts(routes, lengths, chunk_size)
    outs = [hybrid_softmax_attention(qs, ks, vs, rs, chunk_size, scale, route_grad=route_grad)
            for qs, ks, vs, rs in zip(q.split(lengths, 1), k.split(lengths, 1),
                                      v.split(lengths, 1), routes.split(chunks, 1), strict=True)]
    return torch.cat(outs, 1)


def causal_softmax_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             scale: float | None = None) -> torch.Tensor:
    """Plain causal softmax attention, ``[B, T, H, D]`` layout (the baseline)."""
    _check_qkv(q, k, v)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return weighted_softmax_attention(q, k, v, _causal(q.shape[1], q.device), scale)


def _check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    if q.dim() != 4 or q.shape != k.shape:
        raise ValueError(f"q and k must both be [B, T, heads, Dk]; got {list(q.shape)} and "
                         f"{list(k.shape)}")
    if v.dim() != 4 or v.shape[:3] != q.shape[:3]:
        raise ValueError(f"v must be [B, T, heads, Dv] matching q {list(q.shape)}; "
                         f"got {list(v.shape)}")
