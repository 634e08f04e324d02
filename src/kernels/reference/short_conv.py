"""The short convolution of the q/k/v projections (plain PyTorch): ``SiLU`` of a causal
depthwise convolution over ``[B, T, C]``, computed in float32 with one rounding."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .chunks import compute_dtype


def short_conv(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``SiLU(y)`` with ``y_t = sum_i weight[:, i] * x_{t - K + 1 + i}`` (zeros before the
    start) over ``x`` ``[B, T, C]`` and ``weight`` ``[C, K]``, in ``x``'s dtype.

    ``K`` shifted products rather than a grouped ``conv1d``: they keep ``[B, T, C]``
    contiguous, where ``conv1d`` wants channels first and its CPU backward runs a slow
    depthwise path.
    """
    kernel_size, seq_len = weight.shape[-1], x.shape[1]
    dtype = compute_dtype(x)
    padded = F.pad(x.to(dtype), (0, 0, kernel_size - 1, 0))
    taps = weight.to(dtype).t()  # [K, C]
    y = padded[:, kernel_size - 1:] * taps[-1]
    for i in range(kernel_size - 1):
        y = y + padded[:, i:i + seq_len] * taps[i]
    return F.silu(y).to(x.dtype)
