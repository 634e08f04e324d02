"""One-token decode operators against the hybrid inference cache (plain PyTorch)."""

from __future__ import annotations

import torch

from .reference.chunks import compute_dtype


def gated_delta_rule_step(state: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          g: torch.Tensor, beta: torch.Tensor, scale: float,
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of the gated delta rule.

    state ``[B, H, Dk, Dv]`` (float32), q, k ``[B, H, Dk]``, v ``[B, H, Dv]``, g, beta
    ``[B, H]``. Returns ``(o [B, H, Dv], new_state)`` with
    ``S' = a (I - b k k^T) S + b k v^T`` and ``o = scale * S'^T q``.
    """
    q, k, v, g, beta = (t.to(state.dtype) for t in (q, k, v, g, beta))
    decayed = g.exp()[..., None, None] * state
    b = beta[..., None]
    delta = b * (v - torch.einsum("bhk,bhkv->bhv", k, decayed))  # b (v - a S^T k)
    new_state = decayed + k[..., :, None] * delta[..., None, :]
    return scale * torch.einsum("bhk,bhkv->bhv", q, new_state), new_state


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                     valid: torch.Tensor | None = None) -> torch.Tensor:
    """Softmax attention of one query per head over cached keys.

    q ``[B, Hq, D]``, k ``[B, Hq, L, D]``, v ``[B, Hq, L, Dv]``, ``valid`` ``[B, Hq, L]``
    marks real keys (every query has at least its own key). Returns ``[B, Hq, Dv]``.
    """
    dt = compute_dtype(q)
    s = torch.einsum("bhd,bhld->bhl", q.to(dt), k.to(dt)) * scale
    if valid is not None:
        s = s.masked_fill(~valid, float("-inf"))
    return torch.einsum("bhl,bhld->bhd", torch.softmax(s, -1), v.to(dt)).to(v.dtype)


def hybrid_attention_decode(q: torch.Tensor, store_k: torch.Tensor, store_v: torch.Tensor,
                            store_chunks: torch.Tensor, chunk_k: torch.Tensor,
                            chunk_v: torch.Tensor, scale: float) -> torch.Tensor:
    """Softmax branch for one token: the stored softmax chunks, then its own chunk.

    q ``[B, H*r, D]``; store ``[B, H, M, C, r, D]`` holds per routing head the keys of
    its softmax chunks in order, of which the first ``store_chunks[b, h]`` are real;
    chunk_k ``[B, n, H*r, D]`` is the own chunk up to and including this token.
    """
    batch, heads, slots, chunk, r, d = store_k.shape
    flat = (batch, heads * r, slots * chunk)
    k_store = store_k.permute(0, 1, 4, 2, 3, 5).reshape(*flat, d)
    v_store = store_v.permute(0, 1, 4, 2, 3, 5).reshape(*flat, store_v.shape[-1])
    slot = torch.arange(slots * chunk, device=q.device) // chunk
    valid_store = (slot[None, None] < store_chunks[..., None]).repeat_interleave(r, 1)
    k_all = torch.cat([k_store, chunk_k.transpose(1, 2)], 2)
    v_all = torch.cat([v_store, chunk_v.transpose(1, 2)], 2)
    valid_own = torch.ones(*flat[:2], chunk_k.shape[1], dtype=torch.bool, device=q.device)
    return decode_attention(q, k_all, v_all, scale, torch.cat([valid_store, valid_own], 2))
