"""Causal depthwise short convolution with SiLU, and its one-token decode step."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nats.kernels import Backend, short_conv
from nats.kernels.decode import short_conv_step


class ShortConvolution(nn.Module):
    """``SiLU(depthwise_causal_conv(x))`` over ``[B, T, channels]`` (the operator
    :func:`nats.kernels.short_conv`).

    The decode state is the last ``kernel_size - 1`` inputs, so a step sees exactly the
    window the parallel form sees.
    """

    def __init__(self, channels: int, kernel_size: int, backend: Backend = "auto") -> None:
        super().__init__()
        self.kernel_size, self.backend = kernel_size, backend
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel_size))
        nn.init.kaiming_uniform_(self.weight, a=5**0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return short_conv(x, self.weight[:, 0], backend=self.backend)

    def tail(self, x: torch.Tensor) -> torch.Tensor:
        """The decode state after ``x``: its last ``kernel_size - 1`` inputs, zero-padded."""
        window = self.kernel_size - 1
        return F.pad(x, (0, 0, max(window - x.shape[1], 0), 0))[:, -window:] if window else x[:, :0]

    def step(self, x: torch.Tensor, window: torch.Tensor) -> torch.Tensor:
        """One token ``x`` ``[B, 1, C]`` after ``window`` ``[B, K-1, C]``, which moves on by
        ``x`` in place (a captured decode step keeps its buffer)."""
        return short_conv_step(x[:, 0], window, self.weight[:, 0],
                               backend=self.backend)[:, None]
