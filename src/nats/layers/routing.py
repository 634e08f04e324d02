"""The chunk scorer, the samplers that turn its logits into routes, and forced routes.

Routes are ``[B, N, H, 2]`` one-hot tensors (index 0 = softmax, 1 = linear). A sampled
route is ``onehot + (s - stopgrad(s))``: exactly one-hot in value, with the gradient of
the probabilities ``s`` (straight-through).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from statistics import NormalDist
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from nats.kernels import Backend, moments_accumulate, moments_commit
from nats.kernels.reference.chunks import chunk_token_counts, num_chunks
from nats.kernels.reference.routes import RouteBudget, budget_scores

from .norms import upcast

RouteOverride = str | float | torch.Tensor | None
"""``None`` (the scorer decides), ``"softmax"``, ``"linear"``, a softmax fraction in
[0, 1], or a ``[B, N, H, 2]`` / ``[N, H]`` tensor of routes (``[N, H]``: 1 = softmax)."""

OVERRIDE_NAMES = ("softmax", "linear")


def _chunked(x: torch.Tensor, chunk_size: int, fill: float) -> torch.Tensor:
    """``x`` ``[B, T, D]`` as ``[B, N, C, D]``, the last chunk padded with ``fill``."""
    batch, seq_len, dim = x.shape
    n = num_chunks(seq_len, chunk_size)
    return F.pad(x, (0, 0, 0, n * chunk_size - seq_len), value=fill).view(batch, n,
                                                                          chunk_size, dim)


def chunk_mean_pool(x: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """Mean of ``x`` ``[B, T, D]`` over each chunk (a partial last chunk over its tokens)."""
    counts = chunk_token_counts(x.shape[1], chunk_size, x.device).to(x.dtype)
    return _chunked(x, chunk_size, 0.0).sum(2) / counts[None, :, None]


def chunk_max_pool(x: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """Maximum of ``x`` ``[B, T, D]`` per feature over each chunk (a partial last chunk
    over its tokens)."""
    return _chunked(x, chunk_size, -math.inf).amax(2)


def scorer_input(mean: torch.Tensor | None, peak: torch.Tensor | None,
                 pool: str) -> torch.Tensor:
    """The scorer's input from a chunk's mean and maximum (``NatsConfig.scorer_pool``;
    the one it does not read may be ``None``)."""
    if pool == "mean":
        return mean
    if pool == "max":
        return peak
    return torch.cat([mean, peak], -1)


def chunk_pool(x: torch.Tensor, chunk_size: int, pool: str) -> torch.Tensor:
    """The scorer's input for every chunk of ``x`` ``[B, T, D]``."""
    return scorer_input(chunk_mean_pool(x, chunk_size) if pool != "max" else None,
                        chunk_max_pool(x, chunk_size) if pool != "mean" else None, pool)


def pooled_width(d_model: int, pool: str) -> int:
    """Features of the scorer's input."""
    return 2 * d_model if pool == "mean_max" else d_model


