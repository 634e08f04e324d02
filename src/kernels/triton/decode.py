"""One-token decode in Triton: the linear state update and softmax attention over the cache.

Same contracts as :mod:`..reference.decode`. A decode step reads every byte of the
state and of the stored keys and values once and does little arithmetic on them, so
both kernels are memory-bound; what they save over the reference is the chain of small
PyTorch launches (and a decode step, unlike training, runs at batch 1 where launches
are the whole cost):

* :func:`linear_step`: one launch updates the float32 state (optionally in place) and
  writes the output, for the gated delta rule (``DELTA``) and for gated linear attention.
  Programs own disjoint ``[Dk, BV]`` column blocks of a head's state, read whole before
  they are written, so ``out=state`` is safe.
* :func:`linear_gates_step`: one launch makes a token's gates from the layer's input,
  the two narrow projections included (as two small products they were four cuBLAS
  launches, a dot and a reduction each, before the gates' own).
* :func:`hybrid_attention_splits`: split-K ("flash decoding"). The store is cut into
  splits of :func:`store_split` keys, plus one split for the open chunk if there is one
  (the plain softmax layer has none); each program runs an online softmax over its keys
  and writes its partial maximum, sum and weighted values. The number of splits follows
  the store's capacity (a shape), not its length (a device value), so the launches are
  the same every step. :func:`hybrid_attention_decode` combines the splits in a second
  launch.
* :func:`merge_step`: one launch takes a token's mix logits (its own small product) and
  merges the two branches with them, combining the softmax branch's splits where it is
  given them, so that a NAtS-L layer's step launches no combine of its own.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ..reference.decode import AttentionSplits
from .gates import softplus
from .norms import inv_rms, softmax_pair
from .utils import empty

LOG2E = 1.4426950408889634
MIN_SPLIT = 128
"""The fewest stored keys one attention program walks."""
MAX_SPLIT = 1024
"""The most stored keys one attention program walks."""


def keys_per_step(head_width: int) -> int:
    """Keys per step of an attention program's loop: 128 up to heads of 128, which the
    sweeps in docs/BENCHMARKS.md measured best (at 128 as fast as 64 or faster), and as
    many fewer at wider heads, unmeasured, as keep the ``[keys, width]`` tiles that size."""
    return max(16, min(128, 16384 // triton.next_power_of_2(head_width)))


def store_split(capacity: int) -> int:
    """Stored keys per attention program for a store of ``capacity`` slots. A program
    walks its split, then the combine walks every split's partial, one after the other,
    so their sum is least where the split is near the square root of the capacity; twice
    that, a power of two, was best at the benchmark model's shapes (docs/BENCHMARKS.md).
    A shape, not the store's length: the launches stay the same from step to step."""
    split = triton.next_power_of_2(math.ceil(2 * math.sqrt(capacity)))
    return min(MAX_SPLIT, max(MIN_SPLIT, split))


@triton.jit
def _linear_step_kernel(S, S_OUT, Q, K, V, G, BETA, OUT, scale, DK: tl.constexpr,
                        DV: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                        DELTA: tl.constexpr):
    i_bh, i_v = tl.program_id(0), tl.program_id(1)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k, m_v = o_k < DK, o_v < DV
    p_s = i_bh.to(tl.int64) * DK * DV + o_k[:, None] * DV + o_v[None, :]
    m_s = m_k[:, None] & m_v[None, :]
    s = tl.load(S + p_s, mask=m_s, other=0.0) * tl.exp(tl.load(G + i_bh).to(tl.float32))
    q = tl.load(Q + i_bh * DK + o_k, mask=m_k, other=0.0).to(tl.float32)
    k = tl.load(K + i_bh * DK + o_k, mask=m_k, other=0.0).to(tl.float32)
    v = tl.load(V + i_bh * DV + o_v, mask=m_v, other=0.0).to(tl.float32)
    if DELTA:  # write b (v - S^T k) instead of v
        v = tl.load(BETA + i_bh).to(tl.float32) * (v - tl.sum(k[:, None] * s, 0))
    s += k[:, None] * v[None, :]
    tl.store(S_OUT + p_s, s, mask=m_s)
    tl.store(OUT + i_bh * DV + o_v, tl.sum(q[:, None] * s, 0) * scale, mask=m_v)


