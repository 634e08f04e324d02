"""Forward kernels of the hybrid chunked gated delta rule (see :mod:`.gated_delta_rule`).

Three launches over a packed ``[1, T_total, H, D]`` batch, cut into kernel chunks of
``BT`` tokens; a routing chunk of ``R * BT`` tokens owns ``R`` consecutive kernel-chunk
*slots* (slot ``r * R + j``), so slots map to tokens with no host look-up:

1. :func:`wy_fwd` (parallel over slots): within-slot cumulative log gate ``gc``, the
   inverse ``A = (I + strictLower(diag(beta) Gamma K K^T))^{-1}`` and the WY rows
   ``u = A diag(beta) V``, ``w = A diag(beta exp(gc)) K``.
2. :func:`state_fwd` (sequential over slots, parallel over sequences, heads and V
   blocks): the running state and, per routing chunk, the decayed *shadow* of its start
   state; writes every slot's start state ``h`` and ``v_new = u - w h``, and carries
   ``z * running + (1 - z) * shadow`` past each routing chunk.
3. :func:`output_fwd` (parallel): ``o = scale (exp(gc) q h + causal(q k^T decay) v_new)``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .segments import carry_buffer, chain_starts, count, state_grid
from .utils import ChunkMap, autotune_configs, empty


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs get exact fp32 products on the GPU; half inputs already round harder."""
    return "ieee" if dtype == torch.float32 else "tf32"


def _configs(block_v: tuple[int, ...] = (0,), warps: tuple[int, ...] = (2, 4),
             stages: int = 2) -> list[triton.Config]:
    """Warps (x V block, when the kernel splits V) on the GPU; one config otherwise.

    Kept to configs checked on an H100 / H200 with Triton 3.6: there 8 warps in the
    parallel kernels gave wrong dk / dg / dbeta, and BV = 32 in the output kernel faulted,
    so the parallel kernels use BV = 64 only. Kernels with a loop over V blocks
    (:func:`dqkwg`, :func:`wy_bwd`) take ``stages=1``: software-pipelined (2 stages), their
    results changed from run to run on an H200 (dw, dbeta, dg by ~1e-2 relative; a race in
    the generated code), and unpipelined they are bitwise repeatable.
    """
    def meta(bv: int) -> dict[str, int]:
        return {"BV": bv} if bv else {}
    configs = [triton.Config(meta(bv), num_warps=nw, num_stages=stages)
               for bv in block_v for nw in warps]
    return autotune_configs(configs, triton.Config(meta(block_v[0]), num_warps=4))


def seq_configs(stages: int) -> list[triton.Config]:
    """The sequential kernels: one config each, the fastest measured with Triton 3.6 (BV 32,
    4 warps; 3 stages forward, 2 backward) among those whose results repeat run to run."""
    return autotune_configs([triton.Config({"BV": 32}, num_warps=4, num_stages=stages)],
                            triton.Config({"BV": 32}, num_warps=4))


@triton.jit
def slot_bounds(i_s, cu, chunk_offsets, chunk_seq, R: tl.constexpr, BT: tl.constexpr):
    """Routing chunk, first token and sequence end of kernel-chunk slot ``i_s``."""
    r = i_s // R
    i_n = tl.load(chunk_seq + r)
    eos = tl.load(cu + i_n + 1).to(tl.int64)
    t0 = tl.load(cu + i_n).to(tl.int64) + (r - tl.load(chunk_offsets + i_n)) * (R * BT)
    return r, t0 + (i_s % R) * BT, eos


@triton.jit
def rows_mask(o_t, m_t, D: tl.constexpr, o_d):
    """The row mask; the column one only where the block does not divide ``D`` (wider than
    ``D``, or ``D`` not a power of two, as the ``Dv + 1`` of linear attention). A column
    mask with a run-time start defeats vector loads (one predicated access and one 64-bit
    address per element), so blocks that divide ``D`` go without it."""
    if D // o_d.shape[0] * o_d.shape[0] == D:  # (no int % constexpr in the interpreter)
        return tl.broadcast_to(m_t[:, None], [o_t.shape[0], o_d.shape[0]])
    return m_t[:, None] & (o_d[None, :] < D)


@triton.jit
def load_rows(ptr, o_t, m_t, i_h, H, D: tl.constexpr, o_d):
    """Rows ``o_t`` (zero where ``m_t`` is false), head ``i_h``, columns ``o_d`` of [T, H, D]."""
    return tl.load(ptr + (o_t[:, None] * H + i_h) * D + o_d[None, :],
                   mask=rows_mask(o_t, m_t, D, o_d), other=0)


