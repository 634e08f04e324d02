"""Backward kernels of the hybrid chunked gated delta rule (see :mod:`.gated_delta_rule`).

Per slot (kernel chunk) with start state ``h``, end-state gradient ``dh'`` and
``v_new = u - w h``, ``o = scale (exp(gc) q h + M v_new)``,
``h' = exp(gL) h + (k exp(gL - gc))^T v_new``:

1. :func:`dv_local` (parallel): ``M^T do``, the within-slot part of ``d v_new``.
2. :func:`state_bwd` (sequential, reverse): ``dh`` per slot and ``d v_new`` in full;
   per routing chunk the gradient ``dS`` of its end state splits into ``z dS`` for the
   running state and a decayed copy ``E`` for the shadow, which gives the route gradient
   ``<dS, write>`` (summed slot by slot from ``k exp(.)^T v_new``), the shadow's gate
   gradient ``(1 - z) <E, S_start>`` (the same for every token of the routing chunk), and
   ``dS_start = dh + (1 - z) E``.
3. :func:`dqkwg` (parallel): ``dq``, the state and intra-slot parts of ``dk``, ``dw`` and
   the gate gradient before the WY transform.
4. :func:`wy_bwd` (parallel): back through ``u, w`` and the inverse ``A`` to ``dk, dv,
   dbeta`` and the gate gradient, then the reverse cumulative sum of ``d gc`` into ``dg``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .gated_delta_rule_fwd import (
    _configs,
    carry_blocks,
    carry_identity,
    causal_decay,
    dot_precision,
    load_rows,
    seq_configs,
    slot_bounds,
    store_carry,
    store_rows,
)
from .segments import carry_buffer, chain_ends, count, state_grid
from .utils import ChunkMap, empty, is_power_of_two

HALF_GRADS = True
"""Keep the backward's intermediates (``M^T do``, ``d v_new``, partial ``dk``, ``dw``) in
the inputs' dtype rather than float32: they only feed half-precision products or one sum."""

DQKWG_BLOCK_K = 64
"""Key columns per :func:`dqkwg` program (``K`` is split over programs above this): three
``[BT, K]`` float32 accumulators of K = 128 spilled registers at 4 warps; 2 x 64 do not."""

WY_BWD_BLOCK_K = 64
"""Key columns per pass of :func:`wy_bwd`'s two loops over ``K``: one pass of 128 spills
registers, as in :data:`DQKWG_BLOCK_K`."""


def grad_dtype(dtype: torch.dtype) -> torch.dtype:
    return dtype if HALF_GRADS else torch.float32


def value_block(d_v: int) -> int:
    """All value columns in one block where ``Dv`` is a power of two, else blocks of 64."""
    return d_v if is_power_of_two(d_v) else 64


@triton.autotune(configs=_configs(), key=["K", "V", "BT"])
@triton.jit
def _dv_local_kernel(q, k, do, gc, dv, scale, cu, chunk_offsets, chunk_seq,
                     H, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
                     R: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr):
    """``BV = V`` where ``V`` is a power of two (one block); otherwise blocks of 64 (the
    ``Dv + 1`` of linear attention), unrolled."""
    i_s, i_h = tl.program_id(0), tl.program_id(1)
    _, t0, eos = slot_bounds(i_s, cu, chunk_offsets, chunk_seq, R, BT)
    if t0 >= eos:
        return
    o_i = tl.arange(0, BT)
    o_t = t0 + o_i
    m_t = o_t < eos
    o_k = tl.arange(0, K)
    b_q = load_rows(q, o_t, m_t, i_h, H, K, o_k)
    b_k = load_rows(k, o_t, m_t, i_h, H, K, o_k)
    b_gc = tl.load(gc + o_t * H + i_h, mask=m_t, other=0)
    b_mt = tl.dot(b_k, tl.trans(b_q), input_precision=PREC) * tl.trans(
        causal_decay(b_gc, o_i, 0)) * scale
    for v0 in tl.static_range(0, V, BV):
        o_v = v0 + tl.arange(0, BV)
        b_do = load_rows(do, o_t, m_t, i_h, H, V, o_v)
        store_rows(dv, tl.dot(b_mt.to(b_do.dtype), b_do, input_precision=PREC),
                   o_t, m_t, i_h, H, V, o_v)


