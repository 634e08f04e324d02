"""One-token decode operators against the hybrid inference cache (plain PyTorch).

Every buffer has a fixed shape and every count that changes from token to token is a
device tensor, so a decode step launches the same work every time and never reads a
value back to the host: the step can be captured in a CUDA graph.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .chunks import compute_dtype
from .gates import linear_gates
from .linear_attention import elu_feature_map
from .norms import merge_branches
from .short_conv import short_conv


def _written(new_state: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """``new_state``, copied into ``out`` where the caller keeps the state in place."""
    return new_state if out is None else out.copy_(new_state)


def gated_delta_rule_step(state: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          g: torch.Tensor, beta: torch.Tensor, scale: float,
                          out: torch.Tensor | None = None,
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of the gated delta rule.

    state ``[B, H, Dk, Dv]`` (float32), q, k ``[B, H, Dk]``, v ``[B, H, Dv]``, g, beta
    ``[B, H]``. Returns ``(o [B, H, Dv] float32, new_state)`` with
    ``S' = a (I - b k k^T) S + b k v^T`` and ``o = scale * S'^T q``; the new state is
    written into ``out`` when given (``out`` may be ``state``).
    """
    q, k, v, g, beta = (t.to(state.dtype) for t in (q, k, v, g, beta))
    decayed = g.exp()[..., None, None] * state
    b = beta[..., None]
    delta = b * (v - torch.einsum("bhk,bhkv->bhv", k, decayed))  # b (v - a S^T k)
    new_state = decayed + k[..., :, None] * delta[..., None, :]
    o = scale * torch.einsum("bhk,bhkv->bhv", q, new_state)
    return o, _written(new_state, out)


def gated_linear_attention_step(state: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                                v: torch.Tensor, g: torch.Tensor, scale: float,
                                out: torch.Tensor | None = None,
                                ) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of gated linear attention.

    state ``[B, H, Dk, Dv]`` (float32), q, k ``[B, H, Dk]``, v ``[B, H, Dv]``, g ``[B, H]``.
    Returns ``(o [B, H, Dv] float32, new_state)`` with ``S' = exp(g) S + k v^T``,
    ``o = scale S'^T q``; ``out`` as for :func:`gated_delta_rule_step`.
    """
    q, k, v, g = (t.to(state.dtype) for t in (q, k, v, g))
    new_state = g.exp()[..., None, None] * state + k[..., :, None] * v[..., None, :]
    o = scale * torch.einsum("bhk,bhkv->bhv", q, new_state)
    return o, _written(new_state, out)


def linear_attention_step(state: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                          v: torch.Tensor, eps: float = 1e-6, out: torch.Tensor | None = None,
                          gla_step=gated_linear_attention_step,
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of ELU+1 linear attention.

    state ``[B, H, Dk, Dv + 1]`` (float32; columns ``:Dv`` are ``S``, the last is the
    normaliser ``z``), q, k ``[B, H, Dk]`` raw (phi is applied here), v ``[B, H, Dv]``.
    Returns ``(o [B, H, Dv], new_state)``: the gated step (``gla_step``, so that every
    backend composes it the same way) with ``g = 0``, scale 1 and the values ``[v, 1]``,
    then ``o = S'^T phi(q) / (z'^T phi(q) + eps)``.
    """
    values = torch.cat([v, v.new_ones(*v.shape[:-1], 1)], -1)
    no_decay = torch.zeros(q.shape[:2], dtype=state.dtype, device=q.device)
    o, new_state = gla_step(state, elu_feature_map(q), elu_feature_map(k), values, no_decay,
                            1.0, out)
    return (o[..., :-1] / (o[..., -1:] + eps)).to(v.dtype), new_state


class AttentionSplits(NamedTuple):
    """Softmax attention of one query per head before its normalisation, cut into splits of
    its keys: per head and split, the largest base-2 logit ``max`` ``[B, Hq, S]`` (float32,
    float64 from float64 inputs; ``-inf`` for a split without keys), ``total``, the sum of
    ``2^(logit - max)``, and ``acc`` ``[B, Hq, S, Dv]``, the values weighted by those (in
    the same dtype). The attention is
    ``sum_s 2^(max_s - M) acc_s / sum_s 2^(max_s - M) total_s`` with ``M`` the largest
    ``max_s``, which a launch that takes the attention as its input can compute itself
    (:func:`merge_step`), so the splits need no launch of their own to be combined."""

    max: torch.Tensor
    total: torch.Tensor
    acc: torch.Tensor


