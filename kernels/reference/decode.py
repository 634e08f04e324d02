"""One-token decode operators against the hybrid inference cache (plain PyTorch)."""

from __future__ import annotations

import torch

from .reference.chunks import compute_dtype
from .reference.linear_attention import elu_feature_map


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


def gated_linear_attention_step(state: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                                v: torch.Tensor, g: torch.Tensor, scale: float,
                                ) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of gated linear attention.

    state ``[B, H, Dk, Dv]`` (float32), q, k ``[B, H, Dk]``, v ``[B, H, Dv]``, g ``[B, H]``.
    Returns ``(o [B, H, Dv], new_state)`` with ``S' = exp(g) S + k v^T``, ``o = scale S'^T q``.
    """
    q, k, v, g = (t.to(state.dtype) for t in (q, k, v, g))
    new_state = g.exp()[..., None, None] * state + k[..., :, None] * v[..., None, :]
    return scale * torch.einsum("bhk,bhkv->bhv", q, new_state), new_state


def linear_attention_step(state: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                          v: torch.Tensor, eps: float = 1e-6,
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of ELU+1 linear attention.

    state ``[B, H, Dk, Dv + 1]`` (float32; columns ``:Dv`` are ``S``, the last is the
    normaliser ``z``), q, k ``[B, H, Dk]`` raw (phi is applied here), v ``[B, H, Dv]``.
    Returns ``(o [B, H, Dv], new_state)``: the gated step with ``g = 0``, scale 1 and the
    values ``[v, 1]``, then ``o = S'^T phi(q) / (z'^T phi(q) + eps)``.
    """
    values = torch.cat([v, v.new_ones(*v.shape[:-1], 1)], -1)
    no_decay = torch.zeros(q.shape[:2], dtype=state.dtype, device=q.device)
    out, new_state = gated_linear_attention_step(state, elu_feature_map(q), elu_feature_map(k),
                                                 values, no_decay, 1.0)
    return (out[..., :-1] / (out[..., -1:] + eps)).to(v.dtype), new_state

def decode_attention(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor],
                     scale: float, valid: list[torch.Tensor | None]) -> torch.Tensor:
    """Softmax attention of one query per head over several key segments.

    q ``[B, Hq, D]``; segment ``i`` has keys ``[B, Hq, L_i, D]``, values
    ``[B, Hq, L_i, Dv]`` and ``valid[i]`` ``[B, Hq, L_i]`` (or None: all real). One
    softmax spans all segments; they are never concatenated, so a step copies no cache.
    """
    dt = compute_dtype(q)
    q = q.to(dt)
    scores = []
    for k, mask in zip(keys, valid, strict=True):
        s = torch.einsum("bhd,bhld->bhl", q, k.to(dt)) * scale
        scores.append(s if mask is None else s.masked_fill(~mask, float("-inf")))
    p = torch.softmax(torch.cat(scores, -1), -1).split([s.shape[-1] for s in scores], -1)
    out = sum(torch.einsum("bhl,bhld->bhd", pi, v.to(dt)) for pi, v in zip(p, values,
                                                                          strict=True))
    return out.to(values[0].dtype)


def hybrid_attention_decode(q: torch.Tensor, store_k: torch.Tensor, store_v: torch.Tensor,
                            store_chunks: torch.Tensor, chunk_k: torch.Tensor,
                            chunk_v: torch.Tensor, scale: float) -> torch.Tensor:
    """Softmax branch for one token: the stored softmax chunks, then its own chunk.

    q ``[B, H*r, D]``; store ``[B, H, r, M, C, D]`` holds per routing head the keys of
    its softmax chunks in order, of which the first ``store_chunks[b, h]`` are real;
    chunk_k ``[B, H*r, n, D]`` is the own chunk up to and including this token.
    """
    r, slots, chunk = store_k.shape[2:5]
    slot = torch.arange(slots * chunk, device=q.device) // chunk
    valid = slot < store_chunks[..., None]  # [B, H, M*C]

    def flat(t: torch.Tensor) -> torch.Tensor:  # a view: [B, H*r, M*C, D]
        return t.flatten(3, 4).flatten(1, 2)

    return decode_attention(q, [flat(store_k), chunk_k], [flat(store_v), chunk_v], scale,
                            [valid.repeat_interleave(r, 1), None])