@triton.autotune(configs=seq_configs(2), key=["H", "K", "V", "BT", "R"],
                 reset_to_zero=["dz", "dgs"])
@triton.jit
def _state_bwd_kernel(q, k, w, do, v_new, dv_local, gc, z, h, dh, dv, dz, dgs, dht, dh0,
                      scale, cu, chunk_offsets,
                      H, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
                      R: tl.constexpr, BV: tl.constexpr, USE_DHT: tl.constexpr,
                      STORE_DH0: tl.constexpr, DZ_MIN: tl.constexpr, DELTA: tl.constexpr,
                      CARRY: tl.constexpr, PREC: tl.constexpr):
    """``DELTA``: the delta rule (``dh`` loses ``w^T d v_new``); otherwise gated linear
    attention, whose ``v_new`` are the values and which has no ``w``. ``CARRY``: the
    carry pass of a segmented state pass (:func:`state_bwd`): nothing stored but the
    gradient of the segment's start state ``dh0`` ``[n, H, K, V + K]``, of its outputs'
    gradients from a zero end and of ``K`` identity columns (no ``do``, identity end)."""
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
    has_do = i_v + 0 * o_i < tl.cdiv(V, BV)
    b_dh = tl.zeros([K, BV], dtype=tl.float32)
    if USE_DHT:
        b_dh += tl.load(dht + i_nh * K * V + p_hv, mask=m_hv, other=0).to(tl.float32)
    if CARRY:
        b_dh += carry_identity(o_k, o_v, V)
    if R == 1:
        # One slot per routing chunk, a flat loop (prefetchable loads). dS, the gradient of
        # the slot's end state: the running state gets z dS, the shadow (1 - z) dS, so
        # dS_start = exp(gL) dS + (q exp(gc) scale)^T do - w^T dv.
        for ii in range(c1 - c0):
            i_s = c1 - 1 - ii
            o_t = bos + (i_s - c0) * BT + o_i
            m_t = o_t < eos
            b_z = tl.load(z + i_s * H + i_h).to(tl.float32)
            b_gc = tl.load(gc + o_t * H + i_h, mask=m_t, other=0)
            g_last = tl.load(gc + (tl.minimum(bos + (i_s - c0) * BT + BT, eos) - 1) * H + i_h)
            b_k = load_rows(k, o_t, m_t, i_h, H, K, o_k)
            b_q = load_rows(q, o_t, m_t, i_h, H, K, o_k)
            if DELTA:
                b_w = load_rows(w, o_t, m_t, i_h, H, K, o_k)
            b_do = load_rows(do, o_t, m_t & has_do, i_h, H, V, o_v)
            b_dv = load_rows(dv_local, o_t, m_t & has_do, i_h, H, V, o_v).to(tl.float32)
            if not CARRY:
                tl.store(dh + (i_s * H + i_h).to(tl.int64) * K * V + p_hv,
                         (b_z * b_dh).to(dh.dtype.element_ty), mask=m_hv)
            b_kd = (b_k * tl.exp(g_last - b_gc)[:, None]).to(b_k.dtype)
            # k exp(gL - gc) dS serves both d v_new (times z) and the route gradient.
            b_p = tl.dot(b_kd, b_dh.to(b_k.dtype), input_precision=PREC)
            b_dv += b_z * b_p
            if not CARRY:
                store_rows(dv, b_dv, o_t, m_t, i_h, H, V, o_v)
                if b_z > DZ_MIN:  # the route gradient only where it is asked for
                    b_vn = load_rows(v_new, o_t, m_t, i_h, H, V, o_v).to(tl.float32)
                    tl.atomic_add(dz + i_s * H + i_h, tl.sum(tl.sum(b_p * b_vn, 1), 0),
                                  sem="relaxed")
                if b_z < 1.0:
                    b_start = tl.load(h + (i_s * H + i_h).to(tl.int64) * K * V + p_hv,
                                      mask=m_hv, other=0).to(tl.float32)
                    tl.atomic_add(dgs + i_s * H + i_h,
                                  (1.0 - b_z) * tl.exp(g_last) * tl.sum(b_dh * b_start),
                                  sem="relaxed")
            b_qd = (b_q * (tl.exp(b_gc) * scale)[:, None]).to(b_q.dtype)
            b_dh = b_dh * tl.exp(g_last) + tl.dot(tl.trans(b_qd), b_do, input_precision=PREC)
            if DELTA:
                b_dh -= tl.dot(tl.trans(b_w), b_dv.to(b_w.dtype), input_precision=PREC)
    else:
        for rr in range(c1 - c0):
            r = c1 - 1 - rr
            b_z = tl.load(z + r * H + i_h).to(tl.float32)
            b_e = b_dh
            b_dh *= b_z
            b_dz = tl.zeros([BT], dtype=tl.float32)
            t_r = bos + (r - c0) * (R * BT)
            n_j = tl.minimum(R, tl.cdiv(eos - t_r, BT))
            for jj in range(n_j):
                j = n_j - 1 - jj
                o_t = t_r + j * BT + o_i
                m_t = o_t < eos
                if not CARRY:
                    tl.store(dh + ((r * R + j) * H + i_h).to(tl.int64) * K * V + p_hv,
                             b_dh.to(dh.dtype.element_ty), mask=m_hv)
                b_gc = tl.load(gc + o_t * H + i_h, mask=m_t, other=0)
                g_last = tl.load(gc + (tl.minimum(t_r + j * BT + BT, eos) - 1) * H + i_h)
                b_k = load_rows(k, o_t, m_t, i_h, H, K, o_k)
                b_kd = (b_k * tl.exp(g_last - b_gc)[:, None]).to(b_k.dtype)
                b_dv = load_rows(dv_local, o_t, m_t & has_do, i_h, H, V, o_v) + tl.dot(
                    b_kd, b_dh.to(b_k.dtype), input_precision=PREC)
                if not CARRY:
                    store_rows(dv, b_dv, o_t, m_t, i_h, H, V, o_v)
                    if b_z > DZ_MIN:  # the route gradient only where it is asked for
                        b_vn = load_rows(v_new, o_t, m_t, i_h, H, V, o_v).to(tl.float32)
                        b_dz += tl.sum(tl.dot(b_kd, b_e.to(b_k.dtype), input_precision=PREC)
                                       * b_vn, 1)
                b_q = load_rows(q, o_t, m_t, i_h, H, K, o_k)
                b_qd = (b_q * (tl.exp(b_gc) * scale)[:, None]).to(b_q.dtype)
                b_do = load_rows(do, o_t, m_t & has_do, i_h, H, V, o_v)
                b_dh = b_dh * tl.exp(g_last) + tl.dot(tl.trans(b_qd), b_do, input_precision=PREC)
                if DELTA:
                    b_w = load_rows(w, o_t, m_t, i_h, H, K, o_k)
                    b_dh -= tl.dot(tl.trans(b_w), b_dv.to(b_w.dtype), input_precision=PREC)
                b_e *= tl.exp(g_last)
            if not CARRY:
                tl.atomic_add(dz + r * H + i_h, tl.sum(b_dz, 0), sem="relaxed")
            if b_z < 1.0:
                if not CARRY:
                    b_start = tl.load(h + (r * R * H + i_h).to(tl.int64) * K * V + p_hv,
                                      mask=m_hv, other=0).to(tl.float32)
                    tl.atomic_add(dgs + r * H + i_h, (1.0 - b_z) * tl.sum(b_e * b_start),
                                  sem="relaxed")
                b_dh += (1.0 - b_z) * b_e
    if CARRY:
        store_carry(dh0, b_dh, i_nh, o_k, o_v, K, V)
    elif STORE_DH0:
        tl.store(dh0 + i_nh * K * V + p_hv, b_dh, mask=m_hv)