@triton.jit
def store_rows(ptr, x, o_t, m_t, i_h, H, D: tl.constexpr, o_d):
    tl.store(ptr + (o_t[:, None] * H + i_h) * D + o_d[None, :], x.to(ptr.dtype.element_ty),
             mask=rows_mask(o_t, m_t, D, o_d))


@triton.jit
def causal_decay(b_gc, o_i, GAP: tl.constexpr):
    """``exp(gc_t - gc_s)`` where ``t - s >= GAP`` (0: causal, 1: strictly lower), else 0.

    The exponent is capped at 0, which it never exceeds for real tokens (log gates are
    <= 0). Rows past a sequence's end load ``gc = 0``: uncapped, ``exp(0 - gc_s)`` was inf
    once the chunk's decay passed ``e^-88``, and inf times their zero inputs made NaN that
    the column sums of the backward spread to every token."""
    m = o_i[:, None] - o_i[None, :] >= GAP
    return tl.where(m, tl.exp(tl.minimum(tl.where(m, b_gc[:, None] - b_gc[None, :], 0.0),
                                         0.0)), 0.0)


@triton.jit
def inv_unit_lower(b_l, o_c):
    """``(I + L)^{-1}`` of a strictly lower 16 x 16 ``L``: ``(I - L)(I + L^2)(I + L^4)(I + L^8)``
    (``L^16 = 0``), six small float32 products instead of a 16-step substitution.

    Always exact float32 products: entries of ``L^8`` reach thousands when keys are nearly
    parallel and ``beta`` near 1 and must cancel to values <= 1, which tf32's 10-bit
    mantissa cannot do; the wrong inverse let the state grow without bound in bf16
    training (NaN after a few hundred steps)."""
    eye = (o_c[:, None] == o_c[None, :]).to(tl.float32)
    b_p = eye - b_l
    b_l = mm(b_l, b_l, "ieee")
    b_p = mm(b_p, eye + b_l, "ieee")
    b_l = mm(b_l, b_l, "ieee")
    b_p = mm(b_p, eye + b_l, "ieee")
    b_l = mm(b_l, b_l, "ieee")
    return mm(b_p, eye + b_l, "ieee")


@triton.jit
def mm(a, b, INV: tl.constexpr):
    """A float32 product of the blocked inverse, at the precision :func:`inverse_precision`
    chose."""
    return tl.dot(a, b, input_precision=INV)


@triton.jit
def l_block(b_ki, b_kj, b_beta_i, b_gc_i, b_gc_j, o_c, DIAG: tl.constexpr, PREC: tl.constexpr):
    """Block ``(i, j)`` of ``strictLower(diag(beta) Gamma K K^T)`` (16 x 16, float32)."""
    b_kk = tl.dot(b_ki, tl.trans(b_kj), input_precision=PREC)
    if DIAG:  # noqa: SIM108 (a compile-time branch)
        b_d = causal_decay(b_gc_i, o_c, 1)
    else:
        b_d = tl.exp(b_gc_i[:, None] - b_gc_j[None, :])
    return b_beta_i[:, None] * b_d * b_kk


@triton.jit
def scaled_cols(b_a, b_s, dt):
    """``A diag(s)`` as a ``dt`` operand, ``A`` first rounded to ``dt`` as it is stored.

    Precision: u = A diag(beta) V must not be formed as A times a rounded ``beta * v``.
    Rounding ``beta * v`` (or ``beta exp(gc) k``) to bf16 puts independent noise on every
    value element, which the state carries and the route gradient ``<dS, k^T v_new>``
    picks up: it measured 1.06e-2 relative RMS error on an H200 (B=1, T=8192, H=4, chunk
    64) against 1e-2 allowed. Scaling A's columns in float32 and rounding that instead
    perturbs one coefficient per (t, s), shared by all value columns (a perturbation of
    beta and the decays), and keeps the route gradient as close as float32 A did.
    """
    return (b_a.to(dt).to(tl.float32) * b_s[None, :]).to(dt)


@triton.jit
def store_block(a, x, o_t, m_t, i_h, H, BT: tl.constexpr, J: tl.constexpr, o_c):
    """Columns ``16 J ..`` of the rows ``o_t`` of the ``[T, H, BT]`` matrix ``a``."""
    tl.store(a + (o_t[:, None] * H + i_h) * BT + J * 16 + o_c[None, :],
             x.to(a.dtype.element_ty), mask=m_t[:, None] & (J * 16 + o_c[None, :] < BT))


