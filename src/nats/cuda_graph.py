"""Work replayed from a CUDA graph: decode steps, prefills, and a benchmark's training step.

At batch 1 a decode step is a few hundred small kernels, and launching them from Python
costs far more than running them. :meth:`NatsForCausalLM.decode_compute` launches the
same kernels at every position of a :meth:`~NatsForCausalLM.decode_plan` (which layers
end a chunk, and so also score and file it) on fixed buffers (the cache's), so each plan's
step is captured once and replayed: a model whose layers share a chunk size has two. The
host bookkeeping between steps (:meth:`~NatsForCausalLM.decode_advance`: opening chunks,
growing full buffers) stays eager. When that bookkeeping replaces a buffer, the graphs no
longer point at the cache and are captured again: when a store fills, and when a softmax
layer's KV buffer doubles, so a logarithmic number of times over a generation.

A prefill at batch 1 is host-bound too (docs/BENCHMARKS.md): :class:`GraphedPrefill`
replays one graph per prompt shape, for callers that prefill prompts of a few fixed
shapes (a server's length buckets, a benchmark).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

import torch
from torch import nn

from .cache import HybridCache
from .layers.routing import RouteOverride

if TYPE_CHECKING:  # the model imports this module
    from .model import NatsForCausalLM, PendingCache


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


Signature = list[tuple[int, torch.Size]]
"""Where each tensor a graph reads is and its shape: what a capture is bound to."""


def _signature(tensors: Iterable[torch.Tensor]) -> Signature:
    return [(t.data_ptr(), t.shape) for t in tensors]


def _module_tensors(module: nn.Module) -> list[torch.Tensor]:
    """Every parameter and buffer of ``module`` and its submodules, a shared one as often
    as it is held: what ``parameters()`` and ``buffers()`` reach, without the names they
    build, which were most of a replayed prefill's check of where its tensors are."""
    tensors = [t for t in (*module._parameters.values(), *module._buffers.values())
               if t is not None]
    for child in module._modules.values():
        if child is not None:
            tensors += _module_tensors(child)
    return tensors


def _overrides(model: NatsForCausalLM) -> tuple[RouteOverride, ...]:
    """The NAtS-L layers' route overrides: a graph replays those it was captured with."""
    return tuple(layer.route_override for layer in model.nats_layers)


def _overrides_changed(model: NatsForCausalLM, captured: tuple[RouteOverride, ...]) -> bool:
    """Whether a layer's route override is not the one a graph was captured with."""
    return any(a is not b for a, b in zip(_overrides(model), captured, strict=True))


def _overrides_on(model: NatsForCausalLM, device: torch.device, work: str,
                  ) -> tuple[RouteOverride, ...]:
    """The route overrides a capture of ``work`` will replay, each tensor one checked to
    be on ``device``, where the graph reads it."""
    overrides = _overrides(model)
    for override in overrides:
        if isinstance(override, torch.Tensor) and override.device != device:
            raise ValueError(f"CUDA-graph {work} reads the route override tensor on the "
                             f"GPU, so it must be on {device}, not {override.device}")
    return overrides


@dataclass
class _Captured:
    """One plan's graph, the token and logits buffers it reads and fills, the cache's
    buffers it was captured on and the route overrides it replays (held, so that a
    replaced one is told apart even if its memory is reused)."""

    graph: torch.cuda.CUDAGraph
    token: torch.Tensor
    logits: torch.Tensor
    bound_to: Signature
    overrides: tuple[RouteOverride, ...]


class GraphedDecoder:
    """``decoder(token)`` does what ``model.decode_step(token, cache)`` does, on a GPU.

    The first step of each plan, and every one after the cache's buffers moved or a NAtS-L
    layer's route override changed, runs eagerly (which also compiles and warms up every
    kernel) and captures its work, which the plan's later steps replay.
    """

    def __init__(self, model: NatsForCausalLM, cache: HybridCache) -> None:
        if not cache.position_t.is_cuda:
            raise ValueError("CUDA-graph decoding needs the model and its cache on a GPU")
        self.model, self.cache = model, cache
        self.graphs: dict[tuple[bool, ...], _Captured] = {}
        self.captures = 0

    def _buffers(self) -> Signature:
        return _signature(self.cache.buffers())

    @torch.no_grad()
    def __call__(self, token: torch.Tensor) -> torch.Tensor:
        """Logits ``[B, V]`` of one new token ``[B]``; advances the cache."""
        plan = self.model.decode_plan(self.cache)
        captured = self.graphs.get(plan)
        if captured is None or token.shape != captured.token.shape \
                or self._buffers() != captured.bound_to \
                or _overrides_changed(self.model, captured.overrides):
            return self._eager_then_capture(token, plan)
        captured.token.copy_(token)
        captured.graph.replay()
        self.model.decode_advance(self.cache)
        return captured.logits.clone()

    def _eager_then_capture(self, token: torch.Tensor, plan: tuple[bool, ...]) -> torch.Tensor:
        # The warm-up is this token's real work; the capture records the same plan's work
        # before the bookkeeping moves the cache on, which follows the warm-up even if the
        # capture fails. A graph must not outlive the token buffer it reads, so the
        # decoder keeps it only once both succeeded.
        overrides = _overrides_on(self.model, token.device, "decoding")
        fixed_token = token.clone()
        warmed: list[torch.Tensor] = []

        def warm_up() -> torch.Tensor:
            warmed.append(self.model.decode_compute(token, self.cache))
            return warmed[0]

        try:
            _, graph, fixed_logits = warm_then_capture(
                warm_up, lambda: self.model.decode_compute(fixed_token, self.cache),
                token.device)
            bound_to = self._buffers()  # before the bookkeeping may move them
        finally:
            if warmed:
                self.model.decode_advance(self.cache)
        self.graphs[plan] = _Captured(graph, fixed_token, fixed_logits, bound_to, overrides)
        self.captures += 1
        return warmed[0]