@triton.autotune(configs=_configs((64,), (4,), stages=1), key=["K", "V", "BT", "BK"],
                 reset_to_zero=["dgc"])
@triton.jit
def _dqkwg_kernel(q, k, v_new, do, dv, gc, h, dh, dq, dk, dw, dgc, scale,
                  cu, chunk_offsets, chunk_seq,
                  H, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
                  R: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, DELTA: tl.constexpr,
                  PREC: tl.constexpr):
    """One slot, one block of ``BK`` key columns: ``dq, dk, dw`` of those columns and their
    share of the gate gradient (added into ``dgc``, zeroed, when ``K`` spans several
    blocks). Blocks of 64 keep the three ``[BT, BK]`` float32 accumulators in registers.
    Without ``DELTA`` (gated linear attention) there is no ``w``, so no ``dw``."""
    # A slot's key blocks are neighbours on axis 0, so they run together and the second
    # finds do, v_new and dv in L2; axes 1-2 would cap the slots at CUDA's 65,535.
    i_s, i_k, i_h = tl.program_id(0) // (K // BK), tl.program_id(0) % (K // BK), tl.program_id(1)
    _, t0, eos = slot_bounds(i_s, cu, chunk_offsets, chunk_seq, R, BT)
    if t0 >= eos:
        return
    o_i = tl.arange(0, BT)
    o_t = t0 + o_i
    m_t = o_t < eos
    o_k = i_k * BK + tl.arange(0, BK)
    p_h = h + (i_s * H + i_h).to(tl.int64) * K * V + o_k[:, None] * V
    p_dh = dh + (i_s * H + i_h).to(tl.int64) * K * V + o_k[:, None] * V
    b_dq = tl.zeros([BT, BK], dtype=tl.float32)
    b_dk = tl.zeros([BT, BK], dtype=tl.float32)
    b_dw = tl.zeros([BT, BK], dtype=tl.float32)
    b_ds = tl.zeros([BT, BT], dtype=tl.float32)
    b_hdh = tl.zeros([BK], dtype=tl.float32)
    for v0 in range(0, V, BV):
        o_v = v0 + tl.arange(0, BV)
        m_v = o_v[None, :] < V
        b_h = tl.load(p_h + o_v[None, :], mask=m_v, other=0)
        b_dh = tl.load(p_dh + o_v[None, :], mask=m_v, other=0)
        b_do = load_rows(do, o_t, m_t, i_h, H, V, o_v)
        b_vn = load_rows(v_new, o_t, m_t, i_h, H, V, o_v)
        b_dq += tl.dot(b_do, tl.trans(b_h), input_precision=PREC)
        b_dk += tl.dot(b_vn, tl.trans(b_dh), input_precision=PREC)
        b_ds += tl.dot(b_do, tl.trans(b_vn), input_precision=PREC)  # the same in every block
        if DELTA:
            b_dv = load_rows(dv, o_t, m_t, i_h, H, V, o_v).to(b_h.dtype)
            b_dw += tl.dot(b_dv, tl.trans(b_h), input_precision=PREC)
        b_hdh += tl.sum(b_h.to(tl.float32) * b_dh.to(tl.float32), 1)
    # Each result is stored as soon as it is complete (fewer live registers).
    if DELTA:
        store_rows(dw, -b_dw, o_t, m_t, i_h, H, K, o_k)
    b_gc = tl.load(gc + o_t * H + i_h, mask=m_t, other=0)
    t_last = tl.minimum(t0 + BT, eos) - 1
    g_last = tl.load(gc + t_last * H + i_h)
    b_q = load_rows(q, o_t, m_t, i_h, H, K, o_k)
    b_k = load_rows(k, o_t, m_t, i_h, H, K, o_k)
    b_ds = (b_ds * causal_decay(b_gc, o_i, 0) * scale).to(b_q.dtype)
    b_dq = b_dq * (tl.exp(b_gc) * scale)[:, None] + tl.dot(b_ds, b_k, input_precision=PREC)
    b_dg = tl.sum(b_dq * b_q.to(tl.float32), 1)
    store_rows(dq, b_dq, o_t, m_t, i_h, H, K, o_k)
    b_dk *= tl.exp(g_last - b_gc)[:, None]
    b_kdk_state = tl.sum(tl.sum(b_dk * b_k.to(tl.float32), 1), 0)
    b_dk += tl.dot(tl.trans(b_ds), b_q, input_precision=PREC)
    b_dg -= tl.sum(b_dk * b_k.to(tl.float32), 1)
    store_rows(dk, b_dk, o_t, m_t, i_h, H, K, o_k)
    b_dg += tl.where(o_t == t_last, tl.exp(g_last) * tl.sum(b_hdh, 0) + b_kdk_state, 0.0)
    if K == BK:
        tl.store(dgc + o_t * H + i_h, b_dg, mask=m_t)
    else:
        tl.atomic_add(dgc + o_t * H + i_h, b_dg, mask=m_t, sem="relaxed")


