"""Row normalisations over the last dimension (plain PyTorch), computed in float32.

``rms_norm`` divides by the root mean square, ``l2_norm`` by the L2 norm; both return the
input's dtype, with a learned per-channel ``weight`` applied before that one rounding.
"""

from __future__ import annotations

import torch

from .chunks import compute_dtype


def _unit_rms(xf: torch.Tensor, eps: float) -> torch.Tensor:
    """``xf / sqrt(mean(xf^2) + eps)`` over the last dimension, in ``xf``'s dtype."""
    return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None = None,
             eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(mean(x^2) + eps) * weight`` over the last dimension."""
    y = _unit_rms(x.to(compute_dtype(x)), eps)
    return (y if weight is None else y * weight).to(x.dtype)


def l2_norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + eps)`` over the last dimension (unit vectors)."""
    xf = x.to(compute_dtype(x))
    return (xf * torch.rsqrt(xf.pow(2).sum(-1, keepdim=True) + eps)).to(x.dtype)


def _rms_and_l2_norm(x: torch.Tensor, weight: torch.Tensor, parts: int, rms_eps: float,
                     l2_eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    sub = x.reshape(*x.shape[:-2], x.shape[-2] * parts, x.shape[-1] // parts)
    return rms_norm(sub, weight, rms_eps), l2_norm(x, l2_eps)


def qk_norms(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
             parts: int, q_eps: float, k_eps: float, l2_eps: float,
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The four norms a NAtS-L layer takes of its shared q and k ``[..., H, D]``: of each,
    the RMS norm (times its weight ``[D / parts]``, with its eps) of each of its ``parts``
    sub-heads, as ``[..., H * parts, D / parts]`` (the softmax heads), and the L2 norm of
    each head (the linear heads). Returns ``(q_rms, q_l2, k_rms, k_l2)``."""
    return (*_rms_and_l2_norm(q, q_weight, parts, q_eps, l2_eps),
            *_rms_and_l2_norm(k, k_weight, parts, k_eps, l2_eps))


def merge_branches(a: torch.Tensor, b: torch.Tensor, weights: torch.Tensor,
                   gamma: torch.Tensor, eps: float, norm_a: bool, norm_b: bool,
                   out_dtype: torch.dtype, gamma_b: torch.Tensor | None = None,
                   logits: bool = False) -> torch.Tensor:
    """``(w_a N(a) + w_b N(b)) * gamma`` per row, ``N`` the RMS norm where asked (else the
    identity): the NAtS-L layer's merge of its two branches. With ``gamma_b``, each branch
    has its own weight: ``w_a N(a) gamma + w_b N(b) gamma_b`` (the official layer's
    ``FusedMultiInputRMSNormGated``).

    ``a``, ``b`` ``[..., D]``, ``weights`` ``[..., 2]`` (``w_a``, ``w_b``; with ``logits``,
    the weights are their softmax), ``gamma`` and ``gamma_b`` ``[D]``; returned in
    ``out_dtype``.
    """
    if logits:
        weights = torch.softmax(weights.to(compute_dtype(weights)), -1)
    af, bf = (t.to(compute_dtype(t)) for t in (a, b))
    af = _unit_rms(af, eps) if norm_a else af
    bf = _unit_rms(bf, eps) if norm_b else bf
    if gamma_b is not None:
        return (weights[..., :1] * af * gamma + weights[..., 1:] * bf * gamma_b).to(out_dtype)
    return ((weights[..., :1] * af + weights[..., 1:] * bf) * gamma).to(out_dtype)