class RunningMoments(nn.Module):
    """Running mean and variance of a batch of vectors ``[..., C]`` (the routing's pooled
    chunks and scores; the softmax output's mean square under ``branch_norm="scaled"``).

    Forward passes in training only accumulate the batch's sums; :meth:`commit` (once per
    optimizer step, after the sums of every micro-batch and process are combined) moves
    the running values ``momentum`` of the way toward them. Statistics are therefore the
    same in every forward of a step, whatever the micro-batch split, and the same in
    training, evaluation and decoding.
    """

    def __init__(self, channels: int, momentum: float = 0.1, warm_start: bool = False,
                 backend: Backend = "auto") -> None:
        super().__init__()
        self.momentum, self.backend = momentum, backend
        self.register_buffer("running_mean", torch.zeros(channels))
        self.register_buffer("running_var", torch.ones(channels))
        if warm_start:
            # Commits so far: the first 1 / momentum commits are averaged equally, so the
            # running values are the data's from the first step, not the initial ones'.
            self.register_buffer("commits", torch.zeros(()))
        else:
            self.commits = None
        self.pending: torch.Tensor | None = None
        """``[count, sum (C), sum of squares (C)]`` since the last commit (not a buffer:
        each process holds its own until they are summed). Made by the first
        :meth:`accumulate` and then updated in place: a step captured in a CUDA graph keeps
        adding into the same memory. Moved (a new tensor) only when the statistic moved to
        another device."""

    def accumulate(self, x: torch.Tensor) -> None:
        """Add the rows of ``x`` ``[..., C]`` to the pending sums."""
        moments_accumulate(x, self.sums(x.device), backend=self.backend)

    def sums(self, device: torch.device) -> torch.Tensor:
        """The pending sums, made on ``device`` by the first call."""
        if self.pending is None:
            self.pending = torch.zeros(1 + 2 * self.running_mean.numel(), dtype=torch.float64,
                                       device=device)
        self._follow_device()
        return self.pending

    def _follow_device(self) -> None:
        if self.pending is not None and self.pending.device != self.running_mean.device:
            self.pending = self.pending.to(self.running_mean.device)

    @torch.no_grad()
    def commit(self, reduce: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        """Fold the pending sums (``reduce``-d across processes first) into the running
        values and clear them; a commit that saw no routable chunk changes nothing
        (:func:`nats.kernels.moments_commit`, decided on the device)."""
        if self.pending is None:
            return
        self._follow_device()
        sums = self.pending if reduce is None else reduce(self.pending)
        moments_commit(sums, self.pending, self.running_mean, self.running_var, self.commits,
                       self.momentum, backend=self.backend)

    def standardise(self, x: torch.Tensor, eps: float) -> torch.Tensor:
        """``(x - mean) / sqrt(var + eps)`` with the running values; counts ``x``'s
        routable chunks (``x`` is ``[B, N, ..., C]``, the last chunk left out) while
        training."""
        if self.training and x.shape[1] > 1:
            self.accumulate(x[:, :-1])
        return (x - self.running_mean) * torch.rsqrt(self.running_var + eps)


class ChunkScorer(nn.Module):
    """Bias-free linear on a chunk's pooled input (:func:`chunk_pool`): two logits per
    (chunk, routing head).

    With ``detach`` the route gradient stops at the scorer (``NatsConfig.scorer_detach``).
    With ``norm`` the pooled vector is first centred and scaled per feature by running
    statistics over chunks (:class:`RunningMoments`). Chunk means of a layer's input share
    a large common part; without centring, every step of the scorer's weights along it
    moves all chunks' logits together, which says nothing about which chunk matters and,
    under a budget, makes the threshold chase the drift.
    """

    def __init__(self, d_model: int, n_heads: int, norm: bool = False, detach: bool = False,
                 eps: float = 1e-5, backend: Backend = "auto") -> None:
        super().__init__()
        self.n_heads, self.detach, self.eps = n_heads, detach, eps
        self.proj = nn.Linear(d_model, 2 * n_heads, bias=False)
        self.moments = RunningMoments(d_model, backend=backend) if norm else None

    def forward(self, pooled: torch.Tensor) -> torch.Tensor:
        """``pooled`` ``[B, N, D]`` -> logits ``[B, N, H, 2]``."""
        if self.detach:
            pooled = pooled.detach()
        if self.moments is not None:
            pooled = self.moments.standardise(upcast(pooled), self.eps).to(pooled.dtype)
        return upcast(self.proj(pooled).view(*pooled.shape[:-1], self.n_heads, 2))


class BudgetedScores(nn.Module):
    """Under a softmax budget, turns two logits per chunk into ``[z + bias, 0]``, where
    ``z`` is the logit difference standardised per routing head.

    Without it the scorer's weights drift along whatever every chunk shares (softmax helps
    every chunk a little), the logits grow until their probabilities saturate and the route
    gradient, which passes through ``p (1 - p)``, dies: routes freeze, content-blind, and no
    bias can catch up. Standardised scores keep only how chunks differ, so the scorer
    learns a ranking and the bias alone sets how many go to softmax; the bias starts where
    a Gaussian score meets the target. The statistics are running ones
    (:class:`RunningMoments`), so the share the trainer's controller holds in training is
    the share a trained model routes. While training, the gradient is centred per batch
    (per micro-batch and process, as batch norm's is).
    """

    def __init__(self, n_heads: int, target: float, eps: float = 1e-5,
                 backend: Backend = "auto") -> None:
        super().__init__()
        self.eps = eps
        # One bias per head: training moves them together; a calibration may set them apart
        # (a head that routes content can take the share another head gives up).
        self.register_buffer("route_bias", torch.full((n_heads,), _normal_quantile(target)))
        self.moments = RunningMoments(n_heads, backend=backend)

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str,
                              *args: Any, **kwargs: Any) -> None:
        # Models saved before the bias was per head hold one number per layer.
        key = prefix + "route_bias"
        if key in state_dict and state_dict[key].dim() == 0:
            state_dict[key] = state_dict[key].expand(self.route_bias.shape).clone()
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def state(self, training: bool, device: torch.device) -> RouteBudget:
        """What :func:`nats.kernels.chunk_routes` reads (while ``training``, the pending
        sums it adds to)."""
        return RouteBudget(self.route_bias, self.moments.running_mean,
                           self.moments.running_var, self.eps,
                           self.moments.sums(device) if training else None)

    def forward(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits`` ``[B, N, H, 2]`` -> ``[B, N, H, 2]``
        (:func:`nats.kernels.reference.routes.budget_scores`)."""
        return budget_scores(logits, self.state(self.training, logits.device))


def _normal_quantile(p: float) -> float:
    """The bias ``b`` with ``P(z + b > 0) = p`` for a standard normal ``z``: computed
    without tensors, so that a model can be built on the meta device."""
    return NormalDist().inv_cdf(p)


def sampling_noise(logits: torch.Tensor, sampler: str, tau: float, training: bool,
                   generator: torch.Generator | None = None, noise: float = 0.0,
                   ) -> tuple[torch.Tensor | None, float | None]:
    """The ``noise`` and ``tau`` of :func:`nats.kernels.reference.routes.sampled_routes`
    for routes from ``logits``: the straight-through argmax, or hard Gumbel while training.

    ``noise`` (training only) adds that multiple of Gumbel noise before the argmax: at 1 a
    chunk goes to softmax with the scorer's probability, so routes explore; annealed to 0
    it is the plain argmax. The gradient stays that of the noiseless probabilities.
    """
    if not training:
        return None, None
    if sampler == "gumbel":
        return _gumbel(logits, generator), tau
    if noise <= 0:
        return None, None
    return noise * _gumbel(logits, generator), None


def _gumbel(logits: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    u = torch.rand(logits.shape, generator=generator, device=logits.device,
                   dtype=logits.dtype).clamp_(1e-10, 1 - 1e-7)
    return -torch.log(-torch.log(u))


def fraction_is_softmax(chunk: torch.Tensor, fraction: float) -> torch.Tensor:
    """Evenly spread softmax chunks: chunk ``c`` is softmax iff ``floor((c+1)f) > floor(cf)``.

    Depends on the chunk index only, so it is causal and the same in decoding; over any
    prefix of ``n`` chunks exactly ``floor(n f)`` are softmax.
    """
    return torch.floor((chunk + 1) * fraction) > torch.floor(chunk * fraction)


def forced_routes(override: RouteOverride, batch: int, first_chunk: int | torch.Tensor,
                  n: int, heads: int, device: torch.device) -> torch.Tensor:
    """Routes ``[B, n, H, 2]`` for chunks ``first_chunk .. first_chunk + n - 1``.

    ``first_chunk`` may be a device scalar, which a captured decode step reads at every
    replay; a routes tensor is then not checked to cover the chunks (the host checks it
    with :func:`check_override_covers` before every step).
    """
    chunks = torch.arange(n, device=device) + first_chunk
    if isinstance(override, str):
        if override not in OVERRIDE_NAMES:
            raise ValueError(f"route override must be one of {OVERRIDE_NAMES}, a fraction in "
                             f"[0, 1] or a tensor; got {override!r}")
        is_sm = torch.full((n,), override == "softmax", device=device)
    elif isinstance(override, (int, float)) and not isinstance(override, bool):
        if not 0 <= override <= 1 or math.isnan(override):
            raise ValueError(f"route override fraction must lie in [0, 1], got {override}")
        is_sm = fraction_is_softmax(chunks, float(override))
    elif isinstance(override, torch.Tensor):
        routes = _given_routes(override, batch, heads)
        if isinstance(first_chunk, int):
            check_override_covers(routes, first_chunk + n)
        return routes[:, chunks.to(routes.device)].expand(batch, -1, -1, -1).to(device)
    else:
        raise ValueError(f"route override must be None, 'softmax', 'linear', a fraction or a "
                         f"tensor; got {type(override).__name__}")
    is_sm = is_sm[None, :, None].expand(batch, n, heads)
    return F.one_hot((~is_sm).long(), 2).float()


def check_override_covers(routes: torch.Tensor, chunks: int) -> None:
    """Raise unless the routes tensor ``routes`` (``[N, H]`` or ``[B, N, H, 2]``) gives
    the first ``chunks`` chunks."""
    if routes.dim() not in (2, 4):
        raise ValueError(f"a route override tensor must be [N, H] or [B, N, H, 2]; got "
                         f"{list(routes.shape)}")
    given = routes.shape[0] if routes.dim() == 2 else routes.shape[1]
    if chunks > given:
        raise ValueError(f"the route override covers {given} chunks; the input needs {chunks}")


def _given_routes(routes: torch.Tensor, batch: int, heads: int) -> torch.Tensor:
    """A routes tensor as ``[B or 1, N, H, 2]`` floats."""
    if routes.dim() == 2:  # [N, H], 1 = softmax
        routes = F.one_hot((routes[None] <= 0.5).long(), 2)
    if routes.dim() != 4 or routes.shape[2] != heads or routes.shape[3] != 2 \
            or routes.shape[0] not in (1, batch):
        raise ValueError(f"a route override tensor must be [N, H={heads}] or "
                         f"[B={batch}, N, H={heads}, 2]; got {list(routes.shape)}")
    return routes.float()