@triton.autotune(configs=_configs(), key=["K", "V", "BT"])
@triton.jit
def _wy_kernel(k, v, g, beta, gc, a, w, u, cu, chunk_offsets, chunk_seq,
               H, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
               R: tl.constexpr, PREC: tl.constexpr, INV: tl.constexpr):
    """gc, A and w, u of one slot. The slot's ``BT <= 64`` rows are four blocks of 16
    (blocks past ``BT`` are masked to zero); A is inverted block-wise: the diagonal blocks
    by :func:`inv_unit_lower`, then ``A_ij = -A_ii sum_{j<=m<i} L_im A_mj``."""
    i_s, i_h = tl.program_id(0), tl.program_id(1)
    _, t0, eos = slot_bounds(i_s, cu, chunk_offsets, chunk_seq, R, BT)
    if t0 >= eos:
        return
    eob = tl.minimum(eos, t0 + BT)
    o_c, o_k, o_v = tl.arange(0, 16), tl.arange(0, K), tl.arange(0, V)
    t_0, t_1, t_2, t_3 = t0 + o_c, t0 + 16 + o_c, t0 + 32 + o_c, t0 + 48 + o_c
    m_0, m_1, m_2, m_3 = t_0 < eob, t_1 < eob, t_2 < eob, t_3 < eob
    g_0 = tl.load(g + t_0 * H + i_h, mask=m_0, other=0).to(tl.float32)
    g_1 = tl.load(g + t_1 * H + i_h, mask=m_1, other=0).to(tl.float32)
    g_2 = tl.load(g + t_2 * H + i_h, mask=m_2, other=0).to(tl.float32)
    g_3 = tl.load(g + t_3 * H + i_h, mask=m_3, other=0).to(tl.float32)
    gc_0 = tl.cumsum(g_0, 0)
    gc_1 = tl.cumsum(g_1, 0) + tl.sum(g_0, 0)
    gc_2 = tl.cumsum(g_2, 0) + tl.sum(g_0, 0) + tl.sum(g_1, 0)
    gc_3 = tl.cumsum(g_3, 0) + tl.sum(g_0, 0) + tl.sum(g_1, 0) + tl.sum(g_2, 0)
    tl.store(gc + t_0 * H + i_h, gc_0, mask=m_0)
    tl.store(gc + t_1 * H + i_h, gc_1, mask=m_1)
    tl.store(gc + t_2 * H + i_h, gc_2, mask=m_2)
    tl.store(gc + t_3 * H + i_h, gc_3, mask=m_3)
    be_0 = tl.load(beta + t_0 * H + i_h, mask=m_0, other=0).to(tl.float32)
    be_1 = tl.load(beta + t_1 * H + i_h, mask=m_1, other=0).to(tl.float32)
    be_2 = tl.load(beta + t_2 * H + i_h, mask=m_2, other=0).to(tl.float32)
    be_3 = tl.load(beta + t_3 * H + i_h, mask=m_3, other=0).to(tl.float32)
    k_0 = load_rows(k, t_0, m_0, i_h, H, K, o_k)
    k_1 = load_rows(k, t_1, m_1, i_h, H, K, o_k)
    k_2 = load_rows(k, t_2, m_2, i_h, H, K, o_k)
    k_3 = load_rows(k, t_3, m_3, i_h, H, K, o_k)
    # Every block of L first, so that the key blocks are dead before the inverse (live
    # across it, they spilled hundreds of bytes a thread).
    d_0 = l_block(k_0, k_0, be_0, gc_0, gc_0, o_c, True, PREC)
    d_1 = l_block(k_1, k_1, be_1, gc_1, gc_1, o_c, True, PREC)
    d_2 = l_block(k_2, k_2, be_2, gc_2, gc_2, o_c, True, PREC)
    d_3 = l_block(k_3, k_3, be_3, gc_3, gc_3, o_c, True, PREC)
    l_10 = l_block(k_1, k_0, be_1, gc_1, gc_0, o_c, False, PREC)
    l_21 = l_block(k_2, k_1, be_2, gc_2, gc_1, o_c, False, PREC)
    l_32 = l_block(k_3, k_2, be_3, gc_3, gc_2, o_c, False, PREC)
    l_20 = l_block(k_2, k_0, be_2, gc_2, gc_0, o_c, False, PREC)
    l_31 = l_block(k_3, k_1, be_3, gc_3, gc_1, o_c, False, PREC)
    l_30 = l_block(k_3, k_0, be_3, gc_3, gc_0, o_c, False, PREC)
    a_00 = inv_unit_lower(d_0, o_c)
    a_11 = inv_unit_lower(d_1, o_c)
    a_22 = inv_unit_lower(d_2, o_c)
    a_33 = inv_unit_lower(d_3, o_c)
    a_10 = -mm(mm(a_11, l_10, INV), a_00, INV)
    a_21 = -mm(mm(a_22, l_21, INV), a_11, INV)
    a_32 = -mm(mm(a_33, l_32, INV), a_22, INV)
    a_20 = -mm(a_22, mm(l_20, a_00, INV) + mm(l_21, a_10, INV), INV)
    a_31 = -mm(a_33, mm(l_31, a_11, INV) + mm(l_32, a_21, INV), INV)
    a_30 = -mm(a_33, mm(l_30, a_00, INV) + mm(l_31, a_10, INV) + mm(l_32, a_20, INV),
               INV)
    zero = tl.zeros([16, 16], dtype=tl.float32)
    store_block(a, a_00, t_0, m_0, i_h, H, BT, 0, o_c)
    store_block(a, zero, t_0, m_0, i_h, H, BT, 1, o_c)
    store_block(a, zero, t_0, m_0, i_h, H, BT, 2, o_c)
    store_block(a, zero, t_0, m_0, i_h, H, BT, 3, o_c)
    store_block(a, a_10, t_1, m_1, i_h, H, BT, 0, o_c)
    store_block(a, a_11, t_1, m_1, i_h, H, BT, 1, o_c)
    store_block(a, zero, t_1, m_1, i_h, H, BT, 2, o_c)
    store_block(a, zero, t_1, m_1, i_h, H, BT, 3, o_c)
    store_block(a, a_20, t_2, m_2, i_h, H, BT, 0, o_c)
    store_block(a, a_21, t_2, m_2, i_h, H, BT, 1, o_c)
    store_block(a, a_22, t_2, m_2, i_h, H, BT, 2, o_c)
    store_block(a, zero, t_2, m_2, i_h, H, BT, 3, o_c)
    store_block(a, a_30, t_3, m_3, i_h, H, BT, 0, o_c)
    store_block(a, a_31, t_3, m_3, i_h, H, BT, 1, o_c)
    store_block(a, a_32, t_3, m_3, i_h, H, BT, 2, o_c)
    store_block(a, a_33, t_3, m_3, i_h, H, BT, 3, o_c)
    # w = A diag(beta exp(gc)) K and u = A diag(beta) V, from A rounded as it is stored (so
    # that the backward's recompute gives the same w, u). The scales go into A's columns,
    # not into K and V (see :func:`scaled_cols`).
    dt = a.dtype.element_ty
    s_0, s_1 = be_0 * tl.exp(gc_0), be_1 * tl.exp(gc_1)
    s_2, s_3 = be_2 * tl.exp(gc_2), be_3 * tl.exp(gc_3)
    k_0, k_1, k_2, k_3 = k_0.to(dt), k_1.to(dt), k_2.to(dt), k_3.to(dt)
    store_rows(w, tl.dot(scaled_cols(a_00, s_0, dt), k_0, input_precision=PREC),
               t_0, m_0, i_h, H, K, o_k)
    store_rows(w, tl.dot(scaled_cols(a_10, s_0, dt), k_0, input_precision=PREC)
               + tl.dot(scaled_cols(a_11, s_1, dt), k_1, input_precision=PREC),
               t_1, m_1, i_h, H, K, o_k)
    store_rows(w, tl.dot(scaled_cols(a_20, s_0, dt), k_0, input_precision=PREC)
               + tl.dot(scaled_cols(a_21, s_1, dt), k_1, input_precision=PREC)
               + tl.dot(scaled_cols(a_22, s_2, dt), k_2, input_precision=PREC),
               t_2, m_2, i_h, H, K, o_k)
    store_rows(w, tl.dot(scaled_cols(a_30, s_0, dt), k_0, input_precision=PREC)
               + tl.dot(scaled_cols(a_31, s_1, dt), k_1, input_precision=PREC)
               + tl.dot(scaled_cols(a_32, s_2, dt), k_2, input_precision=PREC)
               + tl.dot(scaled_cols(a_33, s_3, dt), k_3, input_precision=PREC),
               t_3, m_3, i_h, H, K, o_k)
    v_0 = load_rows(v, t_0, m_0, i_h, H, V, o_v).to(dt)
    v_1 = load_rows(v, t_1, m_1, i_h, H, V, o_v).to(dt)
    v_2 = load_rows(v, t_2, m_2, i_h, H, V, o_v).to(dt)
    v_3 = load_rows(v, t_3, m_3, i_h, H, V, o_v).to(dt)
    store_rows(u, tl.dot(scaled_cols(a_00, be_0, dt), v_0, input_precision=PREC),
               t_0, m_0, i_h, H, V, o_v)
    store_rows(u, tl.dot(scaled_cols(a_10, be_0, dt), v_0, input_precision=PREC)
               + tl.dot(scaled_cols(a_11, be_1, dt), v_1, input_precision=PREC),
               t_1, m_1, i_h, H, V, o_v)
    store_rows(u, tl.dot(scaled_cols(a_20, be_0, dt), v_0, input_precision=PREC)
               + tl.dot(scaled_cols(a_21, be_1, dt), v_1, input_precision=PREC)
               + tl.dot(scaled_cols(a_22, be_2, dt), v_2, input_precision=PREC),
               t_2, m_2, i_h, H, V, o_v)
    store_rows(u, tl.dot(scaled_cols(a_30, be_0, dt), v_0, input_precision=PREC)
               + tl.dot(scaled_cols(a_31, be_1, dt), v_1, input_precision=PREC)
               + tl.dot(scaled_cols(a_32, be_2, dt), v_2, input_precision=PREC)
               + tl.dot(scaled_cols(a_33, be_3, dt), v_3, input_precision=PREC),
               t_3, m_3, i_h, H, V, o_v)


