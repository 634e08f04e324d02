"""Causal depthwise short convolution with SiLU, and its one-token decode step."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class ShortConvolution(nn.Module):
    """``SiLU(depthwise_causal_conv(x))`` over ``[B, T, channels]``.

    The decode state is the last ``kernel_size - 1`` inputs, so a step sees exactly the
    window the parallel form sees.
    """

    def __init__(self, channels: int, kernel_size: int) -> None:
        super().__init__()
        self.kernel_size = kernel_size
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel_size))
        nn.init.kaiming_uniform_(self.weight, a=5**0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.silu(causal_depthwise_conv(x, self.weight))

    def tail(self, x: torch.Tensor) -> torch.Tensor:
        """The decode state after ``x``: its last ``kernel_size - 1`` inputs, zero-padded."""
        window = self.kernel_size - 1
        return F.pad(x, (0, 0, max(window - x.shape[1], 0), 0))[:, -window:] if window else x[:, :0]

    def step(self, x: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One token ``x`` ``[B, 1, C]`` against ``state`` ``[B, K-1, C]``."""
        window = torch.cat([state, x], 1)  # [B, K, C]
        y = torch.einsum("bkc,ck->bc", window, self.weight[:, 0]).unsqueeze(1)
        return F.silu(y), window[:, 1:]


def causal_depthwise_conv(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``y_t = sum_i weight[:, 0, i] * x_{t - K + 1 + i}`` over ``x`` ``[B, T, C]`` (zeros
    before the start), ``weight`` ``[C, 1, K]``.

    On CUDA this is one grouped ``conv1d``. On the CPU it is ``K`` shifted products
    instead: the grouped convolution's backward there runs a slow depthwise path on the
    transposed layout, and the shifted form keeps ``[B, T, C]`` contiguous throughout.
    """
    kernel_size = weight.shape[-1]
    if x.is_cuda:
        y = F.conv1d(F.pad(x.transpose(1, 2), (kernel_size - 1, 0)), weight,
                     groups=weight.shape[0])
        return y.transpose(1, 2)
    seq_len = x.shape[1]
    padded = F.pad(x, (0, 0, kernel_size - 1, 0))
    taps = weight[:, 0].t()  # [K, C]
    y = padded[:, kernel_size - 1:] * taps[-1]
    for i in range(kernel_size - 1):
        y = y + padded[:, i:i + seq_len] * taps[i]
    # In x's dtype, as conv1d gives it under autocast (bf16 inputs, float32 weights).
    return y.to(x.dtype)
