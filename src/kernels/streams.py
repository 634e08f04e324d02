"""Run the two branches of a NAtS-L layer side by side on one GPU.

The softmax kernels fill the GPU with many short programs, while the linear branch's
serial state kernels walk the chunks of each (sequence, head) with a few long-running
programs that leave most of every SM idle. Launched on two CUDA streams, the block
scheduler interleaves them. Their backward passes overlap as well: autograd runs the
backward of each op on the stream its forward ran on, and syncs the streams where the
gradients meet (PyTorch's "stream semantics of backward passes").
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

A = TypeVar("A")
B = TypeVar("B")

_SIDE_STREAMS: dict[int, torch.cuda.Stream] = {}


def side_stream(device: torch.device) -> torch.cuda.Stream:
    """The one side stream of ``device`` (made on first use).

    At normal priority: a high-priority one was not faster overall (docs/BENCHMARKS.md).
    """
    index = torch.cuda.current_device() if device.index is None else device.index
    if index not in _SIDE_STREAMS:
        _SIDE_STREAMS[index] = torch.cuda.Stream(device=index)
    return _SIDE_STREAMS[index]


def _tensors(value: object) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, tuple | list):
        return [t for v in value for t in _tensors(v)]
    return []


def concurrently(first: Callable[[], A], second: Callable[[], B], device: torch.device,
                 ) -> tuple[A, B]:
    """``(first(), second())``, with ``second`` on the side stream when ``device`` is CUDA.

    ``second`` is launched first, so the long serial kernels start at once. Both see every
    earlier op of the current stream, and every later op of the current stream sees both
    results. Tensors that ``second`` returns are marked as used by the current stream, so
    the caching allocator does not hand their memory to the side stream while the current
    one may still read them.
    """
    if device.type != "cuda" or torch.compiler.is_compiling():
        return first(), second()
    main = torch.cuda.current_stream(device)
    side = side_stream(device)
    side.wait_stream(main)
    with torch.cuda.stream(side):
        b = second()
    a = first()
    main.wait_stream(side)
    for t in _tensors(b):
        if t.is_cuda:
            t.record_stream(main)
    return a, b
