"""Row normalisations over the last dimension (plain PyTorch), computed in float32.

``rms_norm`` divides by the root mean square, ``l2_norm`` by the L2 norm; both return the
input's dtype, with a learned per-channel ``weight`` applied before that one rounding.
"""

from __future__ import annotations

import torch

from .chunks import compute_dtype


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None = None,
             eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(mean(x^2) + eps) * weight`` over the last dimension."""
    xf = x.to(compute_dtype(x))
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y if weight is None else y * weight).to(x.dtype)


def l2_norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + eps)`` over the last dimension (unit vectors)."""
    xf = x.to(compute_dtype(x))
    return (xf * torch.rsqrt(xf.pow(2).sum(-1, keepdim=True) + eps)).to(x.dtype)


def merge_branches(a: torch.Tensor, b: torch.Tensor, weights: torch.Tensor,
                   gamma: torch.Tensor, eps: float, norm_a: bool, norm_b: bool,
                   out_dtype: torch.dtype) -> torch.Tensor:
    """``(w_a N(a) + w_b N(b)) * gamma`` per row, ``N`` the RMS norm where asked (else the
    identity): the NAtS-L layer's merge of its two branches.

    ``a``, ``b`` ``[..., D]``, ``weights`` ``[..., 2]`` (``w_a``, ``w_b``), ``gamma`` ``[D]``;
    returned in ``out_dtype``.
    """
    af, bf = (t.to(compute_dtype(t)) for t in (a, b))
    if norm_a:
        af = af * torch.rsqrt(af.pow(2).mean(-1, keepdim=True) + eps)
    if norm_b:
        bf = bf * torch.rsqrt(bf.pow(2).mean(-1, keepdim=True) + eps)
    return ((weights[..., :1] * af + weights[..., 1:] * bf) * gamma).to(out_dtype)
