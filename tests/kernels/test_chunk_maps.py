"""Where the kernels find chunks: the dense chunk map and the per-head softmax chunk list,
against obvious Python constructions of the same tables."""

from __future__ import annotations

import itertools

import pytest
import torch

from nats.kernels import SOFTMAX
from nats.kernels.triton.softmax_attention import softmax_chunk_list
from nats.kernels.triton.utils import chunk_map, segment_map

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("n_chunks", [1, 7, 2500])  # 2500: the kernel's loop runs 3 blocks
def test_softmax_chunk_list_matches_a_python_walk(n_chunks: int) -> None:
    gen = torch.Generator().manual_seed(n_chunks)
    heads = 3
    is_sm = torch.rand(n_chunks, heads, generator=gen) < 0.3
    is_sm[:, 1] = False  # a head without softmax chunks
    # A strided, non-contiguous routes tensor in bf16, as a layer may hand over.
    routes = torch.zeros(1, n_chunks, heads, 4)
    routes[..., 2 * SOFTMAX] = is_sm.float()
    routes[..., 2 * (1 - SOFTMAX)] = (~is_sm).float()
    routes = routes[..., ::2].to(device=DEVICE, dtype=torch.bfloat16)

    sel, before = softmax_chunk_list(routes)

    assert sel.shape == (heads, n_chunks) and before.shape == (n_chunks + 1, heads)
    for h in range(heads):
        chunks = [c for c in range(n_chunks) if is_sm[c, h]]
        assert sel[h, :len(chunks)].tolist() == chunks
        running = [0]
        for c in range(n_chunks):
            running.append(running[-1] + int(is_sm[c, h]))
        assert before[:, h].tolist() == running


@pytest.mark.parametrize(("seq_len", "chunk", "segments"), [(130, 16, 4), (128, 16, 2),
                                                          (40, 16, 3), (64, 64, 2)])
def test_segment_map_is_the_packed_map_of_the_segments(seq_len: int, chunk: int,
                                                       segments: int) -> None:
    """Each sequence cut into segments of equal whole chunks (the last shorter, possibly
    empty) is the packed batch of those pieces: the varlen map of their lengths."""
    batch = 3
    per_seq = -(-seq_len // chunk)
    per_segment = -(-per_seq // segments)
    bounds = [min(j * per_segment * chunk, seq_len) for j in range(segments)] + [seq_len]
    lengths = [b - a for a, b in itertools.pairwise(bounds)] * batch
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device=DEVICE)
    want = chunk_map(1, batch * seq_len, batch * per_seq, chunk, torch.device(DEVICE), cu)
    got = segment_map(batch, seq_len, batch * per_seq, chunk, segments, torch.device(DEVICE))
    for name, g, w in zip(want._fields, got, want, strict=True):
        assert g.tolist() == w.tolist(), name


def test_dense_chunk_map_made_during_inference_serves_training() -> None:
    """The map of a dense batch is cached per shape; one first built while generating
    (inference mode) must still be savable for backward by a later training step."""
    with torch.inference_mode():
        chunk_map(2, 130, 6, 64, torch.device(DEVICE))
    cmap = chunk_map(2, 130, 6, 64, torch.device(DEVICE))
    assert not any(t.is_inference() for t in cmap)
    # Two sequences of 130 tokens, three chunks of 64 each (the last one short).
    assert cmap.cu_seqlens.tolist() == [0, 130, 260]
    assert cmap.chunk_offsets.tolist() == [0, 3, 6]
    assert cmap.chunk_seq.tolist() == [0, 0, 0, 1, 1, 1]
    x = torch.ones(3, requires_grad=True)

    class SavesMap(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x: torch.Tensor) -> torch.Tensor:
            ctx.save_for_backward(*cmap)
            return x * 2

        @staticmethod
        def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
            assert len(ctx.saved_tensors) == 3
            return grad * 2

    SavesMap.apply(x).sum().backward()
    assert x.grad.tolist() == [2.0, 2.0, 2.0]


@pytest.mark.gpu
def test_new_dense_chunk_map_is_ready_for_another_stream() -> None:
    """The layer's branches share one cached map from two streams: a map first made on a
    busy side stream must hold its values when the main stream reads it at once."""
    device = torch.device("cuda")
    # Every kernel involved loaded first: loading a CUDA module on first use can
    # synchronise the device, which would hide the race this test looks for.
    for t in chunk_map(3, 1000, 48, 64, device):
        t.clone()
    torch.cuda.synchronize(device)
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        # Freed blocks of the map's sizes, full of -1, for its tensors to land in: a read
        # before the map's kernels ran would see them.
        poison = [torch.full((n,), -1, dtype=torch.int32, device=device)
                  for n in (4, 4, 4, 4, 51, 51)]
        del poison
        torch.cuda._sleep(100_000_000)  # tens of milliseconds before the map is made
        cmap = chunk_map(3, 1070, 51, 64, device)  # a shape no other test uses
    seen = [t.clone() for t in cmap]  # on the main stream, which does not wait for side
    torch.cuda.synchronize(device)
    # Three sequences of 1070 tokens, 17 chunks of 64 each (the last one short).
    assert seen[0].tolist() == [0, 1070, 2140, 3210]
    assert seen[1].tolist() == [0, 17, 34, 51]
    assert seen[2].tolist() == [c // 17 for c in range(51)]
