"""Running moments of the routing's statistics (plain PyTorch): a training forward adds
its rows to pending float64 sums, and a commit once per optimizer step moves the running
mean and variance toward them (``nats.layers.routing.RunningMoments`` says why)."""

from __future__ import annotations

import torch


def moments_accumulate(x: torch.Tensor, pending: torch.Tensor) -> None:
    """Add the rows of ``x`` ``[..., C]`` to ``pending`` ``[count, sum (C), sum of squares
    (C)]`` (float64, in place)."""
    x = x.detach().reshape(-1, x.shape[-1]).double()
    pending.add_(torch.cat([x.new_full((1,), x.shape[0]), x.sum(0), x.square().sum(0)]))


def moments_commit(sums: torch.Tensor, pending: torch.Tensor, running_mean: torch.Tensor,
                   running_var: torch.Tensor, commits: torch.Tensor | None,
                   momentum: float) -> None:
    """Move ``running_mean`` and ``running_var`` ``[C]`` toward the mean and variance of
    ``sums`` (``pending``, or its sum over processes) by ``momentum`` (with ``commits``,
    a count of the commits that saw rows: by ``max(1 / commits, momentum)``, so the first
    commits average equally), then zero ``pending``. A commit of no rows changes nothing.

    Decided on the device (a weight of 0), not by reading the count back: that would
    wait for the GPU once per statistic and step, and cannot be captured in a graph."""
    count, channels = sums[0], running_mean.numel()
    seen = count >= 1
    mean = sums[1: 1 + channels] / count.clamp_min(1)
    var = (sums[1 + channels:] / count.clamp_min(1) - mean.square()).clamp_min(0)
    weight = torch.full_like(running_mean[:1], momentum)
    if commits is not None:
        commits += seen
        weight = commits.reciprocal().clamp_min(momentum)
    weight = torch.where(seen, weight, 0.0).to(running_mean.dtype)
    running_mean.lerp_(mean.to(running_mean.dtype), weight)
    running_var.lerp_(var.to(running_var.dtype), weight)
    pending.zero_()
