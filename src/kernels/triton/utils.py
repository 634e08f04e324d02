"""Helpers shared by the Triton kernels: interpreter detection, launch configs, chunk maps.

Everything here runs as torch ops on the tensors' device and never reads a value back
to the host. The one synchronisation is the first map of each dense batch shape, which is
cached (:func:`_dense_chunk_map`).
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch
import triton

from ..reference.chunks import LINEAR, check_chunk_size, check_routes

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
"""True when Triton runs kernels on the CPU (``TRITON_INTERPRET=1``), decided at import."""

POISON_OUTPUTS = False
"""Tests set this to fill every kernel output with NaN first, so unwritten elements show."""


def autotune_configs(configs: list[triton.Config], interpreted: triton.Config,
                     ) -> list[triton.Config]:
    """``configs`` on the GPU; only ``interpreted`` under the interpreter (which cannot tune)."""
    return [interpreted] if INTERPRET else configs


def empty(*shape: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An output buffer every element of which a kernel must write (NaN when poisoning)."""
    out = torch.empty(shape, dtype=dtype, device=device)
    return out.fill_(float("nan")) if POISON_OUTPUTS else out


def is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


class ChunkMap(NamedTuple):
    """Where each routing chunk lives in a packed ``[1, T_total, ...]`` batch.

    ``cu_seqlens`` ``[S+1]`` token offsets of the sequences, ``chunk_offsets`` ``[S+1]``
    their first global chunk, ``chunk_seq`` ``[N_total]`` the sequence of every chunk.
    A dense batch ``[B, T]`` is the packed batch of ``B`` sequences of length ``T``.
    """

    cu_seqlens: torch.Tensor
    chunk_offsets: torch.Tensor
    chunk_seq: torch.Tensor


def chunk_map(batch: int, seq_len: int, n_chunks: int, chunk_size: int, device: torch.device,
              cu_seqlens: torch.Tensor | None = None) -> ChunkMap:
    """The :class:`ChunkMap` of a dense batch, or of the packed sequences of ``cu_seqlens``.

    ``n_chunks`` is the total number of chunks (``routes.shape[1]`` times ``batch``).
    """
    if cu_seqlens is None:
        return _dense_chunk_map(batch, seq_len, n_chunks, torch.device(device))
    i32 = dict(dtype=torch.int32, device=device)
    cu = cu_seqlens.to(**i32)
    per_seq = (cu[1:] - cu[:-1] + chunk_size - 1) // chunk_size
    offsets = torch.nn.functional.pad(per_seq.cumsum(0, dtype=torch.int32), (1, 0))
    seq = torch.searchsorted(offsets[1:], torch.arange(n_chunks, **i32), right=True)
    return ChunkMap(cu, offsets, seq.clamp_(max=len(cu) - 2).to(torch.int32))


_DENSE_MAPS: dict[tuple[int, int, int, torch.device, int, int], ChunkMap] = {}


def segment_map(batch: int, seq_len: int, n_chunks: int, chunk_size: int, segments: int,
                device: torch.device) -> ChunkMap:
    """The map of a dense batch's sequences cut into ``segments`` pieces each, of equal
    numbers of routing chunks but the last (shorter or empty): the sequences of a
    segmented state pass (:mod:`.segments`). Chunks keep their global numbers, so routes
    and per-slot tensors index the same in either map."""
    return _dense_chunk_map(batch, seq_len, n_chunks, torch.device(device), segments,
                            chunk_size)


