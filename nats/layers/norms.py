"""RMS normalisation, with and without a learned scale."""

from __future__ import annotations

import torch
from torch import nn

from nats.kernels.reference.chunks import compute_dtype


def upcast(x: torch.Tensor) -> torch.Tensor:
    """At least float32 for reductions and gates; float64 stays float64 (for exact tests)."""
    return x.to(compute_dtype(x))


def rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """Normalise the last dimension to unit RMS, computed in float32."""
    xf = upcast(x)
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class RMSNorm(nn.Module):
    """RMSNorm with a learned per-channel scale (shared across heads when applied per head).

    The output keeps the input's dtype: under autocast a float32 weight would otherwise
    promote bf16 activations, and the kernels need q, k and v in one dtype.
    """

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (rms_norm(x, self.eps) * self.weight).to(x.dtype)


def l2_norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Unit L2 norm over the last dimension (linear heads' q and k, as NATSL.md says)."""
    xf = upcast(x)
    return (xf * torch.rsqrt(xf.pow(2).sum(-1, keepdim=True) + eps)).to(x.dtype)