@triton.autotune(configs=_configs(), key=["K", "V", "BT"])
@triton.jit
def _wu_kernel(k, v, beta, gc, a, w, u, cu, chunk_offsets, chunk_seq,
               H, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
               R: tl.constexpr, PREC: tl.constexpr):
    """w, u of one slot again, from the saved gc and A (the backward's recompute)."""
    i_s, i_h = tl.program_id(0), tl.program_id(1)
    _, t0, eos = slot_bounds(i_s, cu, chunk_offsets, chunk_seq, R, BT)
    if t0 >= eos:
        return
    o_i = tl.arange(0, BT)
    o_t = t0 + o_i
    m_t = o_t < eos
    o_k, o_v = tl.arange(0, K), tl.arange(0, V)
    dt = a.dtype.element_ty
    b_beta = tl.load(beta + o_t * H + i_h, mask=m_t, other=0).to(tl.float32)
    b_gc = tl.load(gc + o_t * H + i_h, mask=m_t, other=0)
    b_a = tl.load(a + (o_t[:, None] * H + i_h) * BT + o_i[None, :], mask=m_t[:, None], other=0)
    b_k = load_rows(k, o_t, m_t, i_h, H, K, o_k).to(dt)
    b_w = tl.dot(scaled_cols(b_a, b_beta * tl.exp(b_gc), dt), b_k, input_precision=PREC)
    store_rows(w, b_w, o_t, m_t, i_h, H, K, o_k)
    b_v = load_rows(v, o_t, m_t, i_h, H, V, o_v).to(dt)
    b_u = tl.dot(scaled_cols(b_a, b_beta, dt), b_v, input_precision=PREC)
    store_rows(u, b_u, o_t, m_t, i_h, H, V, o_v)