@triton.autotune(configs=_configs((64,), (4,), stages=1), key=["K", "V", "BT"])
@triton.jit
def _wy_bwd_kernel(k, v, beta, gc, a, dw, du, dk_part, dgc, dgs, dk, dv, dbeta, dg,
                   cu, chunk_offsets, chunk_seq,
                   H, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
                   R: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr):
    i_s, i_h = tl.program_id(0), tl.program_id(1)
    r, t0, eos = slot_bounds(i_s, cu, chunk_offsets, chunk_seq, R, BT)
    if t0 >= eos:
        return
    o_i = tl.arange(0, BT)
    o_t = t0 + o_i
    m_t = o_t < eos
    dt = a.dtype.element_ty
    b_a = tl.load(a + (o_t[:, None] * H + i_h) * BT + o_i[None, :], mask=m_t[:, None], other=0)
    b_at = tl.trans(b_a)
    b_beta = tl.load(beta + o_t * H + i_h, mask=m_t, other=0).to(tl.float32)
    b_gc = tl.load(gc + o_t * H + i_h, mask=m_t, other=0)
    b_da = tl.zeros([BT, BT], dtype=tl.float32)
    b_dbeta = tl.zeros([BT], dtype=tl.float32)
    for v0 in range(0, V, BV):
        o_v = v0 + tl.arange(0, BV)
        b_v = load_rows(v, o_t, m_t, i_h, H, V, o_v)
        b_du = load_rows(du, o_t, m_t, i_h, H, V, o_v).to(dt)
        b_y = tl.dot(b_at, b_du, input_precision=PREC)
        store_rows(dv, b_y * b_beta[:, None], o_t, m_t, i_h, H, V, o_v)
        b_dbeta += tl.sum(b_v.to(tl.float32) * b_y, 1)
        b_da += tl.dot(b_du, tl.trans(b_v.to(dt)), input_precision=PREC) * b_beta[None, :]
    # Two passes over blocks of BK key columns, so that no [BT, K] float32 tile is live
    # (K = 128 in one piece spilled registers): the first gathers what needs every column
    # (dA, K K^T, the rows of K . A^T dw), the second forms and stores dk block by block.
    b_bg = b_beta * tl.exp(b_gc)
    b_kx = tl.zeros([BT], dtype=tl.float32)
    b_kk = tl.zeros([BT, BT], dtype=tl.float32)
    for k0 in range(0, K, BK):
        o_k = k0 + tl.arange(0, BK)
        b_k = load_rows(k, o_t, m_t, i_h, H, K, o_k).to(dt)
        b_dw = load_rows(dw, o_t, m_t, i_h, H, K, o_k).to(dt)
        b_x = tl.dot(b_at, b_dw, input_precision=PREC)
        b_kx += tl.sum(b_k.to(tl.float32) * b_x, 1)
        # dA = du (diag(beta) V)^T + dw (diag(beta exp(gc)) K)^T: the scales on the
        # product's columns, not rounded into the half-precision operands (as forward).
        b_da += tl.dot(b_dw, tl.trans(b_k), input_precision=PREC) * b_bg[None, :]
        b_kk += tl.dot(b_k, tl.trans(b_k), input_precision=PREC)
    b_dbeta += tl.exp(b_gc) * b_kx
    b_dgc = tl.load(dgc + o_t * H + i_h, mask=m_t, other=0) + b_bg * b_kx
    # d(A^{-1})^{-1}: dL = -A^T dA A^T on the strictly lower part (float32 operands).
    b_at32 = b_at.to(tl.float32)
    b_da = -tl.dot(tl.dot(b_at32, b_da, input_precision=PREC), b_at32, input_precision=PREC)
    b_da *= causal_decay(b_gc, o_i, 1)
    b_dbeta += tl.sum(b_da * b_kk, 1)
    b_da *= b_beta[:, None]
    for k0 in range(0, K, BK):
        o_k = k0 + tl.arange(0, BK)
        b_k = load_rows(k, o_t, m_t, i_h, H, K, o_k).to(tl.float32)
        b_dw = load_rows(dw, o_t, m_t, i_h, H, K, o_k).to(dt)
        b_dk = load_rows(dk_part, o_t, m_t, i_h, H, K, o_k).to(tl.float32)
        b_dk += tl.dot(b_at, b_dw, input_precision=PREC) * b_bg[:, None]
        b_dk += tl.dot(b_da, b_k, input_precision=PREC)
        b_dk += tl.dot(tl.trans(b_da), b_k, input_precision=PREC)
        store_rows(dk, b_dk, o_t, m_t, i_h, H, K, o_k)
    b_da *= b_kk
    b_dgc += tl.sum(b_da, 1) - tl.sum(b_da, 0)
    # g_t enters every gc_s with s >= t: reverse cumulative sum, plus the shadow's share.
    b_dg = tl.sum(b_dgc, 0) - tl.cumsum(b_dgc, 0) + b_dgc + tl.load(dgs + r * H + i_h)
    tl.store(dbeta + o_t * H + i_h, b_dbeta.to(dbeta.dtype.element_ty), mask=m_t)
    tl.store(dg + o_t * H + i_h, b_dg.to(dg.dtype.element_ty), mask=m_t)


