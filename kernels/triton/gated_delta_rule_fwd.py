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

from .utils import autotune_configs, empty


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs get exact fp32 products on the GPU; half inputs already round harder."""
    return "ieee" if dtype == torch.float32 else "tf32"


def _configs(block_v: tuple[int, ...] = (0,), warps: tuple[int, ...] = (2, 4),
             ) -> list[triton.Config]:
    """Warps (x V block, when the kernel splits V) on the GPU; one config otherwise.

    Kept to configs checked on an H100 with Triton 3.6: there 8 warps in the parallel
    kernels gave wrong dk / dg / dbeta, and BV = 32 in the output kernel faulted, so the
    parallel kernels use BV = 64 only.
    """
    def meta(bv: int) -> dict[str, int]:
        return {"BV": bv} if bv else {}
    configs = [triton.Config(meta(bv), num_warps=nw, num_stages=2)
               for bv in block_v for nw in warps]
    return autotune_configs(configs, triton.Config(meta(block_v[0]), num_warps=4))


@triton.jit
def slot_bounds(i_s, cu, chunk_offsets, chunk_seq, R: tl.constexpr, BT: tl.constexpr):
    """Routing chunk, first token and sequence end of kernel-chunk slot ``i_s``."""
    r = i_s // R
    i_n = tl.load(chunk_seq + r)
    eos = tl.load(cu + i_n + 1).to(tl.int64)
    t0 = tl.load(cu + i_n).to(tl.int64) + (r - tl.load(chunk_offsets + i_n)) * (R * BT)
    return r, t0 + (i_s % R) * BT, eos


@triton.jit
def load_rows(ptr, o_t, m_t, i_h, H, D: tl.constexpr, o_d):
    """Rows ``o_t`` (zero where ``m_t`` is false), head ``i_h``, columns ``o_d`` of [T, H, D]."""
    return tl.load(ptr + (o_t[:, None] * H + i_h) * D + o_d[None, :],
                   mask=m_t[:, None] & (o_d[None, :] < D), other=0)


@triton.jit
def store_rows(ptr, x, o_t, m_t, i_h, H, D: tl.constexpr, o_d):
    tl.store(ptr + (o_t[:, None] * H + i_h) * D + o_d[None, :], x.to(ptr.dtype.element_ty),
             mask=m_t[:, None] & (o_d[None, :] < D))


@triton.jit
def causal_decay(b_gc, o_i, GAP: tl.constexpr):
    """``exp(gc_t - gc_s)`` where ``t - s >= GAP`` (0: causal, 1: strictly lower), else 0."""
    m = o_i[:, None] - o_i[None, :] >= GAP
    return tl.where(m, tl.exp(tl.where(m, b_gc[:, None] - b_gc[None, :], 0.0)), 0.0)


@triton.autotune(configs=_configs(), key=["K", "V", "BT", "SAVED_A"])
@triton.jit
def _wy_kernel(k, v, g, beta, gc, a, w, u, cu, chunk_offsets, chunk_seq,
               H, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
               R: tl.constexpr, SAVED_A: tl.constexpr, PREC: tl.constexpr):
    i_s, i_h = tl.program_id(0), tl.program_id(1)
    _, t0, eos = slot_bounds(i_s, cu, chunk_offsets, chunk_seq, R, BT)
    if t0 >= eos:
        return
    o_i = tl.arange(0, BT)
    o_t = t0 + o_i
    m_t = o_t < eos
    o_k, o_v = tl.arange(0, K), tl.arange(0, V)
    b_beta = tl.load(beta + o_t * H + i_h, mask=m_t, other=0).to(tl.float32)
    b_k = load_rows(k, o_t, m_t, i_h, H, K, o_k).to(tl.float32)
    p_a = a + (o_t[:, None] * H + i_h) * BT + o_i[None, :]
    if SAVED_A:
        b_gc = tl.load(gc + o_t * H + i_h, mask=m_t, other=0)
        b_a = tl.load(p_a, mask=m_t[:, None], other=0)
    else:
        b_gc = tl.cumsum(tl.load(g + o_t * H + i_h, mask=m_t, other=0).to(tl.float32), 0)
        tl.store(gc + o_t * H + i_h, b_gc, mask=m_t)
        kk = tl.dot(b_k, tl.trans(b_k), input_precision=PREC)
        b_l = b_beta[:, None] * causal_decay(b_gc, o_i, 1) * kk
        # (I + L)^{-1} by forward substitution: row i = e_i - sum_{s<i} L_is row_s.
        b_a = (o_i[:, None] == o_i[None, :]).to(tl.float32)
        for i in range(1, BT):
            sel = o_i[:, None] == i
            row = tl.sum(tl.where(sel, b_l, 0.0), 0)
            b_a = tl.where(sel, b_a - tl.sum(row[:, None] * b_a, 0)[None, :], b_a)
        tl.store(p_a, b_a, mask=m_t[:, None])
    b_w = tl.dot(b_a, b_k * (b_beta * tl.exp(b_gc))[:, None], input_precision=PREC)
    store_rows(w, b_w, o_t, m_t, i_h, H, K, o_k)
    b_v = load_rows(v, o_t, m_t, i_h, H, V, o_v).to(tl.float32)
    b_u = tl.dot(b_a, b_v * b_beta[:, None], input_precision=PREC)
    store_rows(u, b_u, o_t, m_t, i_h, H, V, o_v)


@triton.autotune(configs=_configs((32, 64, 16), (2, 4, 8)), key=["H", "K", "V", "BT", "R"])
@triton.jit
def _state_fwd_kernel(k, w, u, gc, z, h, v_new, h0, ht, cu, chunk_offsets,
                      H, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
                      R: tl.constexpr, BV: tl.constexpr, USE_H0: tl.constexpr,
                      STORE_HT: tl.constexpr, PREC: tl.constexpr):
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    bos, eos = tl.load(cu + i_n).to(tl.int64), tl.load(cu + i_n + 1).to(tl.int64)
    c0, c1 = tl.load(chunk_offsets + i_n), tl.load(chunk_offsets + i_n + 1)
    o_i, o_k, o_v = tl.arange(0, BT), tl.arange(0, K), i_v * BV + tl.arange(0, BV)
    p_hv = o_k[:, None] * V + o_v[None, :]
    m_hv = o_v[None, :] < V
    b_h = tl.zeros([K, BV], dtype=tl.float32)
    if USE_H0:
        b_h += tl.load(h0 + i_nh * K * V + p_hv, mask=m_hv, other=0).to(tl.float32)
    for r in range(c0, c1):
        b_z = tl.load(z + r * H + i_h).to(tl.float32)
        b_sh = b_h
        t_r = bos + (r - c0) * (R * BT)
        for j in range(tl.minimum(R, tl.cdiv(eos - t_r, BT))):
            o_t = t_r + j * BT + o_i
            m_t = o_t < eos
            tl.store(h + ((r * R + j) * H + i_h).to(tl.int64) * K * V + p_hv,
                     b_h.to(h.dtype.element_ty), mask=m_hv)
            b_w = load_rows(w, o_t, m_t, i_h, H, K, o_k)
            b_vn = load_rows(u, o_t, m_t, i_h, H, V, o_v).to(tl.float32)
            b_vn -= tl.dot(b_w, b_h.to(b_w.dtype), input_precision=PREC)
            store_rows(v_new, b_vn, o_t, m_t, i_h, H, V, o_v)
            b_gc = tl.load(gc + o_t * H + i_h, mask=m_t, other=0)
            g_last = tl.load(gc + (tl.minimum(t_r + j * BT + BT, eos) - 1) * H + i_h)
            b_k = load_rows(k, o_t, m_t, i_h, H, K, o_k)
            b_kd = (b_k * tl.exp(g_last - b_gc)[:, None]).to(b_k.dtype)
            b_h = b_h * tl.exp(g_last) + tl.dot(tl.trans(b_kd), b_vn.to(b_k.dtype),
                                                  input_precision=PREC)
            b_sh *= tl.exp(g_last)
        b_h = b_z * b_h + (1.0 - b_z) * b_sh
    if STORE_HT:
        tl.store(ht + i_nh * K * V + p_hv, b_h, mask=m_hv)


@triton.autotune(configs=_configs((64,)), key=["K", "V", "BT"])
@triton.jit
def _output_kernel(q, k, v_new, gc, h, o, scale, cu, chunk_offsets, chunk_seq,
                   H, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
                   R: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr):
    i_v, i_s, i_h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
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


def wy_fwd(k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, cmap,
           bt: int, r: int, saved: tuple[torch.Tensor, torch.Tensor] | None = None,
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(gc, A, w, u)``; with ``saved = (gc, A)`` from the forward, only ``w, u`` are redone."""
    _, total, heads, d_k = k.shape
    d_v = v.shape[-1]
    gc, a = saved if saved is not None else (
        empty(1, total, heads, dtype=torch.float32, device=k.device),
        empty(1, total, heads, bt, dtype=torch.float32, device=k.device))
    w = empty(*k.shape, dtype=k.dtype, device=k.device)
    u = empty(*v.shape, dtype=k.dtype, device=k.device)
    grid = (cmap.chunk_seq.numel() * r, heads)
    _wy_kernel[grid](k, v, g, beta, gc, a, w, u, cmap.cu_seqlens, cmap.chunk_offsets,
                     cmap.chunk_seq, H=heads, K=d_k, V=d_v, BT=bt, R=r,
                     SAVED_A=saved is not None, PREC=dot_precision(k.dtype))
    return gc, a, w, u


