"""Route tensors written out by hand, for tests of what reads routes."""

import torch


def routes_from_choices(softmax: list) -> torch.Tensor:
    """One-hot routes ``[..., 2]`` (index 0 = softmax) from nested 0/1 softmax choices,
    e.g. ``softmax[b][n][h]`` for a layer's ``[B, N, H, 2]``."""
    s = torch.tensor(softmax, dtype=torch.float32)
    return torch.stack([s, 1 - s], dim=-1)
