"""Rotary position embedding (half-split layout) from an explicit first position."""

from __future__ import annotations

import torch

from .norms import upcast


def apply_rotary(x: torch.Tensor, start: int | torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate ``x`` ``[B, T, heads, D]`` as tokens ``start .. start + T - 1``.

    The first position is explicit so that a decode step at position ``p`` matches the
    parallel form exactly; decoding passes it as a device scalar (no host read).
    """
    half = x.shape[-1] // 2
    inv_freq = theta ** (-torch.arange(half, device=x.device, dtype=torch.float32) / half)
    positions = torch.arange(x.shape[1], device=x.device, dtype=torch.float32) + start
    angles = positions[:, None] * inv_freq[None, :]  # [T, half]
    cos, sin = angles.cos()[None, :, None, :], angles.sin()[None, :, None, :]
    x1, x2 = upcast(x)[..., :half], upcast(x)[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).to(x.dtype)