def dv_local(q: torch.Tensor, k: torch.Tensor, do: torch.Tensor, gc: torch.Tensor, scale: float,
             cmap, bt: int, r: int) -> torch.Tensor:
    """``M^T do``, ``[1, T_total, H, V]``."""
    _, _, heads, d_k = q.shape
    out = empty(*do.shape, dtype=grad_dtype(do.dtype), device=q.device)
    _dv_local_kernel[(cmap.chunk_seq.numel() * r, heads)](
        q, k, do, gc, out, scale, cmap.cu_seqlens, cmap.chunk_offsets, cmap.chunk_seq,
        H=heads, K=d_k, V=do.shape[-1], BT=bt, R=r, BV=value_block(do.shape[-1]),
        PREC=dot_precision(q.dtype))
    return out


def state_bwd(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor | None, do: torch.Tensor,
              v_new: torch.Tensor, gc: torch.Tensor, z: torch.Tensor,
              h: torch.Tensor, dht: torch.Tensor | None, need_dh0: bool, all_dz: bool,
              scale: float, cmap, bt: int, r: int, segmap: ChunkMap | None = None,
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                         torch.Tensor | None]:
    """``(dh, d v_new, d z, shadow gate gradient per routing chunk, d initial state)``;
    ``w = None`` for gated linear attention (``v_new`` the values). With ``segmap`` each
    sequence runs as segments, as in the forward (:mod:`.segments`)."""
    _, _, heads, d_k = q.shape
    d_v = do.shape[-1]
    n_seq = cmap.cu_seqlens.numel() - 1
    dvl = dv_local(q, k, do, gc, scale, cmap, bt, r)
    dh = empty(*h.shape, dtype=h.dtype, device=q.device)
    dv = empty(*do.shape, dtype=grad_dtype(do.dtype), device=q.device)
    dz = torch.zeros(z.shape, dtype=torch.float32, device=q.device)
    dgs = torch.zeros(z.shape, dtype=torch.float32, device=q.device)
    passes = dict(q=q, k=k, w=w, do=do, v_new=v_new, dvl=dvl, gc=gc, z=z, h=h, dh=dh, dv=dv,
                  dz=dz, dgs=dgs, scale=scale, bt=bt, r=r, all_dz=all_dz)
    if segmap is not None:
        segments = count(segmap, n_seq)
        carry = carry_buffer(n_seq * segments, heads, d_k, d_v, q.device)
        _state_bwd(**passes, dht=None, dh0=carry, cmap=segmap, carry=True)
        dht, cmap = chain_ends(carry, dht, segments, d_v), segmap
    dh0 = (empty(cmap.cu_seqlens.numel() - 1, heads, d_k, d_v, dtype=torch.float32,
                 device=q.device) if need_dh0 else None)
    _state_bwd(**passes, dht=dht, dh0=dh0, cmap=cmap)
    if dh0 is not None and segmap is not None:  # the first segment's start is the sequence's
        dh0 = dh0[::segments].contiguous()
    return dh, dv, dz, dgs, dh0