def _dense_chunk_map(batch: int, seq_len: int, n_chunks: int, device: torch.device,
                     segments: int = 1, chunk_size: int = 1) -> ChunkMap:
    """A dense batch's map (of its sequences cut into ``segments``, :func:`segment_map`)
    depends on its shape only: built once (a dozen small launches that every call of both
    branches would pay otherwise), read-only afterwards.

    The two branches of a layer run on two CUDA streams and share the map, so a new one is
    waited for (one device synchronisation per new shape) before any stream may read it;
    one made while a CUDA graph is captured lives in the graph's memory and is not kept.
    Maps are a few hundred bytes and kept for the process (dropping one could free memory
    a kernel on the other stream still reads). Built outside inference mode, so that
    training may save the tensors for backward after a generation made them.
    """
    key = (batch, seq_len, n_chunks, device, segments, chunk_size)
    if key in _DENSE_MAPS:
        return _DENSE_MAPS[key]
    i32 = dict(dtype=torch.int32, device=device)
    with torch.inference_mode(False), torch.no_grad():
        per_seq = n_chunks // batch
        per_segment = -(-per_seq // segments)  # routing chunks
        steps = torch.arange(batch * segments + 1, **i32)
        seq, part = steps // segments, steps % segments
        chunk = torch.arange(n_chunks, **i32)
        cmap = ChunkMap(
            seq * seq_len + (part * per_segment * chunk_size).clamp_(max=seq_len),
            seq * per_seq + (part * per_segment).clamp_(max=per_seq),
            chunk // per_seq * segments + chunk % per_seq // per_segment)
    if device.type == "cuda":
        if torch.cuda.is_current_stream_capturing():
            return cmap
        torch.cuda.synchronize(device)
    _DENSE_MAPS[key] = cmap
    return cmap


def check_varlen(cu_seqlens: torch.Tensor, batch: int, total_len: int, n_chunks: int,
                 chunk_size: int) -> None:
    """Shape checks on packed sequences that need no look at their values (no host sync)."""
    if batch != 1:
        raise ValueError(f"cu_seqlens needs a packed batch with B == 1, got B={batch}")
    if cu_seqlens.dim() != 1 or len(cu_seqlens) < 2:
        raise ValueError(f"cu_seqlens must be 1-D [n_seq+1], got {list(cu_seqlens.shape)}")
    n_seq = len(cu_seqlens) - 1
    least = -(-total_len // chunk_size)
    if not least <= n_chunks <= least + n_seq - 1:
        raise ValueError(f"routes has {n_chunks} chunks; {n_seq} sequences of {total_len} "
                         f"tokens in chunks of {chunk_size} need {least} to {least + n_seq - 1}")


def routed_batch(batch: int, seq_len: int, heads: int, d_k: int, d_v: int,
                 routes: torch.Tensor, chunk_size: int, initial_state: torch.Tensor | None,
                 cu_seqlens: torch.Tensor | None) -> tuple[ChunkMap, torch.Tensor]:
    """Check routes and the initial state against a dense or a packed batch (``cu_seqlens``,
    ``B == 1``, one state per sequence); return the :class:`ChunkMap` and the linear
    routes ``z = routes[..., LA]`` as ``[N_total, H]``, as every routed linear kernel takes
    them."""
    check_chunk_size(chunk_size)
    if cu_seqlens is None:
        check_routes(routes, batch, seq_len, chunk_size, heads)
        n_seq = batch
    else:
        check_varlen(cu_seqlens, batch, seq_len, routes.shape[1], chunk_size)
        if routes.dim() != 4 or routes.shape[0] != 1 or routes.shape[2:] != (heads, 2):
            raise ValueError(f"packed routes must be [1, N_total, {heads}, 2], got "
                             f"{list(routes.shape)}")
        n_seq = cu_seqlens.numel() - 1
    if initial_state is not None and initial_state.shape != (n_seq, heads, d_k, d_v):
        raise ValueError(f"initial_state must be [{n_seq}, {heads}, {d_k}, {d_v}] (one state "
                         f"per sequence), got {list(initial_state.shape)}")
    cmap = chunk_map(batch, seq_len, routes.shape[0] * routes.shape[1], chunk_size,
                     routes.device, cu_seqlens)
    return cmap, routes[..., LINEAR].reshape(-1, heads).contiguous()


def packed(x: torch.Tensor) -> torch.Tensor:
    """``[B, T, H, ...]`` as the packed batch ``[1, B * T, H, ...]`` (contiguous)."""
    return x.reshape(1, x.shape[0] * x.shape[1], *x.shape[2:]).contiguous()
