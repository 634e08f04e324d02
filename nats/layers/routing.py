"""The chunk scorer, the samplers that turn its logits into routes, and forced routes.

Routes are ``[B, N, H, 2]`` one-hot tensors (index 0 = softmax, 1 = linear). A sampled
route is ``onehot + (s - stopgrad(s))``: exactly one-hot in value, with the gradient of
the probabilities ``s`` (straight-through).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from nats.kernels.reference.chunks import SOFTMAX, num_chunks

from .norms import upcast

RouteOverride = str | float | torch.Tensor | None
"""``None`` (the scorer decides), ``"softmax"``, ``"linear"``, a softmax fraction in
[0, 1], or a ``[B, N, H, 2]`` / ``[N, H]`` tensor of routes (``[N, H]``: 1 = softmax)."""

OVERRIDE_NAMES = ("softmax", "linear")


def chunk_mean_pool(x: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """Mean of ``x`` ``[B, T, D]`` over each chunk (a partial last chunk over its tokens)."""
    batch, seq_len, dim = x.shape
    n = num_chunks(seq_len, chunk_size)
    padded = F.pad(x, (0, 0, 0, n * chunk_size - seq_len)).view(batch, n, chunk_size, dim)
    counts = torch.full((n,), float(chunk_size), device=x.device, dtype=x.dtype)
    counts[-1] = seq_len - (n - 1) * chunk_size
    return padded.sum(2) / counts[None, :, None]


class ChunkScorer(nn.Module):
    """Mean pool + bias-free linear: two logits per (chunk, routing head)."""

    def __init__(self, d_model: int, n_heads: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.proj = nn.Linear(d_model, 2 * n_heads, bias=False)

    def forward(self, pooled: torch.Tensor) -> torch.Tensor:
        """``pooled`` ``[B, N, D]`` -> logits ``[B, N, H, 2]``."""
        return upcast(self.proj(pooled).view(*pooled.shape[:-1], self.n_heads, 2))


def straight_through(probs: torch.Tensor) -> torch.Tensor:
    """One-hot of the argmax in value (exactly: ``probs - probs.detach()`` is 0), gradient
    of ``probs``."""
    hard = F.one_hot(probs.argmax(-1), 2).to(probs.dtype)
    return hard + (probs - probs.detach())


def sample_routes(logits: torch.Tensor, sampler: str, tau: float, training: bool,
                  generator: torch.Generator | None = None) -> torch.Tensor:
    """Routes from scorer logits: straight-through argmax, or hard Gumbel while training."""
    if sampler == "gumbel" and training:
        u = torch.rand(logits.shape, generator=generator, device=logits.device,
                       dtype=logits.dtype).clamp_(1e-10, 1 - 1e-7)
        return straight_through(F.softmax((logits - torch.log(-torch.log(u))) / tau, -1))
    return straight_through(F.softmax(logits, -1))


def fraction_is_softmax(chunk: torch.Tensor, fraction: float) -> torch.Tensor:
    """Evenly spread softmax chunks: chunk ``c`` is softmax iff ``floor((c+1)f) > floor(cf)``.

    Depends on the chunk index only, so it is causal and the same in decoding; over any
    prefix of ``n`` chunks exactly ``floor(n f)`` are softmax.
    """
    return torch.floor((chunk + 1) * fraction) > torch.floor(chunk * fraction)


def forced_routes(override: RouteOverride, batch: int, first_chunk: int, n: int, heads: int,
                  device: torch.device) -> torch.Tensor:
    """Routes ``[B, n, H, 2]`` for chunks ``first_chunk .. first_chunk + n - 1``."""
    chunks = torch.arange(first_chunk, first_chunk + n, device=device)
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
        return _slice_given_routes(override, batch, chunks, heads).to(device)
    else:
        raise ValueError(f"route override must be None, 'softmax', 'linear', a fraction or a "
                         f"tensor; got {type(override).__name__}")
    is_sm = is_sm[None, :, None].expand(batch, n, heads)
    return F.one_hot((~is_sm).long(), 2).float()


def _slice_given_routes(routes: torch.Tensor, batch: int, chunks: torch.Tensor,
                        heads: int) -> torch.Tensor:
    if routes.dim() == 2:  # [N, H], 1 = softmax
        routes = F.one_hot((routes[None] <= 0.5).long(), 2).float().expand(batch, -1, -1, -1)
    if routes.dim() != 4 or routes.shape[2] != heads or routes.shape[3] != 2 \
            or routes.shape[0] not in (1, batch):
        raise ValueError(f"a route override tensor must be [N, H={heads}] or "
                         f"[B={batch}, N, H={heads}, 2]; got {list(routes.shape)}")
    if int(chunks[-1]) >= routes.shape[1]:
        raise ValueError(f"the route override covers {routes.shape[1]} chunks; the input "
                         f"needs {int(chunks[-1]) + 1}")
    return routes[:, chunks.to(routes.device)].expand(batch, -1, -1, -1).float()


def softmax_fraction(routes: torch.Tensor) -> torch.Tensor:
    """Fraction of chunks routed to softmax, per routing head ``[H]``."""
    return routes[..., SOFTMAX].detach().float().mean((0, 1))
