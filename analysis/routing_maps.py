"""Routing maps: which chunks each head sent to softmax attention, as numbers and as pixels.

A map has one column per chunk (position runs left to right) and one row per (sequence,
routing head), sequence-major, so a glance shows where in the sequence and in which heads
the search keeps softmax.
"""

from __future__ import annotations

import numpy as np
import torch

from nats.kernels import SOFTMAX

SOFTMAX_RGB = (255, 170, 30)
"""Colour of a chunk routed to softmax attention (kept in the KV cache)."""
LINEAR_RGB = (30, 60, 140)
"""Colour of a chunk routed to linear attention (written into the state)."""


def routing_map(routes: torch.Tensor) -> torch.Tensor:
    """``[B*H, N]`` boolean map, True where a chunk went to softmax, from ``[B, N, H, 2]``."""
    if routes.dim() != 4 or routes.shape[-1] != 2:
        raise ValueError(f"routes must have shape [B, N, H, 2], got {list(routes.shape)}")
    sm = routes[..., SOFTMAX].detach() > 0.5  # [B, N, H]
    return sm.permute(0, 2, 1).reshape(-1, routes.shape[1]).cpu()


def routing_map_image(routes: torch.Tensor, min_size: int = 256,
                      max_size: int = 2048) -> np.ndarray:
    """RGB ``uint8`` image ``[height, width, 3]`` of :func:`routing_map`.

    Each cell is upscaled by the same whole factor (nearest neighbour, no blur) until the
    image's shorter side reaches ``min_size`` pixels, because TensorBoard shows raw pixels;
    the factor stops growing where the longer side would pass ``max_size``.
    """
    grid = routing_map(routes).numpy()
    scale = max(1, min(-(-min_size // min(grid.shape)), max_size // max(grid.shape)))
    image = np.where(grid[..., None], np.array(SOFTMAX_RGB, np.uint8),
                     np.array(LINEAR_RGB, np.uint8))
    return image.repeat(scale, axis=0).repeat(scale, axis=1)