def linear_step(state: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                g: torch.Tensor, beta: torch.Tensor | None, scale: float,
                out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(o [B, H, Dv] float32, new_state)``: the gated delta rule's step where ``beta`` is
    given, gated linear attention's where it is None (see the reference steps)."""
    batch, heads, d_k, d_v = state.shape
    if state.dtype != torch.float32 or not state.is_contiguous():
        raise ValueError("the decode state must be a contiguous float32 tensor")
    new_state = empty(*state.shape, dtype=torch.float32, device=state.device) if out is None \
        else out
    o = empty(batch, heads, d_v, dtype=torch.float32, device=state.device)
    block_v = min(32, triton.next_power_of_2(d_v))
    g = g.float().contiguous()
    _linear_step_kernel[(batch * heads, triton.cdiv(d_v, block_v))](
        state, new_state, q.contiguous(), k.contiguous(), v.contiguous(), g,
        g if beta is None else beta.float().contiguous(), o, scale,
        DK=d_k, DV=d_v, BK=triton.next_power_of_2(d_k), BV=block_v, DELTA=beta is not None)
    return o, new_state


@triton.jit
def _attn_partial_kernel(Q, SK, SV, SLEN, CK, CV, CLEN, M_OUT, L_OUT, ACC_OUT, qk_scale,
                         n_splits, n_store_splits, capacity, HQ: tl.constexpr,
                         H: tl.constexpr, R: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
                         BD: tl.constexpr, BDV: tl.constexpr, C_OWN: tl.constexpr,
                         SPLIT: tl.constexpr, BLOCK_N: tl.constexpr):
    """Split ``i_s`` of query ``i_bq = b * HQ + hq``: store keys ``[i_s SPLIT, ..)`` or, for
    the last split, the open chunk. Store rows of ``hq`` start at ``i_bq * capacity``:
    ``[B, H, R, S]`` flattens to ``b * HQ + hq`` with ``hq = h * R + j``."""
    i_bq, i_s = tl.program_id(0), tl.program_id(1)
    b, hq = i_bq // HQ, i_bq % HQ
    o_d, o_dv = tl.arange(0, BD), tl.arange(0, BDV)
    q = tl.load(Q + i_bq * D + o_d, mask=o_d < D, other=0.0).to(tl.float32) * qk_scale
    if i_s < n_store_splits:
        k_ptr = SK + i_bq.to(tl.int64) * capacity * D
        v_ptr = SV + i_bq.to(tl.int64) * capacity * DV
        start = i_s * SPLIT
        end = tl.minimum(start + SPLIT, tl.load(SLEN + b * H + hq // R).to(tl.int32))
    else:
        k_ptr = CK + i_bq.to(tl.int64) * C_OWN * D
        v_ptr = CV + i_bq.to(tl.int64) * C_OWN * DV
        start = i_s * 0
        end = tl.load(CLEN).to(tl.int32)
    m_i = tl.max(tl.full([BLOCK_N], float("-inf"), tl.float32), 0)
    l_i = tl.sum(tl.zeros([BLOCK_N], tl.float32), 0)
    acc = tl.zeros([BDV], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        ok = cols < end
        k = tl.load(k_ptr + cols[:, None] * D + o_d[None, :],
                    mask=ok[:, None] & (o_d[None, :] < D), other=0.0).to(tl.float32)
        s = tl.where(ok, tl.sum(k * q[None, :], 1), float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 0))  # finite: a block has a real key
        p = tl.exp2(s - m_new)
        alpha = tl.exp2(m_i - m_new)
        v = tl.load(v_ptr + cols[:, None] * DV + o_dv[None, :],
                    mask=ok[:, None] & (o_dv[None, :] < DV), other=0.0).to(tl.float32)
        l_i = l_i * alpha + tl.sum(p, 0)
        acc = acc * alpha + tl.sum(p[:, None] * v, 0)
        m_i = m_new
    out = i_bq * n_splits + i_s
    tl.store(M_OUT + out, m_i)
    tl.store(L_OUT + out, l_i)
    tl.store(ACC_OUT + out.to(tl.int64) * DV + o_dv, acc, mask=o_dv < DV)


@triton.jit
def _combined(M_IN, L_IN, ACC_IN, row, n_splits, DV: tl.constexpr, BDV: tl.constexpr,
              BS: tl.constexpr):
    """The attention ``[BDV]`` (float32) of query row ``row`` from its splits: each rescaled
    to the overall maximum, then the sum normalised."""
    o_dv = tl.arange(0, BDV)
    base = row * n_splits
    top = tl.full([BS], float("-inf"), tl.float32)
    for s0 in range(0, n_splits, BS):
        o_s = s0 + tl.arange(0, BS)
        top = tl.maximum(top, tl.load(M_IN + base + o_s, mask=o_s < n_splits,
                                      other=float("-inf")))
    m = tl.max(top, 0)  # finite: the query's own token is always a key
    total = tl.zeros([BS], tl.float32)
    acc = tl.zeros([BDV], tl.float32)
    for s0 in range(0, n_splits, BS):
        o_s = s0 + tl.arange(0, BS)
        ok = o_s < n_splits
        w = tl.exp2(tl.load(M_IN + base + o_s, mask=ok, other=float("-inf")) - m)
        total += w * tl.load(L_IN + base + o_s, mask=ok, other=0.0)
        part = tl.load(ACC_IN + (base + o_s).to(tl.int64)[:, None] * DV + o_dv[None, :],
                       mask=ok[:, None] & (o_dv[None, :] < DV), other=0.0)
        acc += tl.sum(w[:, None] * part, 0)
    return acc / tl.sum(total, 0)


@triton.jit
def _attn_combine_kernel(M_IN, L_IN, ACC_IN, OUT, n_splits, DV: tl.constexpr,
                         BDV: tl.constexpr, BS: tl.constexpr):
    """The attention of query row ``i_bq`` from its splits, in the output's dtype."""
    i_bq = tl.program_id(0)
    o_dv = tl.arange(0, BDV)
    out = _combined(M_IN, L_IN, ACC_IN, i_bq, n_splits, DV, BDV, BS)
    tl.store(OUT + i_bq * DV + o_dv, out.to(OUT.dtype.element_ty), mask=o_dv < DV)


COMBINE_BLOCK = 64
"""Splits one step of a combine's loop reads."""


def hybrid_attention_splits(q: torch.Tensor, store_k: torch.Tensor, store_v: torch.Tensor,
                            store_len: torch.Tensor, chunk_k: torch.Tensor | None = None,
                            chunk_v: torch.Tensor | None = None,
                            chunk_len: torch.Tensor | None = None,
                            scale: float | None = None) -> AttentionSplits:
    """See :func:`nats.kernels.reference.decode.hybrid_attention_splits`: here a split of
    :func:`store_split` stored keys per program, and one for the open chunk if there is one."""
    batch, heads, r, capacity, d_k = store_k.shape
    d_v = store_v.shape[-1]
    hq = heads * r
    if q.shape != (batch, hq, d_k) or store_v.shape[:4] != store_k.shape[:4]:
        raise ValueError(f"need q [B, H*r, D] = {[batch, hq, d_k]} and store_v "
                         f"{list(store_k.shape[:4])} + [Dv]; got {list(q.shape)}, "
                         f"{list(store_v.shape)}")
    if not (store_k.is_contiguous() and store_v.is_contiguous()):
        raise ValueError("the stored keys and values must be contiguous")
    scale = d_k**-0.5 if scale is None else scale
    own = chunk_k is not None
    if own:
        chunk_k, chunk_v = chunk_k.contiguous(), chunk_v.contiguous()
    else:  # no open chunk and no split for it: the store's tensors stand in, never read
        chunk_k, chunk_v, chunk_len = store_k, store_v, store_len
    split = store_split(capacity)
    n_store = triton.cdiv(capacity, split)
    n_splits = n_store + own
    dev = q.device
    m = empty(batch, hq, n_splits, dtype=torch.float32, device=dev)
    total = empty(batch, hq, n_splits, dtype=torch.float32, device=dev)
    acc = empty(batch, hq, n_splits, d_v, dtype=torch.float32, device=dev)
    _attn_partial_kernel[(batch * hq, n_splits)](
        q.contiguous(), store_k, store_v, store_len.contiguous(), chunk_k, chunk_v, chunk_len,
        m, total, acc, scale * LOG2E, n_splits, n_store, capacity, HQ=hq, H=heads, R=r, D=d_k,
        DV=d_v, BD=triton.next_power_of_2(d_k), BDV=triton.next_power_of_2(d_v),
        C_OWN=chunk_k.shape[2] if own else 0, SPLIT=split,
        BLOCK_N=keys_per_step(max(d_k, d_v)), num_warps=4)
    return AttentionSplits(m, total, acc)


def hybrid_attention_decode(q: torch.Tensor, store_k: torch.Tensor, store_v: torch.Tensor,
                            store_len: torch.Tensor, chunk_k: torch.Tensor | None = None,
                            chunk_v: torch.Tensor | None = None,
                            chunk_len: torch.Tensor | None = None,
                            scale: float | None = None) -> torch.Tensor:
    """See :func:`nats.kernels.reference.decode.hybrid_attention_decode`: the splits, then a
    launch that combines them."""
    splits = hybrid_attention_splits(q, store_k, store_v, store_len, chunk_k, chunk_v,
                                     chunk_len, scale)
    batch, hq, n_splits, d_v = splits.acc.shape
    out = empty(batch, hq, d_v, dtype=store_v.dtype, device=q.device)
    _attn_combine_kernel[(batch * hq,)](*splits, out, n_splits, DV=d_v,
                                        BDV=triton.next_power_of_2(d_v), BS=COMBINE_BLOCK)
    return out


@triton.jit
def _two_dots(x_ptr, wa_ptr, wb_ptr, n, USE_A: tl.constexpr, USE_B: tl.constexpr,
              BLOCK: tl.constexpr):
    """The dots (float32) of the row ``x_ptr[:n]`` with the rows at ``wa_ptr`` and
    ``wb_ptr``: a token's two logits of a narrow projection, or of two (0 where unused)."""
    acc_a = tl.zeros([BLOCK], dtype=tl.float32)
    acc_b = tl.zeros([BLOCK], dtype=tl.float32)
    for d0 in range(0, n, BLOCK):
        d = d0 + tl.arange(0, BLOCK)
        ok = d < n
        x = tl.load(x_ptr + d, mask=ok, other=0.0).to(tl.float32)
        if USE_A:
            acc_a += tl.load(wa_ptr + d, mask=ok, other=0.0).to(tl.float32) * x
        if USE_B:
            acc_b += tl.load(wb_ptr + d, mask=ok, other=0.0).to(tl.float32) * x
    return tl.sum(acc_a, 0), tl.sum(acc_b, 0)


@triton.jit
def _gates_step_kernel(X, WA, A_LOG, DT_BIAS, WB, G, BETA, x_stride, d_model, heads,
                       DECAY: tl.constexpr, WRITE: tl.constexpr, BLOCK_D: tl.constexpr):
    """Head ``h`` of batch row ``b``: its rows of both projections, then its gates (float32
    throughout). A program per head, not per row: one program walking every head's
    weight rows was the step's slowest small kernel."""
    b, h = tl.program_id(0), tl.program_id(1)
    dot_a, dot_b = _two_dots(X + b.to(tl.int64) * x_stride, WA + h * d_model, WB + h * d_model,
                             d_model, DECAY, WRITE, BLOCK_D)
    if DECAY:
        pre = dot_a + tl.load(DT_BIAS + h).to(tl.float32)
        rate = tl.exp(tl.load(A_LOG + h).to(tl.float32))
        tl.store(G + b * heads + h, -rate * softplus(pre))
    if WRITE:
        tl.store(BETA + b * heads + h, tl.sigmoid(dot_b))


def linear_gates_step(x: torch.Tensor, w_a: torch.Tensor | None, a_log: torch.Tensor | None,
                      dt_bias: torch.Tensor | None, w_b: torch.Tensor | None,
                      ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """See :func:`nats.kernels.reference.decode.linear_gates_step` (no backward: a decode
    step runs without gradients)."""
    batch, d_model = x.shape
    w = w_a if w_a is not None else w_b
    heads = w.shape[0]
    if x.stride(1) != 1:
        x = x.contiguous()
    f32 = dict(dtype=torch.float32, device=x.device)
    g = None if w_a is None else empty(batch, heads, **f32)
    beta = None if w_b is None else empty(batch, heads, **f32)
    _gates_step_kernel[(batch, heads)](
        x, *(x if t is None else t.contiguous() for t in (w_a, a_log, dt_bias, w_b)),
        x if g is None else g, x if beta is None else beta, x.stride(0), d_model, heads,
        DECAY=w_a is not None, WRITE=w_b is not None,
        BLOCK_D=min(1024, triton.next_power_of_2(d_model)))
    return g, beta


@triton.jit
def _merge_step_kernel(Q, W, A, B, B_MAX, B_TOTAL, GAMMA, Y, q_stride, d_q, dim, n_splits, eps,
                       HQ: tl.constexpr, NORM_A: tl.constexpr, NORM_B: tl.constexpr,
                       SPLITS: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_D: tl.constexpr,
                       BLOCK_S: tl.constexpr):
    """Head ``j`` of batch row ``b``: its two logits from ``q``'s row, then the merge of its
    branch rows as in ``norms._merge_fwd`` (float32 throughout), the softmax one combined
    here from its splits (``B`` their weighted values) where ``SPLITS``."""
    i = tl.program_id(0)  # b * HQ + j
    b, j = i // HQ, i % HQ
    la, lb = _two_dots(Q + b.to(tl.int64) * q_stride, W + (2 * j) * d_q, W + (2 * j + 1) * d_q,
                       d_q, True, True, BLOCK_Q)
    wa, wb = softmax_pair(la, lb)
    cols = tl.arange(0, BLOCK_D)
    ok = cols < dim
    row = i.to(tl.int64) * dim + cols
    a = tl.load(A + row, mask=ok, other=0.0).to(tl.float32)
    if SPLITS:
        v = _combined(B_MAX, B_TOTAL, B, i, n_splits, dim, BLOCK_D, BLOCK_S)
    else:
        v = tl.load(B + row, mask=ok, other=0.0).to(tl.float32)
    if NORM_A:
        a = a * inv_rms(a, dim, eps)
    if NORM_B:
        v = v * inv_rms(v, dim, eps)
    gamma = tl.load(GAMMA + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(Y + row, ((wa * a + wb * v) * gamma).to(Y.dtype.element_ty), mask=ok)


def merge_step(q: torch.Tensor, mix_weight: torch.Tensor, a: torch.Tensor,
               b: torch.Tensor | AttentionSplits, gamma: torch.Tensor, eps: float, norm_a: bool,
               norm_b: bool, out_dtype: torch.dtype) -> torch.Tensor:
    """See :func:`nats.kernels.reference.decode.merge_step` (no backward: a decode step runs
    without gradients). ``q`` may be a view with strided rows (a slice of a fused
    projection)."""
    batch, hq, dim = a.shape
    d_q = q.shape[1]
    if q.stride(1) != 1:
        q = q.contiguous()
    splits = isinstance(b, AttentionSplits)
    b_max, b_total, b = b if splits else (a, a, b.contiguous())  # a: never read
    y = empty(batch, hq, dim, dtype=out_dtype, device=a.device)
    _merge_step_kernel[(batch * hq,)](
        q, mix_weight.contiguous(), a.contiguous(), b, b_max, b_total, gamma, y, q.stride(0),
        d_q, dim, b.shape[2] if splits else 1, eps, HQ=hq, NORM_A=norm_a, NORM_B=norm_b,
        SPLITS=splits, BLOCK_Q=min(1024, triton.next_power_of_2(d_q)),
        BLOCK_D=triton.next_power_of_2(dim), BLOCK_S=COMBINE_BLOCK)
    return y


@triton.jit
def _short_conv_step_kernel(X, WIN, W, Y, x_stride, channels, K: tl.constexpr,
                            BLOCK_C: tl.constexpr):
    """Channels ``[c0, c0 + BLOCK_C)`` of batch row ``b``: each window row is read before
    the same thread writes the row before it, so the window moves on in place."""
    b = tl.program_id(0)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    ok = c < channels
    x = tl.load(X + b.to(tl.int64) * x_stride + c, mask=ok, other=0.0)
    acc = x.to(tl.float32) * tl.load(W + c * K + K - 1, mask=ok, other=0.0).to(tl.float32)
    win = WIN + b.to(tl.int64) * (K - 1) * channels + c
    for i in tl.static_range(K - 1):
        row = tl.load(win + i * channels, mask=ok, other=0.0)
        acc += row.to(tl.float32) * tl.load(W + c * K + i, mask=ok, other=0.0).to(tl.float32)
        if i > 0:
            tl.store(win + (i - 1) * channels, row, mask=ok)
    if K > 1:
        tl.store(win + (K - 2) * channels, x.to(WIN.dtype.element_ty), mask=ok)
    tl.store(Y + b.to(tl.int64) * channels + c, (acc * tl.sigmoid(acc)).to(Y.dtype.element_ty),
             mask=ok)


def short_conv_step(x: torch.Tensor, window: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """See :func:`nats.kernels.reference.decode.short_conv_step`."""
    batch, channels = x.shape
    kernel_size = weight.shape[1]
    if window.shape != (batch, kernel_size - 1, channels) or not window.is_contiguous():
        raise ValueError(f"the window must be a contiguous [B, K-1, C] = "
                         f"{[batch, kernel_size - 1, channels]}, got {list(window.shape)}")
    if x.stride(1) != 1:
        x = x.contiguous()
    y = empty(batch, channels, dtype=x.dtype, device=x.device)
    block_c = min(1024, triton.next_power_of_2(channels))
    _short_conv_step_kernel[(batch, triton.cdiv(channels, block_c))](
        x, window, weight.contiguous(), y, x.stride(0), channels, K=kernel_size,
        BLOCK_C=block_c)
    return y


@triton.jit
def _into_slot(src, dst, src_stride, b, slot, C, HQ, dim, BLOCK: tl.constexpr):
    """Row ``b`` of ``src`` (``HQ`` heads of ``dim``) into slot ``slot`` of ``dst``
    ``[B, HQ, C, dim]``."""
    for n0 in range(0, HQ * dim, BLOCK):
        n = n0 + tl.arange(0, BLOCK)
        ok = n < HQ * dim
        val = tl.load(src + b.to(tl.int64) * src_stride + n, mask=ok, other=0.0)
        at = ((b * HQ + n // dim).to(tl.int64) * C + slot) * dim + n % dim
        tl.store(dst + at, val.to(dst.dtype.element_ty), mask=ok)


@triton.jit
def _append_kernel(POS, KEYS, VALUES, X, G, CK, CV, PSUM, PMAX, DECAY, OPEN_LEN,
                   keys_stride, values_stride, x_stride, C, HQ, DK, DV, DM, H,
                   HAS_MAX: tl.constexpr, BLOCK: tl.constexpr):
    """Part ``p`` of batch row ``b``'s bookkeeping: 0 the keys, 1 the values, 2 the scorer's
    pool, 3 the log decay and the open chunk's length."""
    b, part = tl.program_id(0), tl.program_id(1)
    slot = tl.load(POS) % C
    if part == 0:
        _into_slot(KEYS, CK, keys_stride, b, slot, C, HQ, DK, BLOCK)
    elif part == 1:
        _into_slot(VALUES, CV, values_stride, b, slot, C, HQ, DV, BLOCK)
    elif part == 2:
        for n0 in range(0, DM, BLOCK):
            n = n0 + tl.arange(0, BLOCK)
            ok = n < DM
            x = tl.load(X + b.to(tl.int64) * x_stride + n, mask=ok, other=0.0).to(tl.float32)
            at = b.to(tl.int64) * DM + n
            tl.store(PSUM + at, tl.load(PSUM + at, mask=ok, other=0.0) + x, mask=ok)
            if HAS_MAX:
                tl.store(PMAX + at, tl.maximum(tl.load(PMAX + at, mask=ok, other=0.0), x),
                         mask=ok)
    else:
        for n0 in range(0, H, BLOCK):
            n = n0 + tl.arange(0, BLOCK)
            ok = n < H
            at = b * H + n
            tl.store(DECAY + at, tl.load(DECAY + at, mask=ok, other=0.0)
                     + tl.load(G + at, mask=ok, other=0.0).to(tl.float32), mask=ok)
        if b == 0:
            tl.store(OPEN_LEN, (slot + 1).to(OPEN_LEN.dtype.element_ty))


def _rows_of(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``t`` ``[B, ...]`` with each batch row one contiguous run, and its row stride (a copy
    only where a row is not)."""
    if not t[0].is_contiguous():
        t = t.contiguous()
    return t, t.stride(0)


def append_to_open_chunk(position: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                         x: torch.Tensor, g: torch.Tensor, chunk_k: torch.Tensor,
                         chunk_v: torch.Tensor, pool_sum: torch.Tensor,
                         pool_max: torch.Tensor | None, chunk_log_decay: torch.Tensor,
                         open_len: torch.Tensor) -> None:
    """See :func:`nats.kernels.reference.decode.append_to_open_chunk`."""
    batch, hq, chunk, d_k = chunk_k.shape
    d_v, d_model, heads = chunk_v.shape[-1], x.shape[-1], g.shape[-1]
    for name, t in (("chunk_k", chunk_k), ("chunk_v", chunk_v), ("pool_sum", pool_sum),
                    ("pool_max", pool_max), ("chunk_log_decay", chunk_log_decay)):
        if t is not None and not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
    if pool_sum.dtype != torch.float32 or chunk_log_decay.dtype != torch.float32:
        raise ValueError("the pool and the summed log decay are float32")
    keys, keys_stride = _rows_of(keys)
    values, values_stride = _rows_of(values)
    x, x_stride = _rows_of(x)
    _append_kernel[(batch, 4)](
        position, keys, values, x, g.contiguous(), chunk_k, chunk_v, pool_sum,
        pool_sum if pool_max is None else pool_max, chunk_log_decay, open_len,
        keys_stride, values_stride, x_stride, chunk, hq, d_k, d_v, d_model, heads,
        HAS_MAX=pool_max is not None, BLOCK=1024)
