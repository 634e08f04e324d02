"""Input projections with short convolutions, and the gated output projection."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nats.kernels import Backend

from .short_conv import ShortConvolution


class QKVProjection(nn.Module):
    """``q, k, v = SiLU(conv(W x))``: one fused projection and one depthwise conv."""

    def __init__(self, d_model: int, dims: tuple[int, int, int], conv_size: int,
                 backend: Backend = "auto") -> None:
        super().__init__()
        self.dims = dims
        self.proj = nn.Linear(d_model, sum(dims), bias=False)
        self.conv = ShortConvolution(sum(dims), conv_size, backend)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.conv(self.proj(x)).split(self.dims, -1)

    def prefill(self, x: torch.Tensor) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
        """Like forward, plus the conv window that decoding continues from (its own buffer:
        decode steps update it in place)."""
        h = self.proj(x)
        return self.conv(h).split(self.dims, -1), self.conv.tail(h).clone()

    def step(self, x: torch.Tensor, window: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """One token ``[B, 1, d_model]``; advances the conv ``window`` in place."""
        return self.conv.step(self.proj(x), window).split(self.dims, -1)


class GatedOutput(nn.Module):
    """``W_o((y * gamma) * SiLU(W_g x))`` over heads of width ``head_dim``, or
    ``W_o(y * gamma)`` with ``gate="none"`` (``NatsConfig.output_gate``).

    ``y`` arrives already normalised per head; ``gamma`` is the shared per-channel scale
    of the gated RMSNorm.
    """

    def __init__(self, d_model: int, heads: int, head_dim: int, gate: str = "silu") -> None:
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        self.gamma = nn.Parameter(torch.ones(head_dim))
        if gate == "silu":
            self.gate = nn.Linear(d_model, heads * head_dim, bias=False)
        self.out = nn.Linear(heads * head_dim, d_model, bias=False)

    def forward(self, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return self.project(y.to(x.dtype) * self.gamma, x)

    def project(self, y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The output of ``y`` already scaled by ``gamma`` (the NAtS-L merge applies it)."""
        if hasattr(self, "gate"):
            y = y * F.silu(self.gate(x)).view(*x.shape[:-1], self.heads, self.head_dim)
        return self.out(y.flatten(-2))