@triton.jit
def carry_blocks(K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr, CARRY: tl.constexpr):
    """Value blocks of a state pass: those of ``V``, and in a carry pass ``K`` identity
    columns after them (in blocks of their own, so no block holds both)."""
    if CARRY:
        return tl.cdiv(V, BV) + tl.cdiv(K, BV)
    return tl.cdiv(V, BV)


@triton.jit
def carry_identity(o_k, o_v, V: tl.constexpr):
    """The identity columns' start in a carry pass: column ``o_v`` of an identity block is
    the unit vector of key row ``o_v - V_padded`` (blocks past ``V`` start at a multiple
    of the block that is at least ``V``)."""
    BV: tl.constexpr = o_v.shape[0]
    first: tl.constexpr = (V + BV - 1) // BV * BV
    return (o_k[:, None] == o_v[None, :] - first).to(tl.float32)


@triton.jit
def store_carry(out, b_h, i_nh, o_k, o_v, K: tl.constexpr, V: tl.constexpr):
    """A carry pass's end state of block ``o_v`` into ``out`` ``[n, H, K, V + K]``: value
    columns first, then the ``K`` identity columns (their linear map)."""
    BV: tl.constexpr = o_v.shape[0]
    first: tl.constexpr = (V + BV - 1) // BV * BV
    col = tl.where(o_v < first, o_v, o_v - first + V)
    ok = tl.where(o_v < first, o_v < V, o_v - first < K)
    tl.store(out + i_nh * K * (V + K) + o_k[:, None] * (V + K) + col[None, :], b_h,
             mask=ok[None, :])


