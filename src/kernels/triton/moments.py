"""Running moments of the routing's statistics in Triton: one launch to accumulate a
batch's rows and one to commit, where the PyTorch form takes about 7 and 16 small
launches for each of a model's statistics (two per NAtS-L layer) in every step.

Same contract as :mod:`nats.kernels.reference.moments`. The float64 sums are taken in
blocks of rows, so they may differ from the reference's in the last bits.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_C = 128
BLOCK_ROWS = 32


@triton.jit
def _accumulate_kernel(x_ptr, pending_ptr, groups, rows, C, stride_g, stride_r,
                       BLOCK_R: tl.constexpr, BLOCK: tl.constexpr):
    # One program per block of columns walks every row: no atomics, a fixed order.
    cols = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < C
    total = tl.zeros([BLOCK], tl.float64)
    squares = tl.zeros([BLOCK], tl.float64)
    for g in range(groups):
        for r0 in range(0, rows, BLOCK_R):
            r = r0 + tl.arange(0, BLOCK_R)
            m = (r < rows)[:, None] & ok[None, :]
            # (int32 offsets: a statistic's rows are a few million values at most)
            x = tl.load(x_ptr + g * stride_g + r[:, None] * stride_r + cols[None, :], mask=m,
                        other=0.0).to(tl.float64)
            total += tl.sum(x, 0)
            squares += tl.sum(x * x, 0)
    tl.store(pending_ptr + 1 + cols, tl.load(pending_ptr + 1 + cols, mask=ok) + total, mask=ok)
    tl.store(pending_ptr + 1 + C + cols, tl.load(pending_ptr + 1 + C + cols, mask=ok) + squares,
             mask=ok)
    if tl.program_id(0) == 0:
        tl.store(pending_ptr, tl.load(pending_ptr) + groups * rows)


def moments_accumulate(x: torch.Tensor, pending: torch.Tensor) -> None:
    """See :func:`nats.kernels.reference.moments.moments_accumulate`. ``x`` may be a
    strided view ``[G, R, C]`` (the routable chunks of ``[B, N, C]``): read in place."""
    x = x.detach()
    if x.stride(-1) != 1 or x.dim() > 3:
        x = x.reshape(-1, x.shape[-1]).contiguous()
    x3 = x if x.dim() == 3 else x.reshape(1, -1, x.shape[-1])
    groups, rows, channels = x3.shape
    if groups * rows == 0:
        return
    _accumulate_kernel[(triton.cdiv(channels, BLOCK_C),)](
        x3, pending, groups, rows, channels, x3.stride(0), x3.stride(1),
        BLOCK_R=BLOCK_ROWS, BLOCK=BLOCK_C)


@triton.jit
def _commit_kernel(sums_ptr, pending_ptr, mean_ptr, var_ptr, commits_ptr, C, momentum,
                   HAS_COMMITS: tl.constexpr, BLOCK: tl.constexpr):
    count = tl.load(sums_ptr)
    seen = count >= 1.0
    n = tl.maximum(count, 1.0)
    if HAS_COMMITS:
        commits = tl.load(commits_ptr) + seen.to(tl.float32)
        tl.store(commits_ptr, commits)
        weight = tl.where(seen, tl.maximum(1.0 / commits, momentum), 0.0)
    else:
        weight = tl.where(seen, momentum, 0.0)
    for c0 in range(0, C, BLOCK):
        cols = c0 + tl.arange(0, BLOCK)
        ok = cols < C
        mean = tl.load(sums_ptr + 1 + cols, mask=ok, other=0.0) / n
        var = tl.maximum(tl.load(sums_ptr + 1 + C + cols, mask=ok, other=0.0) / n - mean * mean,
                         0.0)
        _lerp_into(mean_ptr, cols, ok, mean, weight)
        _lerp_into(var_ptr, cols, ok, var, weight)
        tl.store(pending_ptr + 1 + cols, tl.zeros([BLOCK], tl.float64), mask=ok)
        tl.store(pending_ptr + 1 + C + cols, tl.zeros([BLOCK], tl.float64), mask=ok)
    tl.store(pending_ptr, 0.0)  # the count last: every read of it is above


@triton.jit
def _lerp_into(ptr, cols, ok, end, weight):
    """``torch.lerp``'s two-sided form in the buffer's dtype (exact at weight 1)."""
    start = tl.load(ptr + cols, mask=ok, other=0.0)
    end = end.to(start.dtype)
    step = end - start
    out = tl.where(weight < 0.5, start + weight * step, end - step * (1.0 - weight))
    tl.store(ptr + cols, out.to(ptr.dtype.element_ty), mask=ok)


def moments_commit(sums: torch.Tensor, pending: torch.Tensor, running_mean: torch.Tensor,
                   running_var: torch.Tensor, commits: torch.Tensor | None,
                   momentum: float) -> None:
    """See :func:`nats.kernels.reference.moments.moments_commit`."""
    _commit_kernel[(1,)](sums, pending, running_mean, running_var,
                         running_mean if commits is None else commits, running_mean.numel(),
                         momentum, HAS_COMMITS=commits is not None, BLOCK=BLOCK_C)
