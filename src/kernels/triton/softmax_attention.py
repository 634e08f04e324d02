"""Softmax side of NAtS-L as FlashAttention-2-style Triton kernels.

A query tile lies inside one routing chunk. It visits the keys of the softmax-routed
chunks before its own (through a compact per-head list of their indices, built on the
device) and then its own chunk causally, so the work follows the number of softmax
chunks instead of ``T^2``. The backward pass walks the same pattern from the key side:
a key of a softmax chunk is seen by its own chunk causally and by every later query of
its sequence, a contiguous range. Dense batches run as packed sequences (see
:class:`.utils.ChunkMap`), so one code path serves both layouts.

Scores run in base 2 (``exp2``); the log-sum-exp saved for the backward pass is in
base 2 as well. Accumulation is in float32 whatever the input dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from ..reference.chunks import ROUTE_GRADS, SOFTMAX, RouteGrad, check_chunk_size, check_routes
from .utils import autotune_configs, check_varlen, chunk_map, empty

LOG2E = 1.4426950408889634
HEAD_DIMS = (16, 32, 64, 128)
_ROUTE_GRAD_CODE = {None: 0, "selected": 1, "both": 2}


# Rows of one TMA block per descriptor argument: query-side tensors move in query tiles,
# key-side tensors in key blocks.
_DESCRIPTOR_ROWS = {"Q_DESC": "BLOCK_M", "DO_DESC": "BLOCK_M", "K_DESC": "BLOCK_N",
                    "V_DESC": "BLOCK_N"}


def _descriptor(x: torch.Tensor) -> TensorDescriptor:
    """Host TMA descriptor of a packed ``[T_total, heads, D]`` tensor; a block is rows of
    one head, as many as the launch config gives it (:func:`_set_block_rows`).

    Built on the host, it reaches the kernel as a launch parameter: descriptors built on
    the device cost every program a global write and a fence, which dominates when tiles
    see only their own chunk.
    """
    return TensorDescriptor(x, list(x.shape), list(x.stride()), [1, 1, x.shape[-1]])


def _set_block_rows(nargs: dict) -> None:
    """Config pre-hook: each descriptor's block rows from the config's tile sizes."""
    for name, rows in _DESCRIPTOR_ROWS.items():
        if name in nargs:
            nargs[name].block_shape = [nargs[rows], 1, nargs[name].shape[-1]]


def _configs(pairs: list[tuple[int, int, int, int]]) -> list[triton.Config]:
    """Configs from ``(BLOCK_M, BLOCK_N, num_warps, num_stages)``; one small one interpreted."""
    return autotune_configs(
        [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=w, num_stages=s,
                       pre_hook=_set_block_rows)
         for m, n, w, s in pairs],
        triton.Config({"BLOCK_M": 32, "BLOCK_N": 32}, pre_hook=_set_block_rows),
    )


# 4 warps won every kernel in the measured range (docs/BENCHMARKS.md); 8 warps only serve
# the 128 x 128 tile.
_FWD_CONFIGS = _configs([(64, 64, 4, 3), (128, 64, 4, 3), (64, 64, 4, 4), (128, 128, 8, 2)])
_BWD_CONFIGS = _configs([(64, 64, 4, 2), (64, 64, 4, 3), (128, 64, 4, 2), (128, 128, 8, 2)])
# Only 64-query tiles. Compiled by Triton 3.6 for Hopper, two pipelined loops gave a dk that
# changed with whatever else ran on the GPU (the linear branch on the side stream): 64-query
# tiles loaded through TMA (a few key chunks off by ~10 %) and 32-query tiles with 2 stages
# loaded by pointer (dk off by ~2e-3). 64-query tiles loaded by pointer were exact under the
# same load at 1-3 stages (tests/kernels/test_streams.py tries every config here), and 3
# stages the fastest at every measured shape (docs/BENCHMARKS.md); 1 stage fits any tile.
_DKDV_CONFIGS = _configs([(64, 64, 4, 1), (64, 64, 4, 2), (64, 64, 4, 3)])
_TUNE_KEY = ["C", "DK", "DV", "R"]


@triton.jit
def _locate_tile(pid, cu_seqlens, chunk_offsets, chunk_seq, C: tl.constexpr, TILE: tl.constexpr):
    """Tile ``pid``: its first chunk, that chunk's sequence, and the tile's first token.

    A tile no wider than a chunk is one of ``C // TILE`` per chunk. A wider one covers
    ``TILE // C`` chunks of one sequence and is owned by the program of its first chunk;
    the programs of the other chunks get ``start == eos`` and do nothing.
    """
    g = pid // (C // TILE if TILE <= C else 1)
    seq = tl.load(chunk_seq + g)
    bos = tl.load(cu_seqlens + seq)
    eos = tl.load(cu_seqlens + seq + 1)
    first_chunk = tl.load(chunk_offsets + seq)
    chunk_start = bos + (g - first_chunk) * C
    if TILE <= C:
        start = chunk_start + (pid % (C // TILE)) * TILE
    else:
        start = tl.where((g - first_chunk) % (TILE // C) == 0, chunk_start, eos)
    return g, first_chunk, bos, chunk_start, start, eos


@triton.jit
def _own_keys_visible(rows, cols, cols_ok, bos, first_chunk, before_h, H: tl.constexpr,
                      C: tl.constexpr, TM: tl.constexpr):
    """Which keys from a tile's own chunks each query sees: causal, and across chunks of a
    tile wider than a chunk only keys of softmax chunks (``before_h``: BEFORE at head h)."""
    visible = cols[None, :] <= rows[:, None]
    if TM > C:
        col_chunk = (cols - bos) // C
        g_col = first_chunk + col_chunk
        softmax = (tl.load(before_h + (g_col + 1) * H, mask=cols_ok, other=0)
                   > tl.load(before_h + g_col * H, mask=cols_ok, other=0))
        same = ((rows - bos) // C)[:, None] == col_chunk[None, :]
        visible = visible & (same | softmax[None, :])
    return visible


@triton.jit
def _load_rows(ptr, rows, mask, stride_t, D: tl.constexpr):
    """Rows ``[len(rows), D]`` of one head (``ptr`` already offset to the head)."""
    offs = rows.to(tl.int64)[:, None] * stride_t + tl.arange(0, D)[None, :]
    return tl.load(ptr + offs, mask=mask[:, None], other=0.0)


@triton.jit
def _load_block(desc, row, hq, ROWS: tl.constexpr, D: tl.constexpr):
    """``ROWS`` rows of head ``hq`` from ``row`` on, through TMA (zeros past the end)."""
    return desc.load([row, hq, 0]).reshape(ROWS, D)


@triton.jit
def _selected_kv(k_desc, v_desc, k_ptr, v_ptr, sel, n0, n_keys, first_chunk, bos, hq,
                 stride_kt, stride_vt, C: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                 BLOCK_N: tl.constexpr):
    """Key block ``n0`` of the sequence's earlier softmax chunks laid end to end: k, v and
    which keys exist.

    ``sel`` points at the sequence's first entry of the compact chunk list, ``n_keys`` is
    the number of keys listed. A block inside one chunk is one scalar lookup and two TMA
    loads (cheaper than gathering its rows); a block wider than a chunk
    gathers its rows chunk by chunk.
    """
    if BLOCK_N <= C:
        ch = tl.load(sel + n0 // C)
        tok = bos + (ch - first_chunk) * C + n0 % C
        k = _load_block(k_desc, tok, hq, BLOCK_N, DK)
        v = _load_block(v_desc, tok, hq, BLOCK_N, DV)
        ok = tl.full([BLOCK_N], 1, tl.int1)
    else:
        n = n0 + tl.arange(0, BLOCK_N)
        ok = n < n_keys
        ch = tl.load(sel + n // C, mask=ok, other=first_chunk)
        cols = bos + (ch - first_chunk) * C + n % C
        k = _load_rows(k_ptr, cols, ok, stride_kt, DK)
        v = _load_rows(v_ptr, cols, ok, stride_vt, DV)
    return k, v, ok


@triton.jit
def _fwd_block(q, k, v, visible, m_i, l_i, acc, qk_scale, MASKED: tl.constexpr):
    """One online-softmax step of a query tile over a key block.

    ``visible`` applies only if MASKED: full blocks of visible keys skip the select.
    """
    s = tl.dot(q, tl.trans(k)) * qk_scale
    if MASKED:
        s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # A masked row may see no key yet (a tile wider than a chunk, whose first key block
    # holds only linear-routed chunks): its max is still -inf, and exp2(-inf - -inf) is NaN.
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new) if MASKED else m_new
    p = tl.exp2(s - m_ref[:, None])
    alpha = tl.exp2(m_i - m_ref)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc


@triton.autotune(configs=_FWD_CONFIGS, key=_TUNE_KEY)
@triton.jit
def _attn_fwd(Q, K, V, K_DESC, V_DESC, OUT, LSE, SEL, BEFORE, CU_SEQLENS, CHUNK_OFFSETS,
              CHUNK_SEQ, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
              stride_ot, stride_oh, qk_scale, n_chunks, total_len,
              H: tl.constexpr, R: tl.constexpr, C: tl.constexpr,
              DK: tl.constexpr, DV: tl.constexpr, BLOCK_M: tl.constexpr,
              BLOCK_N: tl.constexpr):
    TM: tl.constexpr = BLOCK_M
    # Selected keys come in whole chunks: only a block wider than a chunk can run past them.
    PARTIAL: tl.constexpr = BLOCK_N > C
    hq = tl.program_id(1)
    h = hq // R
    # Late tiles have the most keys: start them first.
    pid = tl.num_programs(0) - 1 - tl.program_id(0)
    g, first_chunk, bos, chunk_start, start, eos = _locate_tile(
        pid, CU_SEQLENS, CHUNK_OFFSETS, CHUNK_SEQ, C, TM)
    if start >= eos:
        return
    rows = start + tl.arange(0, TM)
    row_ok = rows < eos
    q = _load_rows(Q + hq * stride_qh, rows, row_ok, stride_qt, DK)
    k_ptr = K + hq * stride_kh
    v_ptr = V + hq * stride_vh
    m_i = tl.full([TM], float("-inf"), tl.float32)
    l_i = tl.zeros([TM], tl.float32)
    acc = tl.zeros([TM, DV], tl.float32)

    # Earlier softmax chunks of this sequence, gathered through the compact list.
    listed = tl.load(BEFORE + first_chunk * H + h)
    n_keys = (tl.load(BEFORE + g * H + h) - listed) * C
    sel = SEL + h * n_chunks + listed
    for n0 in range(0, n_keys, BLOCK_N):
        k, v, ok = _selected_kv(K_DESC, V_DESC, k_ptr, v_ptr, sel, n0, n_keys, first_chunk,
                                bos, hq, stride_kt, stride_vt, C, DK, DV, BLOCK_N)
        m_i, l_i, acc = _fwd_block(q, k, v, ok[None, :], m_i, l_i, acc, qk_scale, PARTIAL)
    # The own chunk, causally.
    end = tl.minimum(start + TM, eos)
    for k0 in range(chunk_start, end, BLOCK_N):
        cols = k0 + tl.arange(0, BLOCK_N)
        visible = _own_keys_visible(rows, cols, cols < end, bos, first_chunk, BEFORE + h, H, C,
                                    TM)
        k = _load_rows(k_ptr, cols, cols < end, stride_kt, DK)
        v = _load_rows(v_ptr, cols, cols < end, stride_vt, DV)
        m_i, l_i, acc = _fwd_block(q, k, v, visible, m_i, l_i, acc, qk_scale, True)

    o = acc / l_i[:, None]
    o_offs = rows.to(tl.int64)[:, None] * stride_ot + tl.arange(0, DV)[None, :]
    tl.store(OUT + hq * stride_oh + o_offs, o.to(OUT.dtype.element_ty), mask=row_ok[:, None])
    tl.store(LSE + hq * total_len + rows, m_i + tl.log2(l_i), mask=row_ok)


@triton.jit
def _bwd_preprocess(OUT, DO, DELTA, stride_ot, stride_oh, stride_dot, stride_doh, total_len,
                    DV: tl.constexpr, BLOCK: tl.constexpr):
    """``delta_i = dO_i . O_i``, the row term of the softmax backward pass."""
    hq = tl.program_id(1)
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = rows < total_len
    o = _load_rows(OUT + hq * stride_oh, rows, ok, stride_ot, DV).to(tl.float32)
    do = _load_rows(DO + hq * stride_doh, rows, ok, stride_dot, DV).to(tl.float32)
    tl.store(DELTA + hq * total_len + rows, tl.sum(o * do, 1), mask=ok)


@triton.jit
def _bwd_kv_block(k, v, dk, dv, dz, q_ptr, do_ptr, stride_qt, stride_dot, lse_ptr, delta_ptr,
                  rows, row_ok, visible, qk_scale, DK: tl.constexpr, DV: tl.constexpr,
                  ACC_KV: tl.constexpr, ACC_Z: tl.constexpr):
    """Gradients of a key tile from the query block ``rows = q0 + arange`` (``row_ok``:
    the rows it may read; ``visible`` masks the scores). q and do are loaded by pointer,
    not through TMA, so that the loop is pipelined without the miscompile the configs'
    comment describes.

    Scores are laid out queries by keys, as in the forward pass, and ``dz`` collects the
    score gradients elementwise, summed over queries once after the loop: keys along rows
    would need a row sum every step, which measured slower.
    """
    q = _load_rows(q_ptr, rows, row_ok, stride_qt, DK)
    do = _load_rows(do_ptr, rows, row_ok, stride_dot, DV)
    lse = tl.load(lse_ptr + rows, mask=row_ok, other=0.0)
    delta = tl.load(delta_ptr + rows, mask=row_ok, other=0.0)
    p = tl.where(visible, tl.exp2(tl.dot(q, tl.trans(k)) * qk_scale - lse[:, None]), 0.0)
    ds = p * (tl.dot(do, tl.trans(v)) - delta[:, None])
    if ACC_KV:
        dv += tl.dot(tl.trans(p.to(do.dtype)), do)
        dk += tl.dot(tl.trans(ds.to(q.dtype)), q)
    if ACC_Z:
        dz += ds
    return dk, dv, dz


# Tuning runs every config into the same DZ, and a config with whole-chunk key tiles
# writes one slot of a chunk where one with half-chunk tiles wrote two: zeroed per run.
@triton.autotune(configs=_DKDV_CONFIGS, key=[*_TUNE_KEY, "ROUTE_GRAD"], reset_to_zero=["DZ"])
@triton.jit
def _attn_bwd_dkdv(K, V, Q, DO, DK_, DV_, DZ, LSE, DELTA, BEFORE, CU_SEQLENS,
                   CHUNK_OFFSETS, CHUNK_SEQ, stride_qt, stride_qh, stride_dot, stride_doh,
                   stride_kt, stride_kh, stride_vt,
                   stride_vh, stride_dkt, stride_dkh, stride_dvt,
                   stride_dvh, stride_zh, qk_scale, sm_scale, total_len,
                   H: tl.constexpr, R: tl.constexpr, C: tl.constexpr,
                   DK: tl.constexpr, DV: tl.constexpr, ROUTE_GRAD: tl.constexpr,
                   DZ_SLOTS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """dk, dv of a key tile, and its share of the route gradient: the score gradients of
    its keys summed over later chunks, in slot ``tile % (C // TN)`` of its chunk's
    ``DZ_SLOTS`` (``DZ`` is ``[heads, chunks, DZ_SLOTS]``, zeroed)."""
    TN: tl.constexpr = BLOCK_N if BLOCK_N < C else C
    hq = tl.program_id(1)
    h = hq // R
    g, _, _, chunk_start, start, eos = _locate_tile(
        tl.program_id(0), CU_SEQLENS, CHUNK_OFFSETS, CHUNK_SEQ, C, TN)
    if start >= eos:
        return
    cols = start + tl.arange(0, TN)
    col_ok = cols < eos
    k = _load_rows(K + hq * stride_kh, cols, col_ok, stride_kt, DK)
    v = _load_rows(V + hq * stride_vh, cols, col_ok, stride_vt, DV)
    dk = tl.zeros([TN, DK], tl.float32)
    dv = tl.zeros([TN, DV], tl.float32)
    dz = tl.zeros([BLOCK_M, TN], tl.float32)
    lse_ptr = LSE + hq * total_len
    delta_ptr = DELTA + hq * total_len
    q_ptr = Q + hq * stride_qh
    do_ptr = DO + hq * stride_doh
    # The own chunk, causally: its weight is always 1, so no route gradient.
    chunk_end = tl.minimum(chunk_start + C, eos)
    for q0 in range(start, chunk_end, BLOCK_M):
        rows = q0 + tl.arange(0, BLOCK_M)
        row_ok = rows < chunk_end
        visible = (rows[:, None] >= cols[None, :]) & row_ok[:, None]
        dk, dv, dz = _bwd_kv_block(k, v, dk, dv, dz, q_ptr, do_ptr, stride_qt, stride_dot,
                                   lse_ptr, delta_ptr, rows, row_ok, visible, qk_scale, DK, DV,
                                   True, False)
    # Every later query of the sequence sees a softmax chunk: a contiguous range.
    is_softmax = tl.load(BEFORE + (g + 1) * H + h) > tl.load(BEFORE + g * H + h)
    if is_softmax:
        for q0 in range(chunk_end, eos, BLOCK_M):
            rows = q0 + tl.arange(0, BLOCK_M)
            row_ok = rows < eos
            dk, dv, dz = _bwd_kv_block(k, v, dk, dv, dz, q_ptr, do_ptr, stride_qt,
                                       stride_dot, lse_ptr, delta_ptr, rows, row_ok,
                                       row_ok[:, None], qk_scale, DK, DV, True, ROUTE_GRAD > 0)
    elif ROUTE_GRAD == 2:
        # A linear chunk's keys enter only the "both" route gradient, as if weighted 1.
        for q0 in range(chunk_end, eos, BLOCK_M):
            rows = q0 + tl.arange(0, BLOCK_M)
            row_ok = rows < eos
            dk, dv, dz = _bwd_kv_block(k, v, dk, dv, dz, q_ptr, do_ptr, stride_qt,
                                       stride_dot, lse_ptr, delta_ptr, rows, row_ok,
                                       row_ok[:, None], qk_scale, DK, DV, False, True)
    dk_offs = cols.to(tl.int64)[:, None] * stride_dkt + tl.arange(0, DK)[None, :]
    dv_offs = cols.to(tl.int64)[:, None] * stride_dvt + tl.arange(0, DV)[None, :]
    tl.store(DK_ + hq * stride_dkh + dk_offs, (dk * sm_scale).to(DK_.dtype.element_ty),
             mask=col_ok[:, None])
    tl.store(DV_ + hq * stride_dvh + dv_offs, dv.to(DV_.dtype.element_ty), mask=col_ok[:, None])
    if ROUTE_GRAD > 0:
        # (A tile with keys past the sequence's end is in its last chunk: no later queries,
        # so nothing was added for them.)
        tile_dz = tl.sum(tl.sum(dz, 1), 0)
        tl.store(DZ + hq * stride_zh + g * DZ_SLOTS + tl.program_id(0) % (C // TN), tile_dz)


@triton.jit
def _dq_block(q, do, lse, delta, dq, k, v, visible, qk_scale, MASKED: tl.constexpr):
    """dq of a query tile from one key block (``visible`` as in :func:`_fwd_block`)."""
    p = tl.exp2(tl.dot(q, tl.trans(k)) * qk_scale - lse[:, None])
    if MASKED:
        p = tl.where(visible, p, 0.0)
    ds = p * (tl.dot(do, tl.trans(v)) - delta[:, None])
    return dq + tl.dot(ds.to(k.dtype), k)


@triton.autotune(configs=_BWD_CONFIGS, key=_TUNE_KEY)
@triton.jit
def _attn_bwd_dq(K, V, Q_DESC, K_DESC, V_DESC, DO_DESC, DQ, LSE, DELTA, SEL, BEFORE,
                 CU_SEQLENS, CHUNK_OFFSETS, CHUNK_SEQ, stride_kt, stride_kh, stride_vt,
                 stride_vh, stride_dqt, stride_dqh, qk_scale, sm_scale, n_chunks,
                 total_len, H: tl.constexpr, R: tl.constexpr,
                 C: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr):
    """dq of a query tile over the keys the forward pass visited."""
    TM: tl.constexpr = BLOCK_M
    # Selected keys come in whole chunks: only a block wider than a chunk can run past them.
    PARTIAL: tl.constexpr = BLOCK_N > C
    hq = tl.program_id(1)
    h = hq // R
    pid = tl.num_programs(0) - 1 - tl.program_id(0)
    g, first_chunk, bos, chunk_start, start, eos = _locate_tile(
        pid, CU_SEQLENS, CHUNK_OFFSETS, CHUNK_SEQ, C, TM)
    if start >= eos:
        return
    rows = start + tl.arange(0, TM)
    row_ok = rows < eos
    # Rows past the sequence's end hold other tokens: computed, never stored.
    q = _load_block(Q_DESC, start, hq, TM, DK)
    do = _load_block(DO_DESC, start, hq, TM, DV)
    lse = tl.load(LSE + hq * total_len + rows, mask=row_ok, other=0.0)
    delta = tl.load(DELTA + hq * total_len + rows, mask=row_ok, other=0.0)
    k_ptr = K + hq * stride_kh
    v_ptr = V + hq * stride_vh
    dq = tl.zeros([TM, DK], tl.float32)

    listed = tl.load(BEFORE + first_chunk * H + h)
    n_keys = (tl.load(BEFORE + g * H + h) - listed) * C
    sel = SEL + h * n_chunks + listed
    for n0 in range(0, n_keys, BLOCK_N):
        k, v, ok = _selected_kv(K_DESC, V_DESC, k_ptr, v_ptr, sel, n0, n_keys, first_chunk,
                                bos, hq, stride_kt, stride_vt, C, DK, DV, BLOCK_N)
        dq = _dq_block(q, do, lse, delta, dq, k, v, ok[None, :], qk_scale, PARTIAL)
    end = tl.minimum(start + TM, eos)
    for k0 in range(chunk_start, end, BLOCK_N):
        cols = k0 + tl.arange(0, BLOCK_N)
        visible = _own_keys_visible(rows, cols, cols < end, bos, first_chunk, BEFORE + h, H, C,
                                    TM)
        k = _load_rows(k_ptr, cols, cols < end, stride_kt, DK)
        v = _load_rows(v_ptr, cols, cols < end, stride_vt, DV)
        dq = _dq_block(q, do, lse, delta, dq, k, v, visible & row_ok[:, None], qk_scale, True)
    dq_offs = rows.to(tl.int64)[:, None] * stride_dqt + tl.arange(0, DK)[None, :]
    tl.store(DQ + hq * stride_dqh + dq_offs, (dq * sm_scale).to(DQ.dtype.element_ty),
             mask=row_ok[:, None])


@triton.jit
def _chunk_list_kernel(ROUTES, SEL, BEFORE, n_chunks, stride_n, stride_h, H: tl.constexpr,
                       BLOCK: tl.constexpr):
    """Head ``h``'s softmax chunks in order (row ``h`` of SEL) and its running count of them
    before every chunk (column ``h`` of BEFORE), from ``routes[..., SOFTMAX]`` directly."""
    h = tl.program_id(0)
    tl.store(BEFORE + h, 0)
    count = tl.sum(tl.zeros([BLOCK], tl.int32), 0)
    for n0 in range(0, n_chunks, BLOCK):
        idx = n0 + tl.arange(0, BLOCK)
        ok = idx < n_chunks
        route = tl.load(ROUTES + idx.to(tl.int64) * stride_n + h * stride_h, mask=ok, other=0.0)
        is_sm = (route > 0.5) & ok
        running = count + tl.cumsum(is_sm.to(tl.int32), 0)
        tl.store(BEFORE + (idx + 1) * H + h, running, mask=ok)
        tl.store(SEL + h * n_chunks + running - 1, idx, mask=is_sm)
        count += tl.sum(is_sm.to(tl.int32), 0)


def softmax_chunk_list(routes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Compact list of softmax chunks per head, and how many come before each chunk.

    ``routes`` ``[..., N, H, 2]`` (global chunk order). Returns ``sel`` ``[H, N]`` whose
    first entries per head are its softmax chunks in order (the rest is never read) and
    ``before`` ``[N+1, H]`` (exclusive running count), int32, in one launch and without a
    host synchronisation: short sequences must not pay a chain of small PyTorch ops.
    """
    heads = routes.shape[-2]
    is_sm = routes.detach().reshape(-1, heads, 2)[..., SOFTMAX]
    n = is_sm.shape[0]
    sel = torch.empty(heads, n, dtype=torch.int32, device=routes.device)
    before = torch.empty(n + 1, heads, dtype=torch.int32, device=routes.device)
    _chunk_list_kernel[(heads,)](is_sm, sel, before, n, *is_sm.stride(), H=heads,
                                 BLOCK=min(1024, triton.next_power_of_2(n)))
    return sel, before


def _packed(x: torch.Tensor) -> torch.Tensor:
    """``[B, T, heads, D]`` as ``[B*T, heads, D]`` with unit stride on D, and the 16-byte
    aligned start and row strides TMA descriptors need (a copy only where they lack it)."""
    x = x.reshape(-1, *x.shape[2:])
    aligned = x.data_ptr() % 16 == 0 and all(s * x.element_size() % 16 == 0
                                              for s in x.stride()[:2])
    return x if x.stride(-1) == 1 and aligned else x.contiguous()


def _dz_slots(chunk_size: int) -> int:
    """Route-gradient slots per chunk in the dk/dv kernel's ``DZ``: one per key tile, and
    key tiles are at least 16 wide."""
    return max(chunk_size // 16, 1)


def _grid(block: str, n_chunks: int, chunk_size: int, heads_sm: int):
    """Launch grid: per head, one program per tile of ``block`` tokens, or per chunk where
    tiles are wider than a chunk (see :func:`_locate_tile`)."""
    def grid(meta: dict) -> tuple[int, int]:
        return n_chunks * max(chunk_size // meta[block], 1), heads_sm
    return grid


class _HybridSoftmaxAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, routes: torch.Tensor,
                chunk_size: int, scale: float, route_grad: RouteGrad,
                cu_seqlens: torch.Tensor | None) -> torch.Tensor:
        batch, seq_len, heads_sm, d_k = q.shape
        d_v = v.shape[-1]
        total_len = batch * seq_len
        sel, before = softmax_chunk_list(routes)
        heads, n_chunks = sel.shape
        cmap = chunk_map(batch, seq_len, n_chunks, chunk_size, q.device, cu_seqlens)
        q2, k2, v2 = _packed(q), _packed(k), _packed(v)
        o = empty(total_len, heads_sm, d_v, dtype=v.dtype, device=v.device)
        lse = empty(heads_sm, total_len, dtype=torch.float32, device=q.device)
        _attn_fwd[_grid("BLOCK_M", n_chunks, chunk_size, heads_sm)](
            q2, k2, v2, _descriptor(k2), _descriptor(v2), o, lse, sel, before, *cmap,
            *q2.stride()[:2], *k2.stride()[:2], *v2.stride()[:2], *o.stride()[:2],
            scale * LOG2E, n_chunks, total_len,
            H=heads, R=heads_sm // heads, C=chunk_size, DK=d_k, DV=d_v)
        ctx.save_for_backward(q2, k2, v2, o, lse, sel, before, *cmap)
        ctx.meta = (q.shape, v.shape, routes.shape, routes.dtype, chunk_size, scale, route_grad)
        return o.view(batch, seq_len, heads_sm, d_v)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        q, k, v, o, lse, sel, before, *cmap = ctx.saved_tensors
        q_shape, v_shape, routes_shape, routes_dtype, chunk_size, scale, route_grad = ctx.meta
        total_len, heads_sm, d_k = q.shape
        d_v = v.shape[-1]
        n_chunks, heads = before.shape[0] - 1, before.shape[1]
        do = _packed(grad_out)
        dev = q.device
        code = _ROUTE_GRAD_CODE[route_grad if ctx.needs_input_grad[3] else None]
        delta = empty(heads_sm, total_len, dtype=torch.float32, device=dev)
        dq = empty(total_len, heads_sm, d_k, dtype=q.dtype, device=dev)
        dk = empty(total_len, heads_sm, d_k, dtype=k.dtype, device=dev)
        dv = empty(total_len, heads_sm, d_v, dtype=v.dtype, device=dev)
        slots = _dz_slots(chunk_size)
        # Zeroed, as tiles past a sequence's end and unused slots are never written; without
        # a route gradient a stand-in the kernel never reads.
        dz = (torch.zeros(heads_sm, n_chunks, slots, dtype=torch.float32, device=dev) if code
              else torch.empty(1, dtype=torch.float32, device=dev))
        block = 64
        _bwd_preprocess[(triton.cdiv(total_len, block), heads_sm)](
            o, do, delta, *o.stride()[:2], *do.stride()[:2], total_len, DV=d_v, BLOCK=block)
        shapes = dict(H=heads, R=heads_sm // heads, C=chunk_size, DK=d_k, DV=d_v)
        q_desc, do_desc = _descriptor(q), _descriptor(do)
        _attn_bwd_dkdv[_grid("BLOCK_N", n_chunks, chunk_size, heads_sm)](
            k, v, q, do, dk, dv, dz, lse, delta, before, *cmap, *q.stride()[:2],
            *do.stride()[:2], *k.stride()[:2], *v.stride()[:2], *dk.stride()[:2],
            *dv.stride()[:2], dz.stride(0),
            scale * LOG2E, scale, total_len, ROUTE_GRAD=code, DZ_SLOTS=slots, **shapes)
        _attn_bwd_dq[_grid("BLOCK_M", n_chunks, chunk_size, heads_sm)](
            k, v, q_desc, _descriptor(k), _descriptor(v), do_desc, dq, lse, delta, sel, before,
            *cmap, *k.stride()[:2], *v.stride()[:2], *dq.stride()[:2], scale * LOG2E, scale,
            n_chunks, total_len, **shapes)
        d_routes = None
        if code:
            per_head = dz.view(heads, heads_sm // heads, n_chunks, slots).sum((1, 3))
            d_routes = torch.zeros(n_chunks, heads, 2, dtype=routes_dtype, device=dev)
            d_routes[..., SOFTMAX] = per_head.t()
            d_routes = d_routes.view(routes_shape)
        return (dq.view(q_shape), dk.view(q_shape), dv.view(v_shape), d_routes,
                None, None, None, None)


def hybrid_softmax_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                             routes: torch.Tensor, chunk_size: int, scale: float | None = None,
                             *, route_grad: RouteGrad = "selected",
                             cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
    """Softmax branch of NAtS-L; same contract as the reference of the same name.

    q, k ``[B, T, H*r, Dk]``, v ``[B, T, H*r, Dv]``, routes ``[B, N, H, 2]`` one-hot
    (index 0 = softmax). With ``cu_seqlens`` (int32 ``[n_seq+1]``), B is 1, the sequences
    are packed along T and routes is ``[1, N_total, H, 2]`` with each sequence's chunks
    in order. Only ``routes[..., 0]`` receives a gradient.
    """
    if q.dim() != 4 or q.shape != k.shape or v.dim() != 4 or v.shape[:3] != q.shape[:3]:
        raise ValueError(f"need q, k [B, T, heads, Dk] and v [B, T, heads, Dv]; got "
                         f"{list(q.shape)}, {list(k.shape)}, {list(v.shape)}")
    if not q.dtype == k.dtype == v.dtype or q.dtype not in (torch.float32, torch.float16,
                                                             torch.bfloat16):
        raise ValueError(f"q, k, v must share one of float32/float16/bfloat16, got "
                         f"{q.dtype}, {k.dtype}, {v.dtype}")
    for name, dim in (("Dk", q.shape[-1]), ("Dv", v.shape[-1])):
        if dim not in HEAD_DIMS:
            raise ValueError(f"{name} must be one of {HEAD_DIMS} for the Triton kernel, got {dim}")
    if route_grad not in ROUTE_GRADS:
        raise ValueError(f"route_grad must be one of {ROUTE_GRADS}, got {route_grad!r}")
    check_chunk_size(chunk_size)
    batch, seq_len, heads_sm, d_k = q.shape
    if cu_seqlens is None:
        heads = check_routes(routes, batch, seq_len, chunk_size)
    else:
        if routes.dim() != 4 or routes.shape[0] != 1 or routes.shape[3] != 2:
            raise ValueError(f"routes must be [1, N_total, H, 2] with cu_seqlens, got "
                             f"{list(routes.shape)}")
        check_varlen(cu_seqlens, batch, seq_len, routes.shape[1], chunk_size)
        heads = routes.shape[2]
    if heads_sm % heads:
        raise ValueError(f"q has {heads_sm} heads, not a multiple of the {heads} routing heads")
    scale = d_k**-0.5 if scale is None else scale
    return _HybridSoftmaxAttention.apply(q, k, v, routes, chunk_size, scale, route_grad,
                                         cu_seqlens)
