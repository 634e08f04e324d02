"""Work replayed from a CUDA graph: decode steps, and a benchmark's training step.

At batch 1 a decode step is a few hundred small kernels, and launching them from Python
costs far more than running them. :meth:`NatsForCausalLM.decode_compute` launches the
same kernels at every position on fixed buffers (the cache's), so it is captured once
and replayed; the host bookkeeping between steps (:meth:`~NatsForCausalLM.decode_advance`:
closing chunks, growing full buffers) stays eager. When that bookkeeping replaces a
buffer, the graph no longer points at the cache and is captured again: at chunk closes
whose store is full, and when a softmax layer's KV buffer doubles, so a logarithmic
number of times over a generation.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

import torch

from .cache import HybridCache

if TYPE_CHECKING:  # the model imports this module
    from .model import NatsForCausalLM


W = TypeVar("W")
R = TypeVar("R")


def warm_then_capture(warm_up: Callable[[], W], record: Callable[[], R], device: torch.device,
                      ) -> tuple[W, torch.cuda.CUDAGraph, R]:
    """Run ``warm_up()``, then record ``record()`` into a graph without running it; returns
    both results and the graph (``graph.replay()`` refills ``record``'s outputs in place).

    Both run on one fresh stream: cuBLAS and the caching allocator set up per stream, and
    the warm-up compiles and autotunes every kernel, which must not happen in the capture.
    Work queued before this call is seen by both; work queued after it sees both.
    """
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        warm = warm_up()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            recorded = record()
    torch.cuda.current_stream(device).wait_stream(stream)
    return warm, graph, recorded


class GraphedDecoder:
    """``decoder(token)`` does what ``model.decode_step(token, cache)`` does, on a GPU.

    The first step, and every step after the cache's buffers moved, runs eagerly (which
    also compiles and warms up every kernel) and then captures the next step's work.
    """

    def __init__(self, model: NatsForCausalLM, cache: HybridCache) -> None:
        if not cache.position_t.is_cuda:
            raise ValueError("CUDA-graph decoding needs the model and its cache on a GPU")
        self.model, self.cache = model, cache
        self.graph: torch.cuda.CUDAGraph | None = None
        self.bound_to: list[int] = []
        self.token: torch.Tensor | None = None
        self.logits: torch.Tensor | None = None
        self.captures = 0

    def _buffers(self) -> list[int]:
        return [t.data_ptr() for t in self.cache.buffers()]

    @torch.no_grad()
    def __call__(self, token: torch.Tensor) -> torch.Tensor:
        """Logits ``[B, V]`` of one new token ``[B]``; advances the cache."""
        stale = self.graph is None or token.shape != self.token.shape
        if stale or self._buffers() != self.bound_to:
            return self._eager_then_capture(token)
        self.token.copy_(token)
        self.graph.replay()
        self.model.decode_advance(self.cache)
        return self.logits.clone()

    def _eager_then_capture(self, token: torch.Tensor) -> torch.Tensor:
        # The warm-up is this token's real step; the capture records the next one's work.
        # The decoder's state changes once both succeeded: a graph must not outlive the
        # token buffer it reads.
        fixed_token = token.clone()
        logits, graph, fixed_logits = warm_then_capture(
            lambda: self.model.decode_step(token, self.cache),
            lambda: self.model.decode_compute(fixed_token, self.cache), token.device)
        self.token, self.graph, self.logits = fixed_token, graph, fixed_logits
        self.bound_to = self._buffers()
        self.captures += 1
        return logits
