"""RMS normalisation with a learned scale, and the float32 upcast the layers share.

The normalisations themselves are kernels (``nats.kernels.rms_norm`` / ``l2_norm``): the
plain form on a CPU, one fused Triton launch on a GPU.
"""

from __future__ import annotations

import torch
from torch import nn

from nats.kernels import Backend, rms_norm
from nats.kernels.reference.chunks import compute_dtype


def upcast(x: torch.Tensor) -> torch.Tensor:
    """At least float32 for reductions and gates; float64 stays float64 (for exact tests)."""
    return x.to(compute_dtype(x))


class RMSNorm(nn.Module):
    """RMSNorm with a learned per-channel scale (shared across heads when applied per head).

    The output keeps the input's dtype: under autocast a float32 weight would otherwise
    promote bf16 activations, and the kernels need q, k and v in one dtype.
    """

    def __init__(self, dim: int, eps: float, backend: Backend = "auto") -> None:
        super().__init__()
        self.eps, self.backend = eps, backend
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps, backend=self.backend)
