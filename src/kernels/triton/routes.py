"""A layer's routes from its scorer's logits in Triton: one launch forward and one backward,
where the PyTorch form (the budget's scores, the softmax, the straight-through sample, the
softmax fraction and the routable share) dispatches about 30 operations forward and 20
backward in every NAtS-L layer of a training step (23 and 15 with forced routes).

Same contract as :func:`nats.kernels.reference.routes.chunk_routes`. One program walks
every chunk of the batch (a few thousand at most) in a fixed order: its sums over chunks
need no second launch and no atomics. The float64 pending sums and the statistics are
taken in blocks of chunks, so they may differ from the reference's in the last bits.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..reference.routes import ChunkRoutes, RouteBudget
from .utils import empty

CHUNKS_PER_BLOCK = 4096
"""Elements (chunks x heads) a program holds at once."""


@triton.jit
def _scores(logits_ptr, off, mask, mean, inv_std, bias, BUDGET: tl.constexpr):
    """The two logits of a tile (the budget's ``[z + bias, 0]`` under ``BUDGET``) and,
    for the pending sums, the logit difference."""
    l0 = tl.load(logits_ptr + off, mask=mask, other=0.0).to(tl.float32)
    l1 = tl.load(logits_ptr + off + 1, mask=mask, other=0.0).to(tl.float32)
    if BUDGET:
        d = l0 - l1
        return (d - mean) * inv_std + bias, tl.zeros_like(d), d
    return l0, l1, l0 - l1


@triton.jit
def _softmax2(a0, a1):
    top = tl.maximum(a0, a1)
    e0 = tl.exp(a0 - top)
    e1 = tl.exp(a1 - top)
    return e0 / (e0 + e1), e1 / (e0 + e1)


@triton.jit
def _tile(r0, rows, n_chunks, heads, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr):
    """Rows ``b * N + n`` of a block, the heads, the mask, whether each row is routable
    and the offset of each (row, head)'s first logit."""
    r = r0 + tl.arange(0, BLOCK_R)
    h = tl.arange(0, BLOCK_H)
    mask = (r < rows)[:, None] & (h < heads)[None, :]
    routable = mask & ((r % n_chunks) < n_chunks - 1)[:, None]
    off = (r.to(tl.int64)[:, None] * heads + h[None, :]) * 2
    return r, h, mask, routable, off


@triton.jit
def _budget_state(bias_ptr, mean_ptr, var_ptr, heads, eps, BUDGET: tl.constexpr,
                  BLOCK_H: tl.constexpr):
    h = tl.arange(0, BLOCK_H)
    hm = h < heads
    if BUDGET:
        bias = tl.load(bias_ptr + h, mask=hm, other=0.0).to(tl.float32)
        mean = tl.load(mean_ptr + h, mask=hm, other=0.0).to(tl.float32)
        inv_std = tl.rsqrt(tl.load(var_ptr + h, mask=hm, other=1.0).to(tl.float32) + eps)
    else:
        bias = tl.zeros([BLOCK_H], tl.float32)
        mean = bias
        inv_std = bias
    return bias[None, :], mean[None, :], inv_std[None, :]


@triton.jit
def _routes_fwd(logits_ptr, bias_ptr, mean_ptr, var_ptr, pending_ptr, forced_ptr, noise_ptr,
                routes_ptr, probs_ptr, soft_ptr, reg_ptr, attn_ptr, routable_ptr,
                rows, n_chunks, heads, seq_len, chunk_size, eps, tau,
                f_sb, f_sn, f_sh, f_sk,
                BUDGET: tl.constexpr, ACCUMULATE: tl.constexpr, FORCED: tl.constexpr,
                NOISE: tl.constexpr, TEMPERED: tl.constexpr, BLOCK_R: tl.constexpr,
                BLOCK_H: tl.constexpr):
    bias, mean, inv_std = _budget_state(bias_ptr, mean_ptr, var_ptr, heads, eps, BUDGET,
                                        BLOCK_H)
    total = tl.zeros([BLOCK_H], tl.float64)
    squares = tl.zeros([BLOCK_H], tl.float64)
    sm_tokens = tl.zeros([BLOCK_H], tl.float64)
    sm_routable = tl.zeros([BLOCK_H], tl.float64)
    p_routable = tl.zeros([BLOCK_H], tl.float64)
    for r0 in range(0, rows, BLOCK_R):
        r, h, mask, routable, off = _tile(r0, rows, n_chunks, heads, BLOCK_R, BLOCK_H)
        a0, a1, d = _scores(logits_ptr, off, mask, mean, inv_std, bias, BUDGET)
        if ACCUMULATE:
            dd = tl.where(routable, d, 0.0).to(tl.float64)
            total += tl.sum(dd, 0)
            squares += tl.sum(dd * dd, 0)
        p0, p1 = _softmax2(a0, a1)
        tl.store(probs_ptr + off, p0.to(probs_ptr.dtype.element_ty), mask=mask)
        tl.store(probs_ptr + off + 1, p1.to(probs_ptr.dtype.element_ty), mask=mask)
        if FORCED:
            n = r % n_chunks
            f_off = ((r // n_chunks).to(tl.int64) * f_sb + n * f_sn)[:, None] + h[None, :] * f_sh
            is_sm = tl.load(forced_ptr + f_off, mask=mask, other=0.0) > 0.5
        else:
            if NOISE:
                n0 = a0 + tl.load(noise_ptr + off, mask=mask, other=0.0).to(tl.float32)
                n1 = a1 + tl.load(noise_ptr + off + 1, mask=mask, other=0.0).to(tl.float32)
                if TEMPERED:
                    q0, q1 = _softmax2(n0 / tau, n1 / tau)
                    tl.store(soft_ptr + off, q0, mask=mask)
                    tl.store(soft_ptr + off + 1, q1, mask=mask)
                    is_sm = q0 >= q1
                else:
                    is_sm = n0 >= n1
            else:
                is_sm = p0 >= p1
            hard = is_sm.to(tl.float32)
            tl.store(routes_ptr + off, hard.to(routes_ptr.dtype.element_ty), mask=mask)
            tl.store(routes_ptr + off + 1, (1.0 - hard).to(routes_ptr.dtype.element_ty),
                     mask=mask)
        tokens = tl.minimum(chunk_size, seq_len - (r % n_chunks) * chunk_size)
        sm = (is_sm & mask).to(tl.float64)
        sm_tokens += tl.sum(sm * tokens.to(tl.float64)[:, None], 0)
        sm_routable += tl.sum(tl.where(routable, sm, 0.0), 0)
        p_routable += tl.sum(tl.where(routable, p0, 0.0).to(tl.float64), 0)
    h = tl.arange(0, BLOCK_H)
    hm = h < heads
    routable_rows = (rows // n_chunks) * (n_chunks - 1)
    if ACCUMULATE:
        tl.store(pending_ptr + 1 + h, tl.load(pending_ptr + 1 + h, mask=hm) + total, mask=hm)
        tl.store(pending_ptr + 1 + heads + h, tl.load(pending_ptr + 1 + heads + h, mask=hm)
                 + squares, mask=hm)
        tl.store(pending_ptr, tl.load(pending_ptr) + routable_rows)
    tl.store(attn_ptr + h, (sm_tokens / ((rows // n_chunks) * seq_len)).to(tl.float32),
             mask=hm)
    # 0 / 0 is NaN, as the mean of no chunks is; the cost term of no chunks is 0.
    tl.store(routable_ptr, (tl.sum(sm_routable, 0) / (routable_rows * heads)).to(tl.float32))
    reg = tl.sum(p_routable, 0) / tl.maximum(routable_rows * heads, 1)
    tl.store(reg_ptr, reg.to(reg_ptr.dtype.element_ty))


@triton.jit
def _logit_grad(probs_ptr, soft_ptr, droutes_ptr, dprobs_ptr, off, mask, routable, dreg,
                tau, inv_std, BUDGET: tl.constexpr, ROUTE_GRAD: tl.constexpr,
                TEMPERED: tl.constexpr, PROBS_GRAD: tl.constexpr, REG_GRAD: tl.constexpr):
    """The gradient of a tile's two scores (the budget's ``z`` alone under ``BUDGET``,
    times the scale ``inv_std``: the difference's gradient before centring)."""
    p0 = tl.load(probs_ptr + off, mask=mask, other=0.0).to(tl.float32)
    p1 = tl.load(probs_ptr + off + 1, mask=mask, other=0.0).to(tl.float32)
    dp0 = tl.zeros_like(p0)
    dp1 = tl.zeros_like(p0)
    if PROBS_GRAD:
        dp0 += tl.load(dprobs_ptr + off, mask=mask, other=0.0).to(tl.float32)
        dp1 += tl.load(dprobs_ptr + off + 1, mask=mask, other=0.0).to(tl.float32)
    if REG_GRAD:
        dp0 += tl.where(routable, dreg, 0.0)
    if ROUTE_GRAD:
        dr0 = tl.load(droutes_ptr + off, mask=mask, other=0.0).to(tl.float32)
        dr1 = tl.load(droutes_ptr + off + 1, mask=mask, other=0.0).to(tl.float32)
        if not TEMPERED:
            dp0 += dr0
            dp1 += dr1
    inner = p0 * dp0 + p1 * dp1
    da0 = p0 * (dp0 - inner)
    da1 = p1 * (dp1 - inner)
    if ROUTE_GRAD and TEMPERED:
        q0 = tl.load(soft_ptr + off, mask=mask, other=0.0)
        q1 = tl.load(soft_ptr + off + 1, mask=mask, other=0.0)
        inner_q = q0 * dr0 + q1 * dr1
        da0 += q0 * (dr0 - inner_q) / tau
        da1 += q1 * (dr1 - inner_q) / tau
    if BUDGET:
        return da0 * inv_std, da1
    return da0, da1


@triton.jit
def _routes_bwd(probs_ptr, soft_ptr, droutes_ptr, dprobs_ptr, dreg_ptr, var_ptr, dlogits_ptr,
                rows, n_chunks, heads, eps, tau,
                BUDGET: tl.constexpr, CENTRE: tl.constexpr, ROUTE_GRAD: tl.constexpr,
                TEMPERED: tl.constexpr, PROBS_GRAD: tl.constexpr, REG_GRAD: tl.constexpr,
                BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr):
    _unused_bias, _unused_mean, inv_std = _budget_state(var_ptr, var_ptr, var_ptr, heads, eps,
                                                      BUDGET, BLOCK_H)
    routable_rows = (rows // n_chunks) * (n_chunks - 1)
    dreg = 0.0
    if REG_GRAD:
        dreg = tl.load(dreg_ptr).to(tl.float32) / tl.maximum(routable_rows * heads, 1)
    shift = tl.zeros([1, BLOCK_H], tl.float32)
    if CENTRE:
        # Every chunk's centred difference subtracts the mean of the routable ones: the
        # routable chunks' gradient loses the mean of all the chunks' summed gradient.
        grad_sum = tl.zeros([BLOCK_H], tl.float32)
        for r0 in range(0, rows, BLOCK_R):
            _r, _h, mask, routable, off = _tile(r0, rows, n_chunks, heads, BLOCK_R, BLOCK_H)
            dz, _dz_linear = _logit_grad(probs_ptr, soft_ptr, droutes_ptr, dprobs_ptr, off, mask,
                                routable, dreg, tau, inv_std, BUDGET, ROUTE_GRAD, TEMPERED,
                                PROBS_GRAD, REG_GRAD)
            grad_sum += tl.sum(tl.where(mask, dz, 0.0), 0)
        shift = (grad_sum / routable_rows)[None, :]
    for r0 in range(0, rows, BLOCK_R):
        _r, _h, mask, routable, off = _tile(r0, rows, n_chunks, heads, BLOCK_R, BLOCK_H)
        da0, da1 = _logit_grad(probs_ptr, soft_ptr, droutes_ptr, dprobs_ptr, off, mask,
                               routable, dreg, tau, inv_std, BUDGET, ROUTE_GRAD, TEMPERED,
                               PROBS_GRAD, REG_GRAD)
        if BUDGET:
            dd = da0 - tl.where(routable, shift, 0.0)
            da0 = dd
            da1 = -dd
        tl.store(dlogits_ptr + off, da0.to(dlogits_ptr.dtype.element_ty), mask=mask)
        tl.store(dlogits_ptr + off + 1, da1.to(dlogits_ptr.dtype.element_ty), mask=mask)


def _block(heads: int) -> tuple[int, int]:
    block_h = triton.next_power_of_2(heads)
    return max(1, CHUNKS_PER_BLOCK // block_h), block_h


class _ChunkRoutes(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, seq_len: int, chunk_size: int,
                budget: RouteBudget | None, forced: torch.Tensor | None,
                noise: torch.Tensor | None, tau: float | None):
        logits = logits.contiguous()
        batch, n_chunks, heads, _ = logits.shape
        rows = batch * n_chunks
        like = dict(dtype=logits.dtype, device=logits.device)
        probs = empty(*logits.shape, **like)
        routes = empty(*logits.shape, **like) if forced is None else logits
        tempered = forced is None and noise is not None and tau is not None
        soft = empty(*logits.shape, dtype=torch.float32, device=logits.device) \
            if tempered else logits
        reg = empty(**like)
        f32 = dict(dtype=torch.float32, device=logits.device)
        attn_frac, routable_frac = empty(heads, **f32), empty(**f32)
        centre = budget is not None and budget.pending is not None and n_chunks > 1
        stand_in = logits  # a pointer a kernel never reads: its branch is compiled out
        state = (budget.bias, budget.running_mean, budget.running_var) if budget is not None \
            else (stand_in,) * 3
        fs = forced.stride() if forced is not None else (0,) * 4
        block_r, block_h = _block(heads)
        _routes_fwd[(1,)](
            logits, *state, budget.pending if centre else stand_in,
            stand_in if forced is None else forced, stand_in if noise is None else
            noise.contiguous(), routes, probs, soft, reg, attn_frac, routable_frac,
            rows, n_chunks, heads, seq_len, chunk_size,
            budget.eps if budget is not None else 0.0, tau if tempered else 1.0, *fs,
            BUDGET=budget is not None, ACCUMULATE=centre, FORCED=forced is not None,
            NOISE=noise is not None, TEMPERED=tempered, BLOCK_R=block_r, BLOCK_H=block_h)
        ctx.save_for_backward(probs, soft if tempered else None,
                              budget.running_var if budget is not None else None)
        ctx.shape = (rows, n_chunks, heads, block_r, block_h)
        ctx.flags = (budget is not None, centre, forced is None, tempered)
        ctx.eps = budget.eps if budget is not None else 0.0
        ctx.tau = tau if tempered else 1.0
        ctx.set_materialize_grads(False)
        ctx.mark_non_differentiable(attn_frac, routable_frac)
        if forced is not None:
            return probs, reg, attn_frac, routable_frac
        return routes, probs, reg, attn_frac, routable_frac

    @staticmethod
    def backward(ctx, *grads: torch.Tensor | None):
        probs, soft, running_var = ctx.saved_tensors
        budgeted, centre, sampled, tempered = ctx.flags
        droutes = grads[0] if sampled else None
        dprobs, dreg = grads[1:3] if sampled else grads[0:2]
        rows, n_chunks, heads, block_r, block_h = ctx.shape
        dlogits = empty(*probs.shape, dtype=probs.dtype, device=probs.device)
        stand_in = probs
        _routes_bwd[(1,)](
            probs, stand_in if soft is None else soft,
            stand_in if droutes is None else droutes.contiguous(),
            stand_in if dprobs is None else dprobs.contiguous(),
            stand_in if dreg is None else dreg, stand_in if running_var is None else running_var,
            dlogits, rows, n_chunks, heads, ctx.eps, ctx.tau,
            BUDGET=budgeted, CENTRE=centre, ROUTE_GRAD=droutes is not None, TEMPERED=tempered,
            PROBS_GRAD=dprobs is not None, REG_GRAD=dreg is not None, BLOCK_R=block_r,
            BLOCK_H=block_h)
        return dlogits, None, None, None, None, None, None


def chunk_routes(logits: torch.Tensor, seq_len: int, chunk_size: int,
                 budget: RouteBudget | None = None, forced: torch.Tensor | None = None,
                 noise: torch.Tensor | None = None, tau: float | None = None) -> ChunkRoutes:
    """See :func:`nats.kernels.reference.routes.chunk_routes`."""
    out = _ChunkRoutes.apply(logits, seq_len, chunk_size, budget, forced, noise, tau)
    if forced is not None:
        return ChunkRoutes(forced, *out)
    return ChunkRoutes(*out)
