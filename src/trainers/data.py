"""Where a run's batches come from: task sources and the seeded streams of batches.

Training draws from ``seed``, evaluation from ``eval_seed`` (a separate stream even when
the two are equal). For generated tasks and in-memory text the batch of training step
``s`` depends only on ``(seed, s)``; for streamed text it is the ``s``-th batch of the
stream. Either way a resumed run sees exactly the data it would have seen without the
interruption (the data position of step ``s`` is ``s * batch_size`` sequences).
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from .config import TrainConfig
from .synthetic import Batch
from .text_data import StreamWindows, TokenWindows, load_text_sources, resolve_corpus
from .tokenization import load_tokenizer


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
    """The training and evaluation batches of one run.

    ``train(step)`` is the global batch of a step; ``eval(count)`` the fixed evaluation
    batches. Random-access sources (generated tasks, in-memory text) answer any step at
    the same cost. A streamed source (:class:`StreamWindows`) reads on from its last
    call, so increasing steps are cheap; an earlier step restarts the stream.
    """

    train_source: Source | StreamWindows
    eval_source: Source | StreamWindows
    batch_size: int
    seed: int
    eval_seed: int = 1

    @property
    def streaming(self) -> bool:
        """Whether training batches are read in order from a stream."""
        return isinstance(self.train_source, StreamWindows)

    @property
    def bytes_per_token(self) -> float | None:
        """UTF-8 bytes per token of the evaluation text, for bits per byte.

        ``None`` for generated tasks, 1.0 for byte-level text; for a ``tokenizers``
        tokenizer measured on the validation split (a streamed one: its first MiB).
        """
        return getattr(self.eval_source, "bytes_per_token", None)

    def train(self, step: int) -> Batch:
        """The batch of training step ``step`` (0-based)."""
        if isinstance(self.train_source, StreamWindows):
            return self.train_source.batch(step, self.batch_size)
        return self.train_source.sample(self.batch_size,
                                        stream_generator(self.seed, "train", step))

    def calibration(self, count: int) -> list[Batch]:
        """``count`` batches of the evaluation task that evaluation never reads (a stream of
        their own), to fit something to the evaluated data without tuning on it. Text has
        no second held-out stream: its training windows serve."""
        if isinstance(self.eval_source, (TokenWindows, StreamWindows)):
            return [self.train(step) for step in range(count)]
        return [self.eval_source.sample(self.batch_size,
                                        stream_generator(self.eval_seed, "calibration", i))
                for i in range(count)]

    def eval(self, count: int) -> list[Batch]:
        """The fixed evaluation batches, the same at every evaluation."""
        if isinstance(self.eval_source, StreamWindows):
            return self.eval_source.first(count, self.batch_size)
        return [self.eval_source.sample(self.batch_size,
                                        stream_generator(self.eval_seed, "eval", i))
                for i in range(count)]


def build_batches(config: TrainConfig) -> Batches:
    """The batches ``config`` asks for; generated tasks evaluate on their own stream (an
    MQAR run with ``mqar_pairs_mix`` trains on the mixture, evaluates on ``mqar_pairs``).

    Text errors (a missing path, an empty split, a bad ``text_field`` or tokenizer) are
    one-line ``ValueError`` / ``FileNotFoundError``s raised here, before any training.
    """
    train: Source | StreamWindows
    evaluate: Source | StreamWindows
    task = config.synthetic_task()
    if task is not None:
        train, evaluate = config.training_task(), task
    else:
        tokenizer = load_tokenizer(config.tokenizer)
        if tokenizer.vocab_size > config.model.vocab_size:
            raise ValueError(f"tokenizer: {config.tokenizer!r} has {tokenizer.vocab_size} "
                             f"tokens, more than model.vocab_size={config.model.vocab_size}")
        corpus = resolve_corpus(config.data_paths, config.data_glob, config.data_format,
                                config.text_field, config.val_fraction)
        train, evaluate = load_text_sources(corpus, tokenizer, config.seq_len,
                                            config.streaming)
    return Batches(train, evaluate, config.batch_size, config.seed, config.eval_seed)