def _attention(q: torch.Tensor, store_k: torch.Tensor, store_v: torch.Tensor,
               store_len: torch.Tensor, chunk_k: torch.Tensor | None,
               chunk_v: torch.Tensor | None, chunk_len: torch.Tensor | None,
               scale: float | None) -> torch.Tensor:
    """:func:`hybrid_attention_decode` in the compute dtype, not yet rounded to v's."""
    r, slots = store_k.shape[2:4]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    dt = compute_dtype(q)
    q = q.to(dt)
    keys = [store_k.flatten(1, 2)]  # views: [B, H*r, S, D]
    values = [store_v.flatten(1, 2)]
    valid = [(torch.arange(slots, device=q.device) < store_len[..., None])
             .repeat_interleave(r, 1)]
    if chunk_k is not None:
        keys.append(chunk_k)
        values.append(chunk_v)
        valid.append(torch.arange(chunk_k.shape[2], device=q.device) < chunk_len.view(1, 1, 1))
    scores = [torch.einsum("bhd,bhld->bhl", q, k.to(dt)).masked_fill(~ok, float("-inf"))
              for k, ok in zip(keys, valid, strict=True)]
    p = torch.softmax(torch.cat(scores, -1) * scale, -1).split([s.shape[-1] for s in scores], -1)
    return sum(torch.einsum("bhl,bhld->bhd", pi, v.to(dt)) for pi, v in zip(p, values,
                                                                           strict=True))


def hybrid_attention_decode(q: torch.Tensor, store_k: torch.Tensor, store_v: torch.Tensor,
                            store_len: torch.Tensor, chunk_k: torch.Tensor | None = None,
                            chunk_v: torch.Tensor | None = None,
                            chunk_len: torch.Tensor | None = None,
                            scale: float | None = None) -> torch.Tensor:
    """Softmax attention of one query per head over the stored keys and the open chunk.

    q ``[B, H*r, D]``; ``store_k`` ``[B, H, r, S, D]`` (``store_v`` ``[.., Dv]``) holds per
    routing head its stored keys in order, of which the first ``store_len[b, h]`` (int
    ``[B, H]``) are real; ``chunk_k`` ``[B, H*r, C, D]`` is the open chunk, of which the
    first ``chunk_len`` (an int tensor of one element) are real. One softmax spans both
    segments, which are never concatenated, so a step copies no cache. A plain softmax
    layer is the case ``r = 1`` with no open chunk. Returns ``[B, H*r, Dv]`` in v's dtype.
    """
    return _attention(q, store_k, store_v, store_len, chunk_k, chunk_v, chunk_len,
                      scale).to(store_v.dtype)


def hybrid_attention_splits(q: torch.Tensor, store_k: torch.Tensor, store_v: torch.Tensor,
                            store_len: torch.Tensor, chunk_k: torch.Tensor | None = None,
                            chunk_v: torch.Tensor | None = None,
                            chunk_len: torch.Tensor | None = None,
                            scale: float | None = None) -> AttentionSplits:
    """:func:`hybrid_attention_decode` as :class:`AttentionSplits`, in the compute dtype: here
    one split, the normalised attention itself (maximum 0, total 1)."""
    out = _attention(q, store_k, store_v, store_len, chunk_k, chunk_v, chunk_len, scale)
    return AttentionSplits(out.new_zeros(*out.shape[:2], 1), out.new_ones(*out.shape[:2], 1),
                           out[:, :, None])


def combine_splits(splits: AttentionSplits) -> torch.Tensor:
    """The attention ``[B, Hq, Dv]`` that ``splits`` hold, in the compute dtype (float32,
    float64 for float64 splits), as the Triton merge combines them."""
    top, total, acc = (t.to(compute_dtype(splits.acc)) for t in splits)
    weight = torch.exp2(top - top.amax(-1, keepdim=True))
    return (weight[..., None] * acc).sum(-2) / (weight * total).sum(-1, keepdim=True)