def _state_bwd(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor | None, do: torch.Tensor,
               v_new: torch.Tensor, dvl: torch.Tensor, gc: torch.Tensor, z: torch.Tensor,
               h: torch.Tensor, dh: torch.Tensor, dv: torch.Tensor, dz: torch.Tensor,
               dgs: torch.Tensor, dht: torch.Tensor | None, dh0: torch.Tensor | None,
               scale: float, cmap, bt: int, r: int, all_dz: bool, carry: bool = False) -> None:
    """One launch of the backward state kernel; with ``carry`` its carry pass, into
    ``dh0``."""
    _, _, heads, d_k = q.shape
    d_v = do.shape[-1]
    grid = state_grid(cmap.cu_seqlens.numel() - 1, heads, d_k, d_v, carry)
    _state_bwd_kernel[grid](q, k, w, do, v_new, dvl, gc, z, h, dh, dv, dz, dgs, dht, dh0,
                            scale, cmap.cu_seqlens, cmap.chunk_offsets,
                            H=heads, K=d_k, V=d_v, BT=bt, R=r, USE_DHT=dht is not None,
                            STORE_DH0=dh0 is not None, DZ_MIN=-1.0 if all_dz else 0.5,
                            DELTA=w is not None, CARRY=carry, PREC=dot_precision(q.dtype))


