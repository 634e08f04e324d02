"""Row normalisations in Triton: one launch forward, one (plus a column sum for the
weight) backward, where the plain PyTorch form takes about seven forward and a dozen
backward launches and upcasts the whole tensor to float32 in memory.

Same contract as :mod:`nats.kernels.reference.norms`: float32 arithmetic, output in the
input's dtype. ``x`` may be a strided view (a head slice of a fused projection) as long
as its rows form a ``[outer, inner]`` grid of uniform strides with a contiguous last
dimension; otherwise it is copied first.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .utils import empty, is_power_of_two


@triton.jit
def _row_norm_fwd(x_ptr, w_ptr, y_ptr, rstd_ptr, n_rows, inner, stride_outer, stride_inner,
                  dim, eps, divisor,
                  HAS_WEIGHT: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.arange(0, BLOCK_D)
    row_ok = rows < n_rows
    mask = row_ok[:, None] & (cols[None, :] < dim)
    src = (rows // inner).to(tl.int64) * stride_outer + (rows % inner).to(tl.int64) * stride_inner
    x = tl.load(x_ptr + src[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / divisor + eps)
    y = x * rstd[:, None]
    if HAS_WEIGHT:
        y = y * tl.load(w_ptr + cols, mask=cols < dim, other=0.0).to(tl.float32)[None, :]
    dst = rows.to(tl.int64)[:, None] * dim + cols[None, :]
    tl.store(y_ptr + dst, y.to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(rstd_ptr + rows, rstd, mask=row_ok)


@triton.jit
def _row_norm_bwd(x_ptr, w_ptr, rstd_ptr, dy_ptr, dx_ptr, dw_ptr, n_rows, inner, stride_outer,
                  stride_inner, dim, divisor,
                  HAS_WEIGHT: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    # y = x r w with r = (sum(x^2) / divisor + eps)^-1/2, so with g = dy w and xh = x r:
    # dx = r (g - xh sum(g xh) / divisor), dw = sum over rows of dy xh.
    pid = tl.program_id(0)
    rows = pid * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.arange(0, BLOCK_D)
    row_ok = rows < n_rows
    col_ok = cols < dim
    mask = row_ok[:, None] & col_ok[None, :]
    src = (rows // inner).to(tl.int64) * stride_outer + (rows % inner).to(tl.int64) * stride_inner
    x = tl.load(x_ptr + src[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    rstd = tl.load(rstd_ptr + rows, mask=row_ok, other=0.0)
    dense = rows.to(tl.int64)[:, None] * dim + cols[None, :]
    dy = tl.load(dy_ptr + dense, mask=mask, other=0.0).to(tl.float32)
    xh = x * rstd[:, None]
    g = dy
    if HAS_WEIGHT:
        g = dy * tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(dw_ptr + pid * dim + cols, tl.sum(dy * xh, axis=0), mask=col_ok)
    dx = rstd[:, None] * (g - xh * (tl.sum(g * xh, axis=1) / divisor)[:, None])
    tl.store(dx_ptr + dense, dx.to(dx_ptr.dtype.element_ty), mask=mask)


def _rows(x: torch.Tensor) -> tuple[torch.Tensor, int, int, int]:
    """``x`` with its rows as an ``[outer, inner]`` grid: (tensor, inner, strides)."""
    if x.dim() < 2 or x.stride(-1) != 1:
        x = x.contiguous()
    grid = x.view(-1, x.shape[-1]) if x.is_contiguous() else None
    if grid is not None:
        return x, 1, x.shape[-1], 0
    try:
        grid = x.view(-1, x.shape[-2], x.shape[-1])
    except RuntimeError:  # leading dimensions do not merge: copy once
        x = x.contiguous()
        return x, 1, x.shape[-1], 0
    return x, grid.shape[1], grid.stride(0), grid.stride(1)


def _launch_shape(dim: int) -> tuple[int, int]:
    block_d = triton.next_power_of_2(dim)
    return max(1, min(64, 4096 // block_d)), block_d


class _RowNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor | None, eps: float,
                divisor: float) -> torch.Tensor:
        x, inner, s_outer, s_inner = _rows(x)
        dim = x.shape[-1]
        n_rows = x.numel() // dim
        block_rows, block_d = _launch_shape(dim)
        y = empty(*x.shape, dtype=x.dtype, device=x.device)
        rstd = empty(n_rows, dtype=torch.float32, device=x.device)
        _row_norm_fwd[(triton.cdiv(n_rows, block_rows),)](
            x, weight if weight is not None else x, y, rstd, n_rows, inner, s_outer, s_inner,
            dim, eps, divisor, HAS_WEIGHT=weight is not None, BLOCK_ROWS=block_rows,
            BLOCK_D=block_d)
        ctx.save_for_backward(x, weight, rstd)
        ctx.layout, ctx.divisor = (inner, s_outer, s_inner), divisor
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x, weight, rstd = ctx.saved_tensors
        inner, s_outer, s_inner = ctx.layout
        dim = x.shape[-1]
        n_rows = rstd.numel()
        block_rows, block_d = _launch_shape(dim)
        programs = triton.cdiv(n_rows, block_rows)
        dx = empty(*x.shape, dtype=x.dtype, device=x.device)
        dw = None if weight is None else empty(programs, dim, dtype=torch.float32,
                                               device=x.device)
        _row_norm_bwd[(programs,)](
            x, weight if weight is not None else x, rstd, dy.contiguous(), dx,
            dw if dw is not None else rstd, n_rows, inner, s_outer, s_inner, dim, ctx.divisor,
            HAS_WEIGHT=weight is not None, BLOCK_ROWS=block_rows, BLOCK_D=block_d)
        dw = None if dw is None else dw.sum(0).to(weight.dtype)
        return dx, dw, None, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None = None,
             eps: float = 1e-6) -> torch.Tensor:
    """See :func:`nats.kernels.reference.norms.rms_norm`."""
    return _RowNorm.apply(x, weight, eps, float(x.shape[-1]))


def l2_norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """See :func:`nats.kernels.reference.norms.l2_norm`."""
    return _RowNorm.apply(x, None, eps, 1.0)


@triton.jit
def _rms_l2_fwd(x_ptr, x2_ptr, w_ptr, w2_ptr, y_rms_ptr, y2_rms_ptr, y_l2_ptr, y2_l2_ptr,
                r_rms_ptr, r2_rms_ptr, r_l2_ptr, r2_l2_ptr, n_rows, inner, stride_outer,
                stride_inner, rms_eps, rms_eps2, l2_eps, D: tl.constexpr, R: tl.constexpr,
                BLOCK_ROWS: tl.constexpr):
    # A row is one head of D; its R sub-rows of D / R are the softmax heads. Grid axis 1
    # picks the tensor, q or k (the "2" arguments): one launch for both, whose rows share
    # one layout.
    if tl.program_id(1) == 1:
        x_ptr, w_ptr, rms_eps = x2_ptr, w2_ptr, rms_eps2
        y_rms_ptr, y_l2_ptr, r_rms_ptr, r_l2_ptr = y2_rms_ptr, y2_l2_ptr, r2_rms_ptr, r2_l2_ptr
    DS: tl.constexpr = D // R
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.arange(0, D)
    row_ok = rows < n_rows
    mask = row_ok[:, None] & (cols[None, :] < D)
    src = (rows // inner).to(tl.int64) * stride_outer + (rows % inner).to(tl.int64) * stride_inner
    x = tl.load(x_ptr + src[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    r_l2 = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) + l2_eps)
    xs = tl.reshape(x, [BLOCK_ROWS, R, DS])
    r_rms = 1.0 / tl.sqrt(tl.sum(xs * xs, axis=2) / DS + rms_eps)
    w = tl.load(w_ptr + tl.arange(0, DS)).to(tl.float32)
    y_rms = tl.reshape(xs * r_rms[:, :, None] * w[None, None, :], [BLOCK_ROWS, D])
    dst = rows.to(tl.int64)[:, None] * D + cols[None, :]
    tl.store(y_rms_ptr + dst, y_rms.to(y_rms_ptr.dtype.element_ty), mask=mask)
    tl.store(y_l2_ptr + dst, (x * r_l2[:, None]).to(y_l2_ptr.dtype.element_ty), mask=mask)
    parts = rows.to(tl.int64)[:, None] * R + tl.arange(0, R)[None, :]
    tl.store(r_rms_ptr + parts, r_rms, mask=row_ok[:, None])
    tl.store(r_l2_ptr + rows, r_l2, mask=row_ok)


@triton.jit
def _rms_l2_bwd(x_ptr, x2_ptr, w_ptr, w2_ptr, r_rms_ptr, r2_rms_ptr, r_l2_ptr, r2_l2_ptr,
                dy_rms_ptr, dy2_rms_ptr, dy_l2_ptr, dy2_l2_ptr, dx_ptr, dx2_ptr, dw_ptr,
                dw2_ptr, n_rows, inner, stride_outer, stride_inner, D: tl.constexpr,
                R: tl.constexpr, BLOCK_ROWS: tl.constexpr):
    # Each norm's gradient as in _row_norm_bwd (the L2 norm's divisor is 1), summed into
    # one dx; dw per program, summed over its rows and sub-rows. Grid axis 1 as in the
    # forward.
    DS: tl.constexpr = D // R
    pid = tl.program_id(0)
    if tl.program_id(1) == 1:
        x_ptr, w_ptr, r_rms_ptr, r_l2_ptr = x2_ptr, w2_ptr, r2_rms_ptr, r2_l2_ptr
        dy_rms_ptr, dy_l2_ptr, dx_ptr, dw_ptr = dy2_rms_ptr, dy2_l2_ptr, dx2_ptr, dw2_ptr
    rows = pid * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.arange(0, D)
    row_ok = rows < n_rows
    mask = row_ok[:, None] & (cols[None, :] < D)
    src = (rows // inner).to(tl.int64) * stride_outer + (rows % inner).to(tl.int64) * stride_inner
    x = tl.load(x_ptr + src[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    dense = rows.to(tl.int64)[:, None] * D + cols[None, :]
    r_l2 = tl.load(r_l2_ptr + rows, mask=row_ok, other=0.0)
    dy = tl.load(dy_l2_ptr + dense, mask=mask, other=0.0).to(tl.float32)
    xh = x * r_l2[:, None]
    dx = r_l2[:, None] * (dy - xh * tl.sum(dy * xh, axis=1)[:, None])
    parts = rows.to(tl.int64)[:, None] * R + tl.arange(0, R)[None, :]
    r_rms = tl.load(r_rms_ptr + parts, mask=row_ok[:, None], other=0.0)
    w = tl.load(w_ptr + tl.arange(0, DS)).to(tl.float32)
    dys = tl.reshape(tl.load(dy_rms_ptr + dense, mask=mask, other=0.0).to(tl.float32),
                     [BLOCK_ROWS, R, DS])
    xhs = tl.reshape(x, [BLOCK_ROWS, R, DS]) * r_rms[:, :, None]
    g = dys * w[None, None, :]
    dxs = r_rms[:, :, None] * (g - xhs * (tl.sum(g * xhs, axis=2) / DS)[:, :, None])
    dx += tl.reshape(dxs, [BLOCK_ROWS, D])
    tl.store(dx_ptr + dense, dx.to(dx_ptr.dtype.element_ty), mask=mask)
    tl.store(dw_ptr + pid * DS + tl.arange(0, DS), tl.sum(tl.sum(dys * xhs, axis=1), axis=0))


class _QKNorms(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor,
                k_weight: torch.Tensor, parts: int, q_eps: float, k_eps: float, l2_eps: float,
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        shape = q.shape
        q, k, layout = _shared_rows(q, k)
        dim = q.shape[-1]
        n_rows = q.numel() // dim
        block_rows, _ = _launch_shape(dim)
        rms_shape = (*shape[:-2], shape[-2] * parts, dim // parts)
        ys = [empty(*s, dtype=q.dtype, device=q.device) for s in (rms_shape, shape) * 2]
        r_rms = empty(2, n_rows, parts, dtype=torch.float32, device=q.device)
        r_l2 = empty(2, n_rows, dtype=torch.float32, device=q.device)
        _rms_l2_fwd[(triton.cdiv(n_rows, block_rows), 2)](
            q, k, q_weight, k_weight, ys[0], ys[2], ys[1], ys[3], r_rms[0], r_rms[1], r_l2[0],
            r_l2[1], n_rows, *layout, q_eps, k_eps, l2_eps, D=dim, R=parts,
            BLOCK_ROWS=block_rows)
        ctx.save_for_backward(q, k, q_weight, k_weight, r_rms, r_l2)
        ctx.layout, ctx.shape = layout, shape
        return tuple(ys)

    @staticmethod
    def backward(ctx, *dys: torch.Tensor | None):
        q, k, q_weight, k_weight, r_rms, r_l2 = ctx.saved_tensors
        dim, parts, n_rows = q.shape[-1], r_rms.shape[2], r_l2.shape[1]
        block_rows, _ = _launch_shape(dim)
        programs = triton.cdiv(n_rows, block_rows)
        dys = [torch.zeros(n_rows * dim, dtype=q.dtype, device=q.device) if d is None
               else d.contiguous() for d in dys]
        dx = empty(2, *ctx.shape, dtype=q.dtype, device=q.device)
        dw = empty(2, programs, dim // parts, dtype=torch.float32, device=q.device)
        _rms_l2_bwd[(programs, 2)](
            q, k, q_weight, k_weight, r_rms[0], r_rms[1], r_l2[0], r_l2[1], dys[0], dys[2],
            dys[1], dys[3], dx[0], dx[1], dw[0], dw[1], n_rows, *ctx.layout, D=dim, R=parts,
            BLOCK_ROWS=block_rows)
        dw = dw.sum(1)
        return (dx[0], dx[1], dw[0].to(q_weight.dtype), dw[1].to(k_weight.dtype),
                None, None, None, None)


def _shared_rows(q: torch.Tensor, k: torch.Tensor,
                 ) -> tuple[torch.Tensor, torch.Tensor, tuple[int, int, int]]:
    """``q`` and ``k`` as row grids of one layout (``_rows``): each copied where theirs
    differ (a layer's q and k, slices of one projection, share it)."""
    (q, *q_layout), (k, *k_layout) = _rows(q), _rows(k)
    if q_layout != k_layout:
        (q, *q_layout), (k, *_) = _rows(q.contiguous()), _rows(k.contiguous())
    return q, k, tuple(q_layout)


def qk_norms(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
             parts: int, q_eps: float, k_eps: float, l2_eps: float,
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """See :func:`nats.kernels.reference.norms.qk_norms`; one launch each way for all
    four where the head and sub-head widths are powers of two, else the row norms."""
    dim = q.shape[-1]
    if not (is_power_of_two(dim) and is_power_of_two(parts)) or dim < 2 * parts:
        heads = (*q.shape[:-2], q.shape[-2] * parts, dim // parts)
        return (rms_norm(q.reshape(heads), q_weight, q_eps), l2_norm(q, l2_eps),
                rms_norm(k.reshape(heads), k_weight, k_eps), l2_norm(k, l2_eps))
    if q_weight.dtype != k_weight.dtype:
        # One kernel reads both weights through one pointer type; float32 holds either
        # exactly, and autograd returns each gradient in its weight's own dtype.
        q_weight, k_weight = q_weight.float(), k_weight.float()
    return _QKNorms.apply(q, k, q_weight, k_weight, parts, q_eps, k_eps, l2_eps)


@triton.jit
def inv_rms(x, dim, eps):
    """``1 / RMS`` of ``x`` over its last axis of ``dim`` real columns (the rest zeros)."""
    return 1.0 / tl.sqrt(tl.sum(x * x, axis=-1) / dim + eps)


@triton.jit
def softmax_pair(la, lb):
    """The two branch weights of the logits ``la``, ``lb``: their softmax."""
    top = tl.maximum(la, lb)
    ea, eb = tl.exp(la - top), tl.exp(lb - top)
    return ea / (ea + eb), eb / (ea + eb)


@triton.jit
def _merge_weights(w_ptr, rows, row_ok, LOGITS: tl.constexpr):
    """The rows' two branch weights in float32: as given, or the softmax of the logits."""
    wa = tl.load(w_ptr + rows * 2, mask=row_ok, other=0.0).to(tl.float32)
    wb = tl.load(w_ptr + rows * 2 + 1, mask=row_ok, other=0.0).to(tl.float32)
    if LOGITS:
        wa, wb = softmax_pair(wa, wb)
    return wa, wb


@triton.jit
def _merge_fwd(a_ptr, b_ptr, w_ptr, gamma_ptr, y_ptr, ra_ptr, rb_ptr, n_rows, dim, eps,
               NORM_A: tl.constexpr, NORM_B: tl.constexpr, LOGITS: tl.constexpr,
               BLOCK_ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.arange(0, BLOCK_D)
    row_ok = rows < n_rows
    col_ok = cols < dim
    mask = row_ok[:, None] & col_ok[None, :]
    dense = rows.to(tl.int64)[:, None] * dim + cols[None, :]
    a = tl.load(a_ptr + dense, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + dense, mask=mask, other=0.0).to(tl.float32)
    if NORM_A:
        ra = inv_rms(a, dim, eps)
        a = a * ra[:, None]
        tl.store(ra_ptr + rows, ra, mask=row_ok)
    if NORM_B:
        rb = inv_rms(b, dim, eps)
        b = b * rb[:, None]
        tl.store(rb_ptr + rows, rb, mask=row_ok)
    wa, wb = _merge_weights(w_ptr, rows, row_ok, LOGITS)
    gamma = tl.load(gamma_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    y = (wa[:, None] * a + wb[:, None] * b) * gamma[None, :]
    tl.store(y_ptr + dense, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _merge_bwd(a_ptr, b_ptr, w_ptr, gamma_ptr, ra_ptr, rb_ptr, dy_ptr, da_ptr, db_ptr, dw_ptr,
               dgamma_ptr, n_rows, dim,
               NORM_A: tl.constexpr, NORM_B: tl.constexpr, LOGITS: tl.constexpr,
               BLOCK_ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    # With g = dy gamma: d(w_a) = sum(g a_hat), d(a_hat) = w_a g, and through the norm
    # da = r (d(a_hat) - a_hat sum(d(a_hat) a_hat) / D); dgamma = sum over rows of dy m,
    # m the merged rows before gamma. Through a softmax of logits:
    # d(l_i) = w_i (d(w_i) - sum_j w_j d(w_j)).
    pid = tl.program_id(0)
    rows = pid * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    cols = tl.arange(0, BLOCK_D)
    row_ok = rows < n_rows
    col_ok = cols < dim
    mask = row_ok[:, None] & col_ok[None, :]
    dense = rows.to(tl.int64)[:, None] * dim + cols[None, :]
    a = tl.load(a_ptr + dense, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + dense, mask=mask, other=0.0).to(tl.float32)
    if NORM_A:
        ra = tl.load(ra_ptr + rows, mask=row_ok, other=0.0)
        a = a * ra[:, None]
    if NORM_B:
        rb = tl.load(rb_ptr + rows, mask=row_ok, other=0.0)
        b = b * rb[:, None]
    wa, wb = _merge_weights(w_ptr, rows, row_ok, LOGITS)
    gamma = tl.load(gamma_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
    dy = tl.load(dy_ptr + dense, mask=mask, other=0.0).to(tl.float32)
    tl.store(dgamma_ptr + pid * dim + cols,
             tl.sum(dy * (wa[:, None] * a + wb[:, None] * b), axis=0), mask=col_ok)
    g = dy * gamma[None, :]
    dwa, dwb = tl.sum(g * a, axis=1), tl.sum(g * b, axis=1)
    if LOGITS:
        through = wa * dwa + wb * dwb
        dwa, dwb = wa * (dwa - through), wb * (dwb - through)
    tl.store(dw_ptr + rows * 2, dwa.to(dw_ptr.dtype.element_ty), mask=row_ok)
    tl.store(dw_ptr + rows * 2 + 1, dwb.to(dw_ptr.dtype.element_ty), mask=row_ok)
    da = wa[:, None] * g
    db = wb[:, None] * g
    if NORM_A:
        da = ra[:, None] * (da - a * (tl.sum(da * a, axis=1) / dim)[:, None])
    if NORM_B:
        db = rb[:, None] * (db - b * (tl.sum(db * b, axis=1) / dim)[:, None])
    tl.store(da_ptr + dense, da.to(da_ptr.dtype.element_ty), mask=mask)
    tl.store(db_ptr + dense, db.to(db_ptr.dtype.element_ty), mask=mask)


class _Merge(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a: torch.Tensor, b: torch.Tensor, weights: torch.Tensor,
                gamma: torch.Tensor, eps: float, norm_a: bool, norm_b: bool,
                out_dtype: torch.dtype, logits: bool) -> torch.Tensor:
        a, b, weights = a.contiguous(), b.contiguous(), weights.contiguous()
        dim = a.shape[-1]
        n_rows = a.numel() // dim
        block_rows, block_d = _launch_shape(dim)
        y = empty(*a.shape, dtype=out_dtype, device=a.device)
        ra, rb = (empty(n_rows, dtype=torch.float32, device=a.device) if norm else weights
                  for norm in (norm_a, norm_b))
        _merge_fwd[(triton.cdiv(n_rows, block_rows),)](
            a, b, weights, gamma, y, ra, rb, n_rows, dim, eps, NORM_A=norm_a, NORM_B=norm_b,
            LOGITS=logits, BLOCK_ROWS=block_rows, BLOCK_D=block_d)
        ctx.save_for_backward(a, b, weights, gamma, ra, rb)
        ctx.norms, ctx.logits = (norm_a, norm_b), logits
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        a, b, weights, gamma, ra, rb = ctx.saved_tensors
        norm_a, norm_b = ctx.norms
        dim = a.shape[-1]
        n_rows = a.numel() // dim
        block_rows, block_d = _launch_shape(dim)
        programs = triton.cdiv(n_rows, block_rows)
        da = empty(*a.shape, dtype=a.dtype, device=a.device)
        db = empty(*b.shape, dtype=b.dtype, device=b.device)
        dw = empty(*weights.shape, dtype=weights.dtype, device=a.device)
        dgamma = empty(programs, dim, dtype=torch.float32, device=a.device)
        _merge_bwd[(programs,)](
            a, b, weights, gamma, ra, rb, dy.contiguous(), da, db, dw, dgamma, n_rows, dim,
            NORM_A=norm_a, NORM_B=norm_b, LOGITS=ctx.logits, BLOCK_ROWS=block_rows,
            BLOCK_D=block_d)
        return da, db, dw, dgamma.sum(0).to(gamma.dtype), None, None, None, None, None


def merge_branches(a: torch.Tensor, b: torch.Tensor, weights: torch.Tensor,
                   gamma: torch.Tensor, eps: float, norm_a: bool, norm_b: bool,
                   out_dtype: torch.dtype, logits: bool = False) -> torch.Tensor:
    """See :func:`nats.kernels.reference.norms.merge_branches`."""
    if a.shape != b.shape or weights.shape != (*a.shape[:-1], 2) \
            or gamma.shape != a.shape[-1:]:
        raise ValueError(f"merge_branches needs a, b [..., D], weights [..., 2], gamma [D]; "
                         f"got {list(a.shape)}, {list(b.shape)}, {list(weights.shape)}, "
                         f"{list(gamma.shape)}")
    return _Merge.apply(a, b, weights, gamma, eps, norm_a, norm_b, out_dtype, logits)
