"""Route tensors written out by hand, for tests of what reads routes."""

import torch
import torch.nn.functional as F

from nats.kernels.reference.routes import sampled_routes
from nats.layers.routing import sampling_noise


def routes_from_choices(softmax: list) -> torch.Tensor:
    """One-hot routes ``[..., 2]`` (index 0 = softmax) from nested 0/1 softmax choices,
    e.g. ``softmax[b][n][h]`` for a layer's ``[B, N, H, 2]``."""
    s = torch.tensor(softmax, dtype=torch.float32)
    return torch.stack([s, 1 - s], dim=-1)


def sample_routes(logits: torch.Tensor, sampler: str, tau: float, training: bool,
                  generator: torch.Generator | None = None, noise: float = 0.0) -> torch.Tensor:
    """Routes of ``logits`` (no budget) as a layer samples them: its sampler's noise
    (:func:`nats.layers.routing.sampling_noise`), then the straight-through sample."""
    probs = F.softmax(logits, -1)
    return sampled_routes(logits, probs, *sampling_noise(logits, sampler, tau, training,
                                                         generator, noise))
