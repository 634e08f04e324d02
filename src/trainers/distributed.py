"""Data-parallel training under ``torchrun``: who this process is, and summing across ranks.

``torchrun --nproc-per-node N -m nats.cli train ...`` sets ``WORLD_SIZE``, ``RANK`` and
``LOCAL_RANK``; a plain ``nats train`` is a world of one and never touches
``torch.distributed``. Every rank builds the same global batch and trains on its own
rows, so a run's data and its loss curve do not depend on how many processes share it.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .config import DEVICE_PATTERN, DEVICES


@dataclass(frozen=True)
class World:
    rank: int = 0
    size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        """Only the main process writes logs, checkpoints and the final model."""
        return self.rank == 0

    def rows(self, batch_size: int) -> slice:
        """This rank's rows of a global batch (``batch_size`` divisible by ``size``)."""
        per = batch_size // self.size
        return slice(self.rank * per, (self.rank + 1) * per)

    def sum(self, values: torch.Tensor) -> torch.Tensor:
        """Element-wise sum of ``values`` over all ranks (``values`` itself when alone)."""
        if self.size == 1:
            return values
        values = values.clone()
        dist.all_reduce(values)
        return values


def resolve_device(name: str, world: World | None = None) -> torch.device:
    """``auto`` means CUDA when there is one; asking for absent CUDA is an error.

    Under ``torchrun`` each rank takes the GPU of its local rank.
    """
    if not DEVICE_PATTERN.match(name):
        raise ValueError(f"device {name!r} is invalid: must be {DEVICES}")
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} is invalid: CUDA is not available here")
    if name == "cuda" and world is not None and world.size > 1:
        name = f"cuda:{world.local_rank}"
    device = torch.device(name)
    if device.type == "cuda" and device.index is not None \
            and device.index >= torch.cuda.device_count():
        raise ValueError(f"device {name!r} is invalid: this process sees "
                         f"{torch.cuda.device_count()} GPU(s), cuda:0 .. "
                         f"cuda:{torch.cuda.device_count() - 1}")
    return device


def _world_from_env() -> World:
    size = int(os.environ.get("WORLD_SIZE", "1"))
    if size == 1:
        return World()
    return World(int(os.environ["RANK"]), size, int(os.environ.get("LOCAL_RANK", "0")))


@contextlib.contextmanager
def joined_world(device_name: str) -> Iterator[tuple[World, torch.device]]:
    """The process group of this run (NCCL on GPUs, Gloo on CPUs) and this rank's device.

    A group that this call did not create (e.g. a caller's) is used as is and left open.
    """
    world = _world_from_env()
    device = resolve_device(device_name, world)
    if world.size == 1 or dist.is_initialized():
        yield world, device
        return
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    try:
        yield world, device
    finally:
        dist.destroy_process_group()
