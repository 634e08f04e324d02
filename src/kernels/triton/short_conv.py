"""The short convolution (``SiLU`` of a causal depthwise convolution) in Triton, on the
``[B, T, C]`` layout the projections produce.

PyTorch's grouped ``conv1d`` wants channels first: around it sit a transposing pad, a
separate SiLU, and transposing copies wherever ``q``, ``k``, ``v`` are reshaped into heads.
Here one launch reads ``x`` and writes ``SiLU(y)`` contiguous, so the head views need no
copy. Same contract as :func:`nats.kernels.reference.short_conv.short_conv`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .utils import empty

BLOCK_T = 64
"""Tokens per program; a program reads ``K - 1`` tokens more than it writes."""


@triton.jit
def _tile(b_t, c_block, seq_len, channels, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    """The (token, channel) offsets of program ``(b_t, c_block)`` and its row start."""
    n_t = tl.cdiv(seq_len, BLOCK_T)
    b = b_t // n_t
    t = (b_t % n_t) * BLOCK_T + tl.arange(0, BLOCK_T)
    c = c_block * BLOCK_C + tl.arange(0, BLOCK_C)
    return t, c, b.to(tl.int64) * seq_len * channels


@triton.jit
def _rows(ptr, rows, c, base, seq_len, channels):
    """Tokens ``rows`` x channels ``c`` of the sequence at ``base``, in float32; zeros for
    tokens outside ``[0, seq_len)`` (the causal padding) and channels past the last."""
    mask = ((rows >= 0) & (rows < seq_len))[:, None] & (c < channels)[None, :]
    return tl.load(ptr + base + rows.to(tl.int64)[:, None] * channels + c[None, :], mask=mask,
                   other=0.0).to(tl.float32)


@triton.jit
def _tap(w_ptr, c, channels, i, K: tl.constexpr):
    """Tap ``i`` of the channels ``c``, in float32."""
    return tl.load(w_ptr + c * K + i, mask=c < channels, other=0.0).to(tl.float32)


@triton.jit
def _pre_activation(x_ptr, w_ptr, t, c, base, seq_len, channels, K: tl.constexpr,
                    BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    """``y_t = sum_i w_i x_{t-K+1+i}`` over the tile, in float32."""
    acc = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)
    for i in tl.static_range(K):
        acc += _rows(x_ptr, t - (K - 1) + i, c, base, seq_len, channels) \
            * _tap(w_ptr, c, channels, i, K)[None, :]
    return acc


@triton.jit
def _short_conv_fwd(x_ptr, w_ptr, y_ptr, seq_len, channels, K: tl.constexpr,
                    BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    t, c, base = _tile(tl.program_id(0), tl.program_id(1), seq_len, channels, BLOCK_T, BLOCK_C)
    y = _pre_activation(x_ptr, w_ptr, t, c, base, seq_len, channels, K, BLOCK_T, BLOCK_C)
    y = y * tl.sigmoid(y)
    mask = (t < seq_len)[:, None] & (c < channels)[None, :]
    dst = base + t.to(tl.int64)[:, None] * channels + c[None, :]
    tl.store(y_ptr + dst, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _short_conv_bwd_pre(x_ptr, w_ptr, dy_ptr, dpre_ptr, dw_ptr, seq_len, channels,
                        K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    # dL/dy_t = dout_t * SiLU'(y_t), SiLU'(y) = s (1 + y (1 - s)) with s = sigmoid(y);
    # dw_i = sum_t dL/dy_t x_{t-K+1+i}: this tile's share goes to row b_t of dw.
    b_t = tl.program_id(0)
    t, c, base = _tile(b_t, tl.program_id(1), seq_len, channels, BLOCK_T, BLOCK_C)
    y = _pre_activation(x_ptr, w_ptr, t, c, base, seq_len, channels, K, BLOCK_T, BLOCK_C)
    c_ok = c < channels
    mask = (t < seq_len)[:, None] & c_ok[None, :]
    s = tl.sigmoid(y)
    dpre = _rows(dy_ptr, t, c, base, seq_len, channels) * s * (1 + y * (1 - s))
    tl.store(dpre_ptr + base + t.to(tl.int64)[:, None] * channels + c[None, :], dpre, mask=mask)
    for i in tl.static_range(K):
        x = _rows(x_ptr, t - (K - 1) + i, c, base, seq_len, channels)
        tl.store(dw_ptr + (b_t.to(tl.int64) * K + i) * channels + c, tl.sum(dpre * x, axis=0),
                 mask=c_ok)


@triton.jit
def _short_conv_bwd_x(dpre_ptr, w_ptr, dx_ptr, seq_len, channels, K: tl.constexpr,
                      BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    # x_t feeds y_{t+K-1-i} through tap i: dx_t = sum_i w_i dL/dy_{t+K-1-i}.
    t, c, base = _tile(tl.program_id(0), tl.program_id(1), seq_len, channels, BLOCK_T, BLOCK_C)
    acc = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)
    for i in tl.static_range(K):
        acc += _rows(dpre_ptr, t + (K - 1) - i, c, base, seq_len, channels) \
            * _tap(w_ptr, c, channels, i, K)[None, :]
    mask = (t < seq_len)[:, None] & (c < channels)[None, :]
    tl.store(dx_ptr + base + t.to(tl.int64)[:, None] * channels + c[None, :],
             acc.to(dx_ptr.dtype.element_ty), mask=mask)


def _grid(x: torch.Tensor) -> tuple[tuple[int, int], int]:
    """(batch x token blocks on axis 0, which holds 2^31 - 1; channel blocks), block width."""
    batch, seq_len, channels = x.shape
    block_c = min(128, triton.next_power_of_2(channels))
    return (batch * triton.cdiv(seq_len, BLOCK_T), triton.cdiv(channels, block_c)), block_c


class _ShortConv(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        x, w = x.contiguous(), weight.contiguous()
        grid, block_c = _grid(x)
        y = empty(*x.shape, dtype=x.dtype, device=x.device)
        _short_conv_fwd[grid](x, w, y, x.shape[1], x.shape[2], K=w.shape[1], BLOCK_T=BLOCK_T,
                              BLOCK_C=block_c)
        ctx.save_for_backward(x, w)
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x, w = ctx.saved_tensors
        seq_len, channels, kernel_size = x.shape[1], x.shape[2], w.shape[1]
        grid, block_c = _grid(x)
        dpre = empty(*x.shape, dtype=torch.float32, device=x.device)
        dw = empty(grid[0], kernel_size, channels, dtype=torch.float32, device=x.device)
        _short_conv_bwd_pre[grid](x, w, dy.contiguous(), dpre, dw, seq_len, channels,
                                  K=kernel_size, BLOCK_T=BLOCK_T, BLOCK_C=block_c)
        dx = empty(*x.shape, dtype=x.dtype, device=x.device)
        _short_conv_bwd_x[grid](dpre, w, dx, seq_len, channels, K=kernel_size,
                                BLOCK_T=BLOCK_T, BLOCK_C=block_c)
        return dx, dw.sum(0).t().to(w.dtype)


def short_conv(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """See :func:`nats.kernels.reference.short_conv.short_conv`."""
    return _ShortConv.apply(x, weight)