def state_fwd(k: torch.Tensor, w: torch.Tensor, u: torch.Tensor, gc: torch.Tensor,
              z: torch.Tensor, h0: torch.Tensor | None, output_final_state: bool, cmap,
              bt: int, r: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(h, v_new, final_state)``: slot start states ``[slots, H, K, V]`` and the new values."""
    _, _, heads, d_k = k.shape
    d_v = u.shape[-1]
    n_seq = cmap.cu_seqlens.numel() - 1
    h = empty(cmap.chunk_seq.numel() * r, heads, d_k, d_v, dtype=k.dtype, device=k.device)
    v_new = empty(*u.shape, dtype=k.dtype, device=k.device)
    ht = (empty(n_seq, heads, d_k, d_v, dtype=torch.float32, device=k.device)
          if output_final_state else None)

    def grid(meta: dict) -> tuple[int, int]:
        return triton.cdiv(d_v, meta["BV"]), n_seq * heads
    _state_fwd_kernel[grid](k, w, u, gc, z, h, v_new, h0, ht, cmap.cu_seqlens,
                            cmap.chunk_offsets, H=heads, K=d_k, V=d_v, BT=bt, R=r,
                            USE_H0=h0 is not None, STORE_HT=output_final_state,
                            PREC=dot_precision(k.dtype))
    return h, v_new, ht


def output_fwd(q: torch.Tensor, k: torch.Tensor, v_new: torch.Tensor, gc: torch.Tensor,
               h: torch.Tensor, scale: float, out_dtype: torch.dtype, cmap, bt: int, r: int,
               ) -> torch.Tensor:
    """The output ``[1, T_total, H, V]``."""
    _, _, heads, d_k = q.shape
    d_v = v_new.shape[-1]
    o = empty(*v_new.shape, dtype=out_dtype, device=q.device)

    def grid(meta: dict) -> tuple[int, int, int]:
        return triton.cdiv(d_v, meta["BV"]), h.shape[0], heads
    _output_kernel[grid](q, k, v_new, gc, h, o, scale, cmap.cu_seqlens, cmap.chunk_offsets,
                         cmap.chunk_seq, H=heads, K=d_k, V=d_v, BT=bt, R=r,
                         PREC=dot_precision(q.dtype))
    return o