@triton.autotune(configs=seq_configs(3), key=["H", "K", "V", "BT", "R"])
@triton.jit
def _state_fwd_kernel(k, w, u, gc, z, h, v_new, h0, ht, cu, chunk_offsets,
                      H, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
                      R: tl.constexpr, BV: tl.constexpr, USE_H0: tl.constexpr,
                      STORE_HT: tl.constexpr, DELTA: tl.constexpr, CARRY: tl.constexpr,
                      PREC: tl.constexpr):
    """``DELTA``: the delta rule (``v_new = u - w h``, stored); otherwise ``u`` are the
    values themselves and nothing is subtracted (gated linear attention). ``CARRY``: the
    carry pass of a segmented state pass (:func:`state_fwd`): nothing stored but the
    segment's end state ``ht`` ``[n, H, K, V + K]``, of its values from a zero start and
    of ``K`` identity columns (value blocks past ``V``: no values, identity start)."""
    # Sequence x head on grid axis 0 with the value blocks: axis 1 stops at 65,535.
    n_v = carry_blocks(K, V, BV, CARRY)
    i_v, i_nh = tl.program_id(0) % n_v, tl.program_id(0) // n_v
    i_n, i_h = i_nh // H, i_nh % H
    bos, eos = tl.load(cu + i_n).to(tl.int64), tl.load(cu + i_n + 1).to(tl.int64)
    c0, c1 = tl.load(chunk_offsets + i_n), tl.load(chunk_offsets + i_n + 1)
    o_i, o_k, o_v = tl.arange(0, BT), tl.arange(0, K), i_v * BV + tl.arange(0, BV)
    p_hv = o_k[:, None] * V + o_v[None, :]
    m_hv = o_v[None, :] < V
    # False in the identity blocks of a carry pass; a row vector (the interpreter masks
    # with no scalar and-ed into a vector).
    has_u = i_v + 0 * o_i < tl.cdiv(V, BV)
    b_h = tl.zeros([K, BV], dtype=tl.float32)
    if USE_H0:
        b_h += tl.load(h0 + i_nh * K * V + p_hv, mask=m_hv, other=0).to(tl.float32)
    if CARRY:
        b_h += carry_identity(o_k, o_v, V)
    if R == 1:
        # One slot per routing chunk: S' = exp(gL) S + z (k exp(gL - gc))^T v_new. A flat
        # loop whose loads do not depend on the state, so the compiler can prefetch them.
        for i_s in range(c0, c1):
            o_t = bos + (i_s - c0) * BT + o_i
            m_t = o_t < eos
            b_z = tl.load(z + i_s * H + i_h).to(tl.float32)
            if DELTA:
                b_w = load_rows(w, o_t, m_t, i_h, H, K, o_k)
            b_u = load_rows(u, o_t, m_t & has_u, i_h, H, V, o_v).to(tl.float32)
            b_k = load_rows(k, o_t, m_t, i_h, H, K, o_k)
            b_gc = tl.load(gc + o_t * H + i_h, mask=m_t, other=0)
            g_last = tl.load(gc + (tl.minimum(bos + (i_s - c0) * BT + BT, eos) - 1) * H + i_h)
            if not CARRY:
                tl.store(h + (i_s * H + i_h).to(tl.int64) * K * V + p_hv,
                         b_h.to(h.dtype.element_ty), mask=m_hv)
            if DELTA:
                b_vn = b_u - tl.dot(b_w, b_h.to(b_w.dtype), input_precision=PREC)
                if not CARRY:
                    store_rows(v_new, b_vn, o_t, m_t, i_h, H, V, o_v)
            else:
                b_vn = b_u
            b_kd = (b_k * (tl.exp(g_last - b_gc) * b_z)[:, None]).to(b_k.dtype)
            b_h = b_h * tl.exp(g_last) + tl.dot(tl.trans(b_kd), b_vn.to(b_k.dtype),
                                                  input_precision=PREC)
    else:
        for r in range(c0, c1):
            b_z = tl.load(z + r * H + i_h).to(tl.float32)
            b_sh = b_h
            t_r = bos + (r - c0) * (R * BT)
            for j in range(tl.minimum(R, tl.cdiv(eos - t_r, BT))):
                o_t = t_r + j * BT + o_i
                m_t = o_t < eos
                if not CARRY:
                    tl.store(h + ((r * R + j) * H + i_h).to(tl.int64) * K * V + p_hv,
                             b_h.to(h.dtype.element_ty), mask=m_hv)
                b_vn = load_rows(u, o_t, m_t & has_u, i_h, H, V, o_v).to(tl.float32)
                if DELTA:
                    b_w = load_rows(w, o_t, m_t, i_h, H, K, o_k)
                    b_vn -= tl.dot(b_w, b_h.to(b_w.dtype), input_precision=PREC)
                    if not CARRY:
                        store_rows(v_new, b_vn, o_t, m_t, i_h, H, V, o_v)
                b_gc = tl.load(gc + o_t * H + i_h, mask=m_t, other=0)
                g_last = tl.load(gc + (tl.minimum(t_r + j * BT + BT, eos) - 1) * H + i_h)
                b_k = load_rows(k, o_t, m_t, i_h, H, K, o_k)
                b_kd = (b_k * tl.exp(g_last - b_gc)[:, None]).to(b_k.dtype)
                b_h = b_h * tl.exp(g_last) + tl.dot(tl.trans(b_kd), b_vn.to(b_k.dtype),
                                                      input_precision=PREC)
                b_sh *= tl.exp(g_last)
            b_h = b_z * b_h + (1.0 - b_z) * b_sh
    if CARRY:
        store_carry(ht, b_h, i_nh, o_k, o_v, K, V)
    elif STORE_HT:
        tl.store(ht + i_nh * K * V + p_hv, b_h, mask=m_hv)


