"""Where a run's batches come from: task sources and the seeded stream of batches.

The batch of training step ``s`` depends only on ``(seed, s)``, so a resumed run sees
exactly the data it would have seen without the interruption.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from .config import TrainConfig
from .synthetic import Batch, CopyTask, MQARTask
from .text import load_byte_splits


class Source(Protocol):
    """Anything that draws a batch of ``(input_ids, labels)`` from a generator."""

    def sample(self, batch_size: int, generator: torch.Generator) -> Batch: ...


def stream_generator(seed: int, stream: str, index: int) -> torch.Generator:
    """An independent generator for item ``index`` of a named stream (``"train"``, ...)."""
    entropy = [seed, zlib.crc32(stream.encode()), index]
    state = np.random.SeedSequence(entropy).generate_state(1, dtype=np.uint64)[0]
    return torch.Generator().manual_seed(int(state))


@dataclass(frozen=True)
class Batches:
    """The training and evaluation batches of one run."""

    train_source: Source
    eval_source: Source
    batch_size: int
    seed: int

    def train(self, step: int) -> Batch:
        """The batch of training step ``step`` (0-based)."""
        return self.train_source.sample(self.batch_size,
                                        stream_generator(self.seed, "train", step))

    def eval(self, count: int) -> list[Batch]:
        """The fixed evaluation batches, the same at every evaluation."""
        return [self.eval_source.sample(self.batch_size, stream_generator(self.seed, "eval", i))
                for i in range(count)]


def build_batches(config: TrainConfig) -> Batches:
    """The batches ``config`` asks for; generated tasks evaluate on their own stream."""
    train: Source
    evaluate: Source
    if config.task == "copy":
        train = evaluate = CopyTask(config.seq_len, config.copy_symbols)
    elif config.task == "mqar":
        train = evaluate = MQARTask(config.model.vocab_size, config.seq_len, config.mqar_pairs)
    else:
        train, evaluate = load_byte_splits(config.data_paths, config.data_glob,
                                           config.val_fraction, config.seq_len)
    return Batches(train, evaluate, config.batch_size, config.seed)
