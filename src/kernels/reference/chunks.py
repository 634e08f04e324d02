"""Chunk bookkeeping and input checks shared by every hybrid operator."""

from __future__ import annotations

import itertools
import math
from typing import Literal

import torch
import torch.nn.functional as F

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


def chunk_token_counts(seq_len: int, chunk_size: int,
                       device: torch.device | str | None = None) -> torch.Tensor:
    """Tokens in each chunk of a sequence, ``[N]`` (long): ``chunk_size`` each, the last one
    what is left.

    Computed on ``device``: writing the last count in from the host would copy a scalar
    to the GPU, which waits for the GPU to finish its queued work, in every forward.
    """
    starts = torch.arange(num_chunks(seq_len, chunk_size), device=device) * chunk_size
    return (seq_len - starts).clamp_(max=chunk_size)


def check_route_chunks(routes: torch.Tensor, n_chunks: int, seq_len: int,
                       chunk_size: int) -> None:
    """That ``routes`` ``[B, N, H, 2]`` have one route per chunk of ``seq_len`` tokens."""
    if routes.shape[1] != n_chunks:
        raise ValueError(f"routes cover {routes.shape[1]} chunks; {seq_len} tokens in chunks "
                         f"of {chunk_size} make {n_chunks}")


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

    Keys of weight 0 (chunks routed to linear, the future) may score far above that max;
    their exponent is capped so that ``0 * exp`` stays 0 rather than ``0 * inf = NaN``.
    Keys of weight > 0 are at most 0 and never reach the cap, so only the ``"both"`` route
    gradient at a weight-0 key that would exceed ``exp(cap)`` is capped.
    """
    cap = 0.5 * math.log(torch.finfo(shifted.dtype).max)
    return weights * torch.exp(shifted.clamp(max=cap))


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """References compute in float32, or float64 when given float64 (for gradcheck)."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def pad_to_chunks(x: torch.Tensor, chunk_size: int, dtype: torch.dtype) -> torch.Tensor:
    """``[B, T, H, ...]`` -> ``[B, H, N, C, ...]`` in ``dtype``, zero-padded at the end.

    Zero padding is neutral for every linear operator: a padded token has ``g = 0`` (no
    decay), ``beta = 0`` or ``k = 0`` (no write), so the final state is unchanged.
    """
    batch, seq_len, heads = x.shape[:3]
    n = num_chunks(seq_len, chunk_size)
    pad = [0, 0] * (x.dim() - 2) + [0, n * chunk_size - seq_len]
    x = F.pad(x.to(dtype), pad).movedim(2, 1)
    return x.reshape(batch, heads, n, chunk_size, *x.shape[3:])


def check_token_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       gates: dict[str, torch.Tensor], initial_state: torch.Tensor | None,
                       ) -> tuple[int, int, int, int]:
    """Shapes of a linear operator's inputs; returns ``(B, T, H, Dk)``.

    ``gates`` are the per-token scalars (``g``, ``beta``) of shape ``[B, T, H]``.
    """
    if q.dim() != 4 or q.shape != k.shape:
        raise ValueError(f"q and k must both be [B, T, H, Dk]; got {list(q.shape)} and "
                         f"{list(k.shape)}")
    batch, seq_len, heads, d_k = q.shape
    if v.dim() != 4 or v.shape[:3] != q.shape[:3]:
        raise ValueError(f"v must be [B, T, H, Dv] matching q {list(q.shape)}; got {list(v.shape)}")
    for name, x in gates.items():
        if x.shape != q.shape[:3]:
            raise ValueError(f"{name} must be [B, T, H] = {list(q.shape[:3])}, got {list(x.shape)}")
    if initial_state is not None and initial_state.shape != (batch, heads, d_k, v.shape[-1]):
        raise ValueError(f"initial_state must be [B, H, Dk, Dv] = "
                         f"{[batch, heads, d_k, v.shape[-1]]}, got {list(initial_state.shape)}")
    return batch, seq_len, heads, d_k


def run_packed(op, tokens: tuple[torch.Tensor, ...], routes: torch.Tensor, chunk_size: int,
               initial_state: torch.Tensor | None, output_final_state: bool,
               cu_seqlens: torch.Tensor, **kwargs) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A packed batch (``cu_seqlens``, batch of 1) through the dense operator ``op``, one
    sequence at a time: obviously right, and the same for every linear operator.

    ``op(*tokens, routes, chunk_size, initial_state=..., output_final_state=..., **kwargs)``;
    ``tokens`` are ``[1, T_total, H, ...]``, the states ``[n_seq, H, ...]``.
    """
    lengths = packed_lengths(cu_seqlens, tokens[0].shape[0], tokens[0].shape[1])
    counts = packed_chunk_counts(routes, lengths, chunk_size)
    if initial_state is not None and initial_state.shape[0] != len(lengths):
        raise ValueError(f"initial_state must have one state per sequence ({len(lengths)}), "
                         f"got {list(initial_state.shape)}")
    token_parts = [x.split(lengths, 1) for x in tokens]
    route_parts = routes.split(counts, 1)
    outs, states = [], []
    for i in range(len(lengths)):
        h0 = None if initial_state is None else initial_state[i : i + 1]
        o, state = op(*(p[i] for p in token_parts), route_parts[i], chunk_size,
                      initial_state=h0, output_final_state=output_final_state, **kwargs)
        outs.append(o)
        states.append(state)
    return torch.cat(outs, 1), torch.cat(states) if output_final_state else None
