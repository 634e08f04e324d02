"""Segmented state passes: a long sequence's serial state pass cut into parallel pieces.

The state kernels walk a sequence's chunks one after another, one program per (sequence,
head, value block): a batch of one long sequence runs a few dozen programs on a GPU of
over a hundred SMs, each waiting on its own chain of products. Every step of that chain is
affine in the state (``S' = A S + b``, ``A = exp(gL) (I - z k~^T w)``), so a sequence cut
into ``n`` segments can run as ``n`` sequences:

1. a *carry pass* (the state kernel with ``CARRY``) runs every segment from a zero state
   and, in ``K`` extra identity columns with no values, from the identity: its end state
   ``[c | P]`` is the segment's map ``S_end = P S_start + c``;
2. :func:`chain_starts` (here, ``n - 1`` small products in PyTorch) chains the maps into
   each segment's true start state;
3. the ordinary state pass runs every segment from its start state.

The backward does the same in reverse with ``dS_start = P' dS_end + c'``
(:func:`chain_ends`). It costs a carry pass (``V + K`` columns) more work and buys
``n``-fold parallelism; worth it only where programs are few (:func:`state_segments`).
"""

from __future__ import annotations

import functools

import torch
import triton

from ..reference.chunks import num_chunks
from .utils import ChunkMap, segment_map

STATE_SEGMENTS: int | None = None
"""Segments per sequence of every dense batch's state passes; None chooses per shape
(:func:`state_segments`). Tests set it to run segmented passes on the CPU."""

STATE_BLOCK_V = 32
"""Value columns per state-pass program (``seq_configs``' one ``BV``)."""

MIN_SEGMENT_CHUNKS = 32
"""Routing chunks a segment needs before cutting pays for the carry pass."""

SEGMENT_CHOICES = (8, 4)
"""Segment counts tried, most first. Measured on an H200 (docs/BENCHMARKS.md): two took a
tenth off where four took 40 %; past one program per SM, 16k lost again while 128k
gained further, which this choice leaves out."""


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def state_segments(batch: int, n_chunks: int, heads: int, d_v: int,
                   device: torch.device) -> int:
    """Segments per sequence for the state passes of a dense batch of ``batch`` sequences
    of ``n_chunks`` routing chunks each: the most of :data:`SEGMENT_CHOICES` that keep
    one program per SM or fewer and :data:`MIN_SEGMENT_CHUNKS` per segment, else 1."""
    if STATE_SEGMENTS is not None:
        return STATE_SEGMENTS
    if device.type != "cuda":
        return 1
    programs = batch * heads * triton.cdiv(d_v, STATE_BLOCK_V)
    for n in SEGMENT_CHOICES:
        if programs * n <= _multiprocessors(device) and n_chunks >= n * MIN_SEGMENT_CHUNKS:
            return n
    return 1


def segments_of(batch: int, seq_len: int, heads: int, d_v: int, chunk_size: int,
                device: torch.device, cu_seqlens: torch.Tensor | None) -> ChunkMap | None:
    """The map the state passes of this batch run on when cut (:func:`state_segments`),
    None when they are not. Packed sequences are not cut: their lengths are on the
    device."""
    if cu_seqlens is not None:
        return None
    per_seq = num_chunks(seq_len, chunk_size)
    segments = state_segments(batch, per_seq, heads, d_v, device)
    if segments == 1:
        return None
    return segment_map(batch, seq_len, batch * per_seq, chunk_size, segments, device)


def count(segmap: ChunkMap, n_seq: int) -> int:
    """Segments per sequence of a segment map over ``n_seq`` sequences."""
    return (segmap.cu_seqlens.numel() - 1) // n_seq


def carry_buffer(n_seq: int, heads: int, d_k: int, d_v: int,
                 device: torch.device) -> torch.Tensor:
    """What a carry pass writes: ``[c | P]`` per segment and head (float32)."""
    return torch.empty(n_seq, heads, d_k, d_v + d_k, dtype=torch.float32, device=device)


def state_grid(n_seq: int, heads: int, d_k: int, d_v: int, carry: bool):
    """The launch grid of a state pass (forward or backward) over ``n_seq`` sequences: one
    program per value block of every (sequence, head), with a carry pass's identity blocks
    (the host side of the kernels' ``carry_blocks``)."""
    def grid(meta: dict) -> tuple[int]:
        blocks = triton.cdiv(d_v, meta["BV"]) + (triton.cdiv(d_k, meta["BV"]) if carry else 0)
        return (blocks * n_seq * heads,)
    return grid


def chain_starts(carry: torch.Tensor, h0: torch.Tensor | None, segments: int,
                 d_v: int) -> torch.Tensor:
    """Each segment's start state ``[B * segments, H, K, V]`` from the carry pass's maps and
    the sequences' initial states ``h0`` ``[B, H, K, V]`` (None: zero)."""
    return _chain(carry, h0, segments, d_v, range(segments))


def chain_ends(carry: torch.Tensor, dht: torch.Tensor | None, segments: int,
               d_v: int) -> torch.Tensor:
    """Each segment's end-state gradient ``[B * segments, H, K, V]`` from the backward
    carry pass's maps and the sequences' final-state gradients ``dht`` (None: zero)."""
    return _chain(carry, dht, segments, d_v, range(segments - 1, -1, -1))


def _chain(carry: torch.Tensor, given: torch.Tensor | None, segments: int, d_v: int,
           order: range) -> torch.Tensor:
    """Walk the segments in ``order``: the first gets ``given`` (None: zero), each next one
    the previous one's map ``P x + c`` (carry ``[B * segments, H, K, V + K]``) applied to
    what the previous one got."""
    n, heads, d_k, _ = carry.shape
    maps = carry.view(n // segments, segments, heads, d_k, d_v + d_k)
    c, p = maps[..., :d_v], maps[..., d_v:]
    out = torch.empty(*c.shape, dtype=torch.float32, device=carry.device)
    steps = iter(order)
    prev = next(steps)
    x = torch.zeros_like(out[:, 0]) if given is None else given.float()
    out[:, prev] = x
    for j in steps:
        x = torch.matmul(p[:, prev], x).add_(c[:, prev])
        out[:, j] = x
        prev = j
    return out.view(-1, *out.shape[2:])