def dqkwg(q: torch.Tensor, k: torch.Tensor, v_new: torch.Tensor, do: torch.Tensor,
          dv: torch.Tensor | None, gc: torch.Tensor, h: torch.Tensor, dh: torch.Tensor,
          scale: float, cmap, bt: int, r: int,
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """``(dq, partial dk, dw, partial d gc)``. With ``dv = None`` (gated linear attention:
    no ``w``) ``dw`` is None, and ``dk``, ``d gc`` are complete."""
    _, _, heads, d_k = q.shape
    dq = empty(*q.shape, dtype=q.dtype, device=q.device)
    dk = empty(*q.shape, dtype=grad_dtype(q.dtype), device=q.device)
    dw = None if dv is None else empty(*q.shape, dtype=grad_dtype(q.dtype), device=q.device)
    bk = min(d_k, DQKWG_BLOCK_K)
    dgc = (empty if bk == d_k else torch.zeros)(*q.shape[:3], dtype=torch.float32,
                                                 device=q.device)
    _dqkwg_kernel[(cmap.chunk_seq.numel() * r * (d_k // bk), heads)](
        q, k, v_new, do, dv, gc, h, dh, dq, dk, dw, dgc, scale, cmap.cu_seqlens,
        cmap.chunk_offsets, cmap.chunk_seq, H=heads, K=d_k, V=do.shape[-1], BT=bt, R=r,
        BK=bk, DELTA=dv is not None, PREC=dot_precision(q.dtype))
    return dq, dk, dw, dgc


def wy_bwd(k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
           gc: torch.Tensor, a: torch.Tensor, dw: torch.Tensor, du: torch.Tensor,
           dk_part: torch.Tensor, dgc: torch.Tensor, dgs: torch.Tensor, cmap, bt: int, r: int,
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dk, dv, dbeta, dg)`` in the inputs' dtypes."""
    _, _, heads, d_k = k.shape
    dk = empty(*k.shape, dtype=k.dtype, device=k.device)
    dv = empty(*v.shape, dtype=v.dtype, device=k.device)
    dbeta = empty(*beta.shape, dtype=beta.dtype, device=k.device)
    dg = empty(*g.shape, dtype=g.dtype, device=k.device)
    _wy_bwd_kernel[(cmap.chunk_seq.numel() * r, heads)](
        k, v, beta, gc, a, dw, du, dk_part, dgc, dgs, dk, dv, dbeta, dg, cmap.cu_seqlens,
        cmap.chunk_offsets, cmap.chunk_seq, H=heads, K=d_k, V=v.shape[-1], BT=bt, R=r,
        BK=min(d_k, WY_BWD_BLOCK_K), PREC=dot_precision(k.dtype))
    return dk, dv, dbeta, dg