def linear_gates_step(x: torch.Tensor, w_a: torch.Tensor | None, a_log: torch.Tensor | None,
                      dt_bias: torch.Tensor | None, w_b: torch.Tensor | None,
                      ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """One token's gates from the layer's input ``x`` ``[B, D]``: :func:`.gates.linear_gates`
    of its projections by ``w_a`` and ``w_b`` ``[H, D]`` (either may be None; ``a_log`` and
    ``dt_bias`` go with ``w_a``). The products are taken in float32 (float64 for float64
    inputs), not rounded to ``x``'s dtype first, as the Triton step takes them."""
    dt = compute_dtype(x)
    a = None if w_a is None else x.to(dt) @ w_a.to(dt).T
    b = None if w_b is None else x.to(dt) @ w_b.to(dt).T
    return linear_gates(a, a_log, dt_bias, b)


def merge_step(q: torch.Tensor, mix_weight: torch.Tensor, a: torch.Tensor,
               b: torch.Tensor | AttentionSplits, gamma: torch.Tensor, eps: float, norm_a: bool,
               norm_b: bool, out_dtype: torch.dtype) -> torch.Tensor:
    """One token's merge of its branches ``a``, ``b`` ``[B, Hq, D]``: :func:`.norms.merge_branches`
    with the logits of ``q`` ``[B, Dq]`` by ``mix_weight`` ``[2 Hq, Dq]`` (row ``2 j + i``:
    head ``j``'s logit of branch ``i``). The product is taken in float32 (float64 for
    float64 inputs), not rounded to ``q``'s dtype first, as the Triton step takes it; so is
    the attention where ``b`` is given as its :class:`AttentionSplits`."""
    if isinstance(b, AttentionSplits):
        b = combine_splits(b)
    dt = compute_dtype(q)
    logits = (q.to(dt) @ mix_weight.to(dt).T).view(*a.shape[:-1], 2)
    return merge_branches(a, b, logits, gamma, eps, norm_a, norm_b, out_dtype, logits=True)


def short_conv_step(x: torch.Tensor, window: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """One token of the short convolution: ``x`` ``[B, C]`` after ``window`` ``[B, K-1, C]``
    (the last ``K - 1`` inputs, zeros before the start), ``weight`` ``[C, K]``. Returns
    ``SiLU(y)`` ``[B, C]`` in ``x``'s dtype, the parallel form's last output over the
    ``K`` tokens, and moves ``window`` on by ``x`` in place."""
    taps = torch.cat([window, x[:, None].to(window.dtype)], 1)
    y = short_conv(taps, weight)[:, -1].to(x.dtype)
    window.copy_(taps[:, 1:])
    return y


def append_to_open_chunk(position: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                         x: torch.Tensor, g: torch.Tensor, chunk_k: torch.Tensor,
                         chunk_v: torch.Tensor, pool_sum: torch.Tensor,
                         pool_max: torch.Tensor | None, chunk_log_decay: torch.Tensor,
                         open_len: torch.Tensor) -> None:
    """A NAtS-L cache's bookkeeping for the token at ``position`` (a device scalar), in
    place: its softmax keys and values ``[B, Hq, D]`` go to slot ``position % C`` of the
    open chunk ``chunk_k/v`` ``[B, Hq, C, D]``; its layer input ``x`` ``[B, D_model]`` is
    added to the scorer's running ``pool_sum`` and maximum ``pool_max`` (None: not kept);
    its log decay ``g`` ``[B, H]`` to ``chunk_log_decay``; ``open_len`` (one element) becomes
    the open chunk's length, ``position % C + 1``."""
    slot = (position % chunk_k.shape[2]).view(1)
    chunk_k.index_copy_(2, slot, keys[:, :, None].to(chunk_k.dtype))
    chunk_v.index_copy_(2, slot, values[:, :, None].to(chunk_v.dtype))
    pool_sum.add_(x.to(pool_sum.dtype))
    if pool_max is not None:
        torch.maximum(pool_max, x.to(pool_max.dtype), out=pool_max)
    chunk_log_decay.add_(g.to(chunk_log_decay.dtype))
    open_len.copy_(slot + 1)