@dataclass
class _CapturedPrefill:
    """One prompt shape's graph, the ids it reads, the logits and layer caches (or their
    finishers) it fills, and what it was captured with: the model's parameters and
    buffers (where they are) and its route overrides."""

    graph: torch.cuda.CUDAGraph
    ids: torch.Tensor
    logits: torch.Tensor
    caches: list[PendingCache]
    bound_to: Signature
    overrides: tuple[RouteOverride, ...]


class GraphedPrefill:
    """``prefill(input_ids)`` does what ``model.prefill(input_ids)`` does, on a GPU, for a
    model in eval mode.

    The first prompt of each shape (and autocast state), and every one after the model's
    parameters moved or a NAtS-L layer's route override changed, runs eagerly (which also
    compiles and tunes every kernel) and captures the prefill's device work; later prompts
    of that shape replay it. After a replay the host finishes the cache: it reads each
    NAtS-L store's size (a transfer a layer; only the first waits for the replay's work,
    where the eager prefill may wait at each), packs the stores and copies the rest out of
    the graph's memory. Each shape's graph keeps the memory its prefill peaked at until
    :meth:`clear`.
    """

    def __init__(self, model: NatsForCausalLM) -> None:
        self.model = model
        self.graphs: dict[tuple, _CapturedPrefill] = {}
        self.captures = 0

    def clear(self) -> None:
        """Drop every graph: their memory goes back to PyTorch's caching allocator
        (``torch.cuda.empty_cache()`` hands it to the driver)."""
        self.graphs.clear()

    def _bound_to(self) -> Signature:
        return _signature(_module_tensors(self.model))

    @torch.no_grad()
    def __call__(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, HybridCache]:
        """Logits of the prompt ``[B, T]`` and the cache that decoding continues from."""
        if self.model.training:
            # Training mode reads host state (the routes' noise) that a replay would freeze.
            raise ValueError("CUDA-graph prefill runs a model in eval mode: call "
                             "model.eval() first")
        if not input_ids.is_cuda:
            raise ValueError("CUDA-graph prefill needs the model and the prompt on a GPU")
        key = (tuple(input_ids.shape), input_ids.device, torch.is_autocast_enabled("cuda"),
               torch.get_autocast_dtype("cuda"))
        captured = self.graphs.get(key)
        if captured is not None and self._bound_to() != captured.bound_to:
            self.graphs.clear()  # every graph reads the parameters where they were
            captured = None
        if captured is None or _overrides_changed(self.model, captured.overrides):
            return self._eager_then_capture(key, input_ids)
        captured.ids.copy_(input_ids)
        captured.graph.replay()
        cache = self.model.prompt_cache(captured.caches, input_ids, own=True)
        return captured.logits.clone(), cache

    def _eager_then_capture(self, key: tuple, input_ids: torch.Tensor,
                            ) -> tuple[torch.Tensor, HybridCache]:
        # The warm-up is this prompt's real prefill; the capture records the same work on
        # a copy of the ids, kept with the graph, which must not outlive what it reads.
        self.graphs.pop(key, None)
        overrides = _overrides_on(self.model, input_ids.device, "prefill")
        fixed_ids = input_ids.clone()
        # Autocast's cache of weight casts lives only as long as the caller's autocast
        # block: the graph must record the casts, not reads of a cache freed after it.
        uncached = torch.autocast("cuda", dtype=torch.get_autocast_dtype("cuda"),
                                  enabled=torch.is_autocast_enabled("cuda"),
                                  cache_enabled=False)
        with uncached:
            warm, graph, (logits, caches) = warm_then_capture(
                lambda: self.model.prefill(input_ids),
                lambda: self.model.prefill_compute(fixed_ids, finish=False),
                input_ids.device)
        self.graphs[key] = _CapturedPrefill(graph, fixed_ids, logits, caches,
                                            self._bound_to(), overrides)
        self.captures += 1
        return warm
