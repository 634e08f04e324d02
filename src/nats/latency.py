"""Wall-clock latency of a model's forward pass (prefill), as a search can measure it.

A trial's routes decide how much softmax work its layers do, so the latency of the
trained model on real inputs is a cost a user may want to trade against quality. It is
timed on the device the model lives on: with the Triton kernels on a GPU, with the plain
PyTorch reference on a CPU (there it measures the reference, not a fast path).
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable

import torch

from .eval_mode import eval_mode
from .model import NatsForCausalLM


def median_ms(fn: Callable[[], object], device: torch.device, warmup: int = 2,
              repeats: int = 5) -> float:
    """Median milliseconds of ``fn()`` after ``warmup`` calls (CUDA work synchronised)."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(warmup):
        fn()
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def tile_tokens(input_ids: torch.Tensor, length: int) -> torch.Tensor:
    """One sequence of ``length`` tokens from ``input_ids`` rows laid end to end (repeated
    if they hold fewer), so that the routes are those of real data, not of noise."""
    flat = input_ids.flatten()
    if flat.numel() == 0:
        raise ValueError("no tokens to time the model on")
    repeats = -(-length // flat.numel())
    return flat.repeat(repeats)[:length][None]


def prefill_latency_ms(model: NatsForCausalLM, input_ids: torch.Tensor, length: int,
                       autocast: contextlib.AbstractContextManager | None = None) -> float:
    """Median milliseconds of one forward pass over ``length`` tokens of ``input_ids``
    (batch 1, eval mode, no gradients); the model's mode is restored afterwards."""
    device = next(model.parameters()).device
    tokens = tile_tokens(input_ids, length).to(device)
    with eval_mode(model), torch.no_grad(), autocast or contextlib.nullcontext():
        return median_ms(lambda: model(tokens), device)