@triton.autotune(configs=_configs((64,)), key=["K", "V", "BT"])
@triton.jit
def _output_kernel(q, k, v_new, gc, h, o, scale, cu, chunk_offsets, chunk_seq,
                   H, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
                   R: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr):
    # Slots on grid axis 0 with the value blocks: axes 1-2 stop at 65,535 (CUDA).
    i_v, i_s, i_h = (tl.program_id(0) % tl.cdiv(V, BV), tl.program_id(0) // tl.cdiv(V, BV),
                     tl.program_id(1))
    _, t0, eos = slot_bounds(i_s, cu, chunk_offsets, chunk_seq, R, BT)
    if t0 >= eos:
        return
    o_i = tl.arange(0, BT)
    o_t = t0 + o_i
    m_t = o_t < eos
    o_k, o_v = tl.arange(0, K), i_v * BV + tl.arange(0, BV)
    b_q = load_rows(q, o_t, m_t, i_h, H, K, o_k)
    b_k = load_rows(k, o_t, m_t, i_h, H, K, o_k)
    b_h = tl.load(h + (i_s * H + i_h).to(tl.int64) * K * V + o_k[:, None] * V + o_v[None, :],
                  mask=o_v[None, :] < V, other=0)
    b_gc = tl.load(gc + o_t * H + i_h, mask=m_t, other=0)
    b_o = tl.dot(b_q, b_h, input_precision=PREC) * tl.exp(b_gc)[:, None]
    b_s = tl.dot(b_q, tl.trans(b_k), input_precision=PREC) * causal_decay(b_gc, o_i, 0)
    b_vn = load_rows(v_new, o_t, m_t, i_h, H, V, o_v)
    b_o += tl.dot(b_s.to(b_vn.dtype), b_vn, input_precision=PREC)
    store_rows(o, b_o * scale, o_t, m_t, i_h, H, V, o_v)


HALF_A = True
"""Keep the WY inverse ``A`` in the inputs' dtype (as fla does): w, u and the backward then
multiply half-precision operands. ``False`` keeps it in float32 (tf32 products). Safe for
the route gradient only with ``beta`` (and ``exp(gc)``) folded into A's columns rather than
into the rounded K and V operands: see :func:`scaled_cols`."""


def a_dtype(dtype: torch.dtype) -> torch.dtype:
    return dtype if HALF_A else torch.float32


TF32_INVERSE = True
"""Merge the blocked WY inverse of half-precision inputs with tf32 tensor-core products
(float32 inputs always take exact ones; the 16 x 16 diagonal inverses always do, see
:func:`inv_unit_lower`)."""


def inverse_precision(dtype: torch.dtype) -> str:
    return "tf32" if TF32_INVERSE and dtype != torch.float32 else "ieee"


