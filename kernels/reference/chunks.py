"""Chunk bookkeeping and input checks shared by every hybrid operator."""

from __future__ import annotations

import itertools
import math
from typing import Literal

import torch

CHUNK_SIZES = (16, 32, 64, 128, 256)
"""Routing chunk sizes the operators support (powers of two, as NATSL.md defines)."""

RouteGrad = Literal["selected", "both"]
ROUTE_GRADS = ("selected", "both")

SOFTMAX, LINEAR = 0, 1
"""Indices of the two options in the last dimension of a routes tensor."""


def num_chunks(seq_len: int, chunk_size: int) -> int:
    """Number of chunks covering ``seq_len`` tokens; the last one may be partial."""
    return math.ceil(seq_len / chunk_size)


def chunk_ids(seq_len: int, chunk_size: int, device: torch.device | None = None) -> torch.Tensor:
    """Chunk index of every position, ``[T]``."""
    return torch.arange(seq_len, device=device) // chunk_size


def check_chunk_size(chunk_size: int) -> None:
    if chunk_size not in CHUNK_SIZES:
        raise ValueError(f"chunk_size must be one of {CHUNK_SIZES}, got {chunk_size!r}")


def check_routes(routes: torch.Tensor, batch: int, seq_len: int, chunk_size: int,
                 heads: int | None = None) -> int:
    """Check ``routes`` is ``[B, N, H, 2]`` for this batch and length; return ``H``."""
    n = num_chunks(seq_len, chunk_size)
    if routes.dim() != 4 or tuple(routes.shape[:2]) != (batch, n) or routes.shape[3] != 2:
        raise ValueError(
            f"routes must have shape [B={batch}, N={n}, H, 2] for T={seq_len} and "
            f"chunk_size={chunk_size}, got {list(routes.shape)}"
        )
    if heads is not None and routes.shape[2] != heads:
        raise ValueError(f"routes has {routes.shape[2]} routing heads, expected {heads}")
    return routes.shape[2]


def packed_lengths(cu_seqlens: torch.Tensor, batch: int, total: int) -> list[int]:
    """Check packed-batch offsets (FlashAttention convention); return the sequence lengths."""
    if batch != 1:
        raise ValueError(f"cu_seqlens needs a batch of 1 (sequences packed along T), got {batch}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 or cu_seqlens.is_floating_point():
        raise ValueError(f"cu_seqlens must be 1-D integer offsets [n_seq + 1], got "
                         f"{cu_seqlens.dtype} {list(cu_seqlens.shape)}")
    offsets = cu_seqlens.tolist()
    lengths = [b - a for a, b in itertools.pairwise(offsets)]
    if offsets[0] != 0 or offsets[-1] != total or min(lengths) <= 0:
        raise ValueError(f"cu_seqlens must rise strictly from 0 to T={total}, got {offsets}")
    return lengths


def packed_chunk_counts(routes: torch.Tensor, lengths: list[int], chunk_size: int) -> list[int]:
    """Chunks of each packed sequence, after checking routes is ``[1, N_total, H, 2]``."""
    check_chunk_size(chunk_size)
    counts = [num_chunks(n, chunk_size) for n in lengths]
    if routes.dim() != 4 or routes.shape[0] != 1 or routes.shape[1] != sum(counts) \
            or routes.shape[3] != 2:
        raise ValueError(f"routes must be [1, {sum(counts)}, H, 2] for sequences of lengths "
                         f"{lengths} in chunks of {chunk_size}, got {list(routes.shape)}")
    return counts


def route_weight(route: torch.Tensor, route_grad: RouteGrad) -> torch.Tensor:
    """The 0/1 weight of one option, with the gradient NATSL.md asks for.

    ``"both"`` keeps the true derivative at every chunk. ``"selected"`` keeps it only
    where the option was chosen (weight 1) and cuts it where it was not, which is what
    the straight-through estimator of the paper uses.
    """
    if route_grad not in ROUTE_GRADS:
        raise ValueError(f"route_grad must be one of {ROUTE_GRADS}, got {route_grad!r}")
    if route_grad == "both":
        return route
    return torch.where(route.detach() > 0.5, route, route.detach())


def weighted_exp(shifted: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``weights * exp(shifted)`` where ``shifted`` is a score minus the max over keys with
    weight > 0.

    Keys of weight 0 (chunks routed to linear) may score far above that max; their
    exponent is capped so that ``0 * exp`` stays 0 rather than ``0 * inf = NaN``. Only
    the ``"both"`` route gradient at such a key, which would exceed ``exp(cap)``, is
    capped.
    """
    cap = 0.5 * math.log(torch.finfo(shifted.dtype).max)
    return weights * torch.exp(torch.where(weights.detach() > 0, shifted, shifted.clamp(max=cap)))


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """References compute in float32, or float64 when given float64 (for gradcheck)."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32
