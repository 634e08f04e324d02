"""Decode steps replayed from a CUDA graph.

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

from typing import TYPE_CHECKING

import torch

from .cache import HybridCache

if TYPE_CHECKING:  # the model imports this module
    from .model import NatsForCausalLM


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
        # Warm-up on the stream that will capture (cuBLAS and the caching allocator set up
        # per stream), which is also this token's real step.
        stream = torch.cuda.Stream(token.device)
        stream.wait_stream(torch.cuda.current_stream(token.device))
        with torch.cuda.stream(stream):
            logits = self.model.decode_step(token, self.cache)
            self.token = token.clone()
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph, stream=stream):  # recorded, not run
                self.logits = self.model.decode_compute(self.token, self.cache)
        torch.cuda.current_stream(token.device).wait_stream(stream)
        self.bound_to = self._buffers()
        self.captures += 1
        return logits