def wy_fwd(k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, cmap,
           bt: int, r: int, saved: tuple[torch.Tensor, torch.Tensor] | None = None,
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(gc, A, w, u)``; with ``saved = (gc, A)`` from the forward, only ``w, u`` are redone."""
    _, total, heads, d_k = k.shape
    d_v = v.shape[-1]
    w = empty(*k.shape, dtype=k.dtype, device=k.device)
    u = empty(*v.shape, dtype=k.dtype, device=k.device)
    grid = (cmap.chunk_seq.numel() * r, heads)
    meta = dict(H=heads, K=d_k, V=d_v, BT=bt, R=r, PREC=dot_precision(k.dtype))
    if saved is not None:
        gc, a = saved
        _wu_kernel[grid](k, v, beta, gc, a, w, u, cmap.cu_seqlens, cmap.chunk_offsets,
                         cmap.chunk_seq, **meta)
        return gc, a, w, u
    gc = empty(1, total, heads, dtype=torch.float32, device=k.device)
    a = empty(1, total, heads, bt, dtype=a_dtype(k.dtype), device=k.device)
    _wy_kernel[grid](k, v, g, beta, gc, a, w, u, cmap.cu_seqlens, cmap.chunk_offsets,
                     cmap.chunk_seq, INV=inverse_precision(k.dtype), **meta)
    return gc, a, w, u


def state_fwd(k: torch.Tensor, w: torch.Tensor | None, u: torch.Tensor, gc: torch.Tensor,
              z: torch.Tensor, h0: torch.Tensor | None, output_final_state: bool, cmap,
              bt: int, r: int, segmap: ChunkMap | None = None,
              ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """``(h, v_new, final_state)``: slot start states ``[slots, H, K, V]`` and the new values.

    With ``w = None`` the state takes the values ``u`` as they are (gated linear
    attention: ``h' = exp(gL) h + (k exp(gL - gc))^T u``) and ``v_new`` is None. With
    ``segmap`` (:func:`.segments.segments_of`) each sequence runs as segments."""
    _, _, heads, d_k = k.shape
    d_v = u.shape[-1]
    n_seq = cmap.cu_seqlens.numel() - 1
    h = empty(cmap.chunk_seq.numel() * r, heads, d_k, d_v, dtype=k.dtype, device=k.device)
    v_new = None if w is None else empty(*u.shape, dtype=k.dtype, device=k.device)
    if segmap is not None:
        segments = count(segmap, n_seq)
        carry = carry_buffer(n_seq * segments, heads, d_k, d_v, k.device)
        _state_fwd(k, w, u, gc, z, h, v_new, None, carry, segmap, bt, r, carry=True)
        h0, cmap = chain_starts(carry, h0, segments, d_v), segmap
    ht = (empty(cmap.cu_seqlens.numel() - 1, heads, d_k, d_v, dtype=torch.float32,
                device=k.device) if output_final_state else None)
    _state_fwd(k, w, u, gc, z, h, v_new, h0, ht, cmap, bt, r)
    if ht is not None and segmap is not None:  # the last segment's end is the sequence's
        ht = ht[segments - 1::segments].contiguous()
    return h, v_new, ht


def _state_fwd(k: torch.Tensor, w: torch.Tensor | None, u: torch.Tensor, gc: torch.Tensor,
               z: torch.Tensor, h: torch.Tensor, v_new: torch.Tensor | None,
               h0: torch.Tensor | None, ht: torch.Tensor | None, cmap, bt: int, r: int,
               carry: bool = False) -> None:
    """One launch of the state kernel; with ``carry`` its carry pass, into ``ht``."""
    _, _, heads, d_k = k.shape
    d_v = u.shape[-1]
    grid = state_grid(cmap.cu_seqlens.numel() - 1, heads, d_k, d_v, carry)
    _state_fwd_kernel[grid](k, w, u, gc, z, h, v_new, h0, ht, cmap.cu_seqlens,
                            cmap.chunk_offsets, H=heads, K=d_k, V=d_v, BT=bt, R=r,
                            USE_H0=h0 is not None, STORE_HT=ht is not None,
                            DELTA=w is not None, CARRY=carry, PREC=dot_precision(k.dtype))


def output_fwd(q: torch.Tensor, k: torch.Tensor, v_new: torch.Tensor, gc: torch.Tensor,
               h: torch.Tensor, scale: float, out_dtype: torch.dtype, cmap, bt: int, r: int,
               ) -> torch.Tensor:
    """The output ``[1, T_total, H, V]``."""
    _, _, heads, d_k = q.shape
    d_v = v_new.shape[-1]
    o = empty(*v_new.shape, dtype=out_dtype, device=q.device)

    def grid(meta: dict) -> tuple[int, int]:
        return triton.cdiv(d_v, meta["BV"]) * h.shape[0], heads
    _output_kernel[grid](q, k, v_new, gc, h, o, scale, cmap.cu_seqlens, cmap.chunk_offsets,
                         cmap.chunk_seq, H=heads, K=d_k, V=d_v, BT=bt, R=r,
                         PREC=dot_precision(q.dtype))
    return o
