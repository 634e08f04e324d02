"""From the scorer's logits to a NAtS-L layer's routes and their statistics (plain
PyTorch): the budget's standardised scores, the straight-through sample, the scorer's
probabilities, and what a layer reports of one forward pass.

Routes are ``[B, N, H, 2]`` one-hot tensors (index 0 = softmax, 1 = linear). A sampled
route is ``onehot + (s - stopgrad(s))``: exactly one-hot in value, with the gradient of
the probabilities ``s`` (straight-through). The budget and the sampler's options are
described where a layer keeps their state (``nats.layers.routing``).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from .chunks import SOFTMAX, check_route_chunks, chunk_token_counts
from .moments import moments_accumulate


class RouteBudget(NamedTuple):
    """A budgeted layer's state: per routing head ``[H]`` the threshold ``bias`` and the
    running mean and variance of the logit difference; ``pending`` (``[1 + 2H]`` float64
    sums, training only) takes the batch's routable chunks, and its presence also centres
    the batch's gradient."""

    bias: torch.Tensor
    running_mean: torch.Tensor
    running_var: torch.Tensor
    eps: float
    pending: torch.Tensor | None


class ChunkRoutes(NamedTuple):
    """What :func:`chunk_routes` decided: ``routes`` and ``probs`` ``[B, N, H, 2]``,
    ``reg`` the mean softmax probability of the routable chunks (0 for one chunk),
    ``attn_frac`` ``[H]`` the token-weighted softmax fraction and ``routable_frac`` the
    share of routable chunks sent to softmax (NaN for one chunk). A sequence's last chunk
    is not routable: no query sees its route."""

    routes: torch.Tensor
    probs: torch.Tensor
    reg: torch.Tensor
    attn_frac: torch.Tensor
    routable_frac: torch.Tensor


def budget_scores(logits: torch.Tensor, budget: RouteBudget) -> torch.Tensor:
    """``[z + bias, 0]`` per chunk, ``z`` the logit difference standardised by the running
    statistics. While training (``budget.pending``) the batch's routable differences are
    added to the pending sums, and the gradient is that of the differences centred on
    their batch mean per head: the value is unchanged (``mean - mean.detach()`` is 0), and
    the part of the scorer's gradient that every chunk shares, which would only move all
    scores together, is gone (without it concentrated recall was not learned:
    docs/RESULTS.md)."""
    d = logits[..., 0] - logits[..., 1]
    if budget.pending is not None and d.shape[1] > 1:
        mean = d[:, :-1].mean((0, 1))
        d = d - (mean - mean.detach())
        moments_accumulate(d[:, :-1], budget.pending)
    z = (d - budget.running_mean) * torch.rsqrt(budget.running_var + budget.eps)
    return torch.stack([z + budget.bias, torch.zeros_like(z)], -1)


def sampled_routes(logits: torch.Tensor, probs: torch.Tensor, noise: torch.Tensor | None = None,
                   tau: float | None = None) -> torch.Tensor:
    """Straight-through routes: the argmax of ``probs`` (``softmax(logits)``); with
    ``noise``, the argmax of ``logits + noise`` with the gradient of ``probs``; with
    ``noise`` and ``tau``, the hard Gumbel sample of ``softmax((logits + noise) / tau)``
    with that softmax's gradient. A tie goes to softmax."""
    if noise is None:
        soft = probs
        hard = probs.argmax(-1)
    elif tau is None:
        soft = probs
        hard = (logits + noise).argmax(-1)
    else:
        soft = F.softmax((logits + noise) / tau, -1)
        hard = soft.argmax(-1)
    return F.one_hot(hard, 2).to(soft.dtype) + (soft - soft.detach())


def softmax_fraction(routes: torch.Tensor, seq_len: int, chunk_size: int) -> torch.Tensor:
    """Per routing head ``[H]``, the softmax fraction of ``routes`` ``[B, N, H, 2]``: the
    share of tokens in chunks routed to softmax, a partial last chunk by its tokens (a
    float tensor on the routes' device: no transfer to the host)."""
    counts = chunk_token_counts(seq_len, chunk_size, routes.device)
    check_route_chunks(routes, counts.numel(), seq_len, chunk_size)
    is_sm = routes[..., SOFTMAX].detach().float()
    return (is_sm * counts[None, :, None]).sum((0, 1)) / (routes.shape[0] * seq_len)


def chunk_routes(logits: torch.Tensor, seq_len: int, chunk_size: int,
                 budget: RouteBudget | None = None, forced: torch.Tensor | None = None,
                 noise: torch.Tensor | None = None, tau: float | None = None) -> ChunkRoutes:
    """Routes of ``[B, N, H, 2]`` scorer ``logits`` for ``seq_len`` tokens in chunks of
    ``chunk_size``: under a ``budget``, of its scores (:func:`budget_scores`); ``forced``
    routes ``[B, N, H, 2]`` are taken as given (no route gradient), else sampled
    (:func:`sampled_routes` with ``noise`` and ``tau``)."""
    if budget is not None:
        logits = budget_scores(logits, budget)
    probs = F.softmax(logits, -1)
    routes = forced if forced is not None else sampled_routes(logits, probs, noise, tau)
    routable = slice(0, routes.shape[1] - 1)
    reg = probs[:, routable, :, SOFTMAX].mean() if routes.shape[1] > 1 else probs.new_zeros(())
    return ChunkRoutes(routes, probs, reg, softmax_fraction(routes, seq_len, chunk_size),
                       routes[:, routable, :, SOFTMAX].detach().float().mean())
