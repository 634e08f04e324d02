"""The linear operators' gates in Triton: one launch forward and one backward (plus a sum
of the per-program partials of the two ``[H]`` parameters), where the PyTorch form takes
nine small launches forward, more backward, and upcasts every projection in memory.

Same contract as :func:`nats.kernels.reference.gates.linear_gates`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .utils import empty

SOFTPLUS_THRESHOLD = tl.constexpr(20.0)
"""Above it softplus is the identity, as in ``torch.nn.functional.softplus``."""


@triton.jit
def _log1p(x):
    # log(1 + x) to float32 accuracy for small x: the rounding of u = 1 + x cancels in
    # log(u) * x / (u - 1).
    u = 1.0 + x
    return tl.where(u == 1.0, x, tl.log(u) * (x / tl.where(u == 1.0, 1.0, u - 1.0)))


@triton.jit
def softplus(x):
    """Softplus as torch takes it (the identity past its threshold), for every gates kernel
    (the decode step's too)."""
    return tl.where(x > SOFTPLUS_THRESHOLD, x,
                    _log1p(tl.exp(tl.minimum(x, SOFTPLUS_THRESHOLD))))


@triton.jit
def _tile(n_rows, heads, BLOCK_ROWS: tl.constexpr, BLOCK_H: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    h = tl.arange(0, BLOCK_H)
    mask = (rows < n_rows)[:, None] & (h < heads)[None, :]
    return rows.to(tl.int64)[:, None] * heads + h[None, :], h, mask


@triton.jit
def _decay_inputs(a_ptr, a_log_ptr, dt_bias_ptr, dense, h, mask, heads):
    """``pre = a + dt_bias`` of the tile and each head's ``rate = exp(A_log)``."""
    pre = (tl.load(a_ptr + dense, mask=mask, other=0.0).to(tl.float32)
           + tl.load(dt_bias_ptr + h, mask=h < heads, other=0.0).to(tl.float32)[None, :])
    rate = tl.exp(tl.load(a_log_ptr + h, mask=h < heads, other=0.0).to(tl.float32))
    return pre, rate[None, :]


@triton.jit
def _gates_fwd(a_ptr, a_log_ptr, dt_bias_ptr, b_ptr, g_ptr, beta_ptr, n_rows, heads,
               DECAY: tl.constexpr, WRITE: tl.constexpr, BLOCK_ROWS: tl.constexpr,
               BLOCK_H: tl.constexpr):
    dense, h, mask = _tile(n_rows, heads, BLOCK_ROWS, BLOCK_H)
    if DECAY:
        pre, rate = _decay_inputs(a_ptr, a_log_ptr, dt_bias_ptr, dense, h, mask, heads)
        tl.store(g_ptr + dense, -rate * softplus(pre), mask=mask)
    if WRITE:
        b = tl.load(b_ptr + dense, mask=mask, other=0.0).to(tl.float32)
        tl.store(beta_ptr + dense, tl.sigmoid(b), mask=mask)


@triton.jit
def _gates_bwd(a_ptr, a_log_ptr, dt_bias_ptr, b_ptr, dg_ptr, dbeta_ptr, da_ptr, db_ptr,
               dparams_ptr, n_rows, heads, DECAY: tl.constexpr, WRITE: tl.constexpr,
               BLOCK_ROWS: tl.constexpr, BLOCK_H: tl.constexpr):
    # g = -e s with e = exp(A_log), s = softplus(pre), pre = a + dt_bias:
    # dpre = -e dg s'(pre) (s' = sigmoid, 1 past the threshold) is da and, summed over
    # rows, d(dt_bias); d(A_log) = sum of dg g. beta = sigmoid(b): db = dbeta beta (1 - beta).
    dense, h, mask = _tile(n_rows, heads, BLOCK_ROWS, BLOCK_H)
    if DECAY:
        pre, rate = _decay_inputs(a_ptr, a_log_ptr, dt_bias_ptr, dense, h, mask, heads)
        slope = tl.where(pre > SOFTPLUS_THRESHOLD, 1.0, tl.sigmoid(pre))
        dg = tl.load(dg_ptr + dense, mask=mask, other=0.0)
        dpre = -rate * dg * slope
        tl.store(da_ptr + dense, dpre.to(da_ptr.dtype.element_ty), mask=mask)
        part = dparams_ptr + tl.program_id(0) * 2 * heads + h
        tl.store(part, tl.sum(-rate * softplus(pre) * dg, axis=0), mask=h < heads)
        tl.store(part + heads, tl.sum(dpre, axis=0), mask=h < heads)
    if WRITE:
        beta = tl.sigmoid(tl.load(b_ptr + dense, mask=mask, other=0.0).to(tl.float32))
        dbeta = tl.load(dbeta_ptr + dense, mask=mask, other=0.0)
        tl.store(db_ptr + dense, (dbeta * beta * (1.0 - beta)).to(db_ptr.dtype.element_ty),
                 mask=mask)


def _launch_shape(heads: int) -> tuple[int, int]:
    block_h = triton.next_power_of_2(heads)
    return max(1, min(128, 4096 // block_h)), block_h


def _pointers(stand_in: torch.Tensor, present: bool, *tensors: torch.Tensor | None,
              ) -> tuple[torch.Tensor, ...]:
    """``tensors`` where their gate is ``present``, else ``stand_in`` for each (a pointer
    the kernel never reads: its gate's branch is compiled out)."""
    return tuple(t if present else stand_in for t in tensors)


class _LinearGates(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a: torch.Tensor | None, a_log: torch.Tensor | None,
                dt_bias: torch.Tensor | None, b: torch.Tensor | None):
        x = a if a is not None else b
        heads = x.shape[-1]
        a = None if a is None else a.contiguous()
        b = None if b is None else b.contiguous()
        n_rows = x.numel() // heads
        block_rows, block_h = _launch_shape(heads)
        f32 = dict(dtype=torch.float32, device=x.device)
        g = None if a is None else empty(*x.shape, **f32)
        beta = None if b is None else empty(*x.shape, **f32)
        decay, write = a is not None, b is not None
        _gates_fwd[(triton.cdiv(n_rows, block_rows),)](
            *_pointers(x, decay, a, a_log, dt_bias), *_pointers(x, write, b),
            *_pointers(x, decay, g), *_pointers(x, write, beta),
            n_rows, heads, DECAY=decay, WRITE=write, BLOCK_ROWS=block_rows, BLOCK_H=block_h)
        ctx.save_for_backward(a, a_log, dt_bias, b)
        return g, beta

    @staticmethod
    def backward(ctx, dg: torch.Tensor | None, dbeta: torch.Tensor | None):
        a, a_log, dt_bias, b = ctx.saved_tensors
        x = a if a is not None else b
        heads = x.shape[-1]
        n_rows = x.numel() // heads
        block_rows, block_h = _launch_shape(heads)
        programs = triton.cdiv(n_rows, block_rows)
        decay, write = a is not None, b is not None
        if decay and dg is None:
            dg = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        if write and dbeta is None:
            dbeta = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        da = None if not decay else empty(*a.shape, dtype=a.dtype, device=a.device)
        db = None if not write else empty(*b.shape, dtype=b.dtype, device=b.device)
        dparams = None if not decay else empty(programs, 2, heads, dtype=torch.float32,
                                               device=x.device)
        _gates_bwd[(programs,)](
            *_pointers(x, decay, a, a_log, dt_bias), *_pointers(x, write, b),
            *_pointers(x, decay, dg if dg is None else dg.contiguous()),
            *_pointers(x, write, dbeta if dbeta is None else dbeta.contiguous()),
            *_pointers(x, decay, da), *_pointers(x, write, db), *_pointers(x, decay, dparams),
            n_rows, heads, DECAY=decay, WRITE=write, BLOCK_ROWS=block_rows, BLOCK_H=block_h)
        if not decay:
            return None, None, None, db
        d_a_log, d_dt_bias = dparams.sum(0)
        return da, d_a_log.to(a_log.dtype), d_dt_bias.to(dt_bias.dtype), db


def linear_gates(a: torch.Tensor | None, a_log: torch.Tensor | None,
                 dt_bias: torch.Tensor | None, b: torch.Tensor | None,
                 ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """See :func:`nats.kernels.reference.gates.linear_gates`."""
    return _LinearGates.apply(a, a_log, dt_bias, b)
