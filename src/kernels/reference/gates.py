"""The linear operators' per-token gates from their projections (plain PyTorch), in float32.

Decay ``g = -exp(A_log) softplus(a + dt_bias)`` (Mamba2's parameterisation: a log decay
in ``(-inf, 0)``) and write strength ``beta = sigmoid(b)``; an operator has the ones it
uses (``nats.layers.linear_ops``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .chunks import compute_dtype


def linear_gates(a: torch.Tensor | None, a_log: torch.Tensor | None,
                 dt_bias: torch.Tensor | None, b: torch.Tensor | None,
                 ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``(g, beta)`` over ``[..., H]`` projections ``a`` and ``b`` (either may be None, and
    ``a_log`` and ``dt_bias`` ``[H]`` go with ``a``), each float32 (float64 for float64
    inputs) or None where its projection is."""
    g = beta = None
    if a is not None:
        dt = compute_dtype(a)
        g = -a_log.to(dt).exp() * F.softplus(a.to(dt) + dt_bias.to(dt))
    if b is not None:
        beta = torch.sigmoid(b.to(compute_dtype(b)))
    return g, beta
