"""Generated sequence tasks whose answers are known exactly: copy and MQAR.

Both return HF-style ``(input_ids, labels)``: labels have the shape of the inputs, the
model shifts them, and ``-100`` marks positions that carry no loss.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from nats.model import IGNORE_INDEX

Batch = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class CopyTask:
    """``s_1 .. s_n SEP s_1 .. s_n``: the loss is only on the copy, which needs recall.

    Symbols are tokens ``1 .. symbols``; ``SEP`` is token 0. With an even ``seq_len`` a
    final ``SEP`` pads the sequence and carries no loss.
    """

    seq_len: int
    symbols: int

    SEPARATOR = 0

    def sample(self, batch_size: int, generator: torch.Generator) -> Batch:
        n = (self.seq_len - 1) // 2
        source = torch.randint(1, self.symbols + 1, (batch_size, n), generator=generator)
        sep = torch.full((batch_size, 1), self.SEPARATOR, dtype=torch.long)
        parts = [source, sep, source] + ([sep] if self.seq_len % 2 == 0 else [])
        input_ids = torch.cat(parts, dim=1)
        labels = torch.full_like(input_ids, IGNORE_INDEX)
        labels[:, n + 1: 2 * n + 1] = source
        return input_ids, labels


@dataclass(frozen=True)
class MQARTask:
    """Multi-query associative recall (Zoology, Arora et al. 2023), in HF label form.

    ``pairs`` key-value pairs open the sequence (keys from ``1 .. V/2 - 1``, values from
    ``V/2 .. V - 1``, all distinct); then every key is asked once, at a gap drawn from a
    power law ``p(g) ~ g^(power_a - 1)`` so that most queries come soon after the context.
    A query is the key followed by its value; the loss is only on that value. All other
    positions hold random tokens.
    """

    vocab_size: int
    seq_len: int
    pairs: int
    power_a: float = 0.01

    def sample(self, batch_size: int, generator: torch.Generator) -> Batch:
        b, d, half = batch_size, self.pairs, self.vocab_size // 2
        keys = torch.rand(b, half - 1, generator=generator).argsort(dim=1)[:, :d] + 1
        values = torch.rand(b, half, generator=generator).argsort(dim=1)[:, :d] + half
        input_ids = torch.randint(0, self.vocab_size, (b, self.seq_len), generator=generator)
        input_ids[:, 0: 2 * d: 2] = keys
        input_ids[:, 1: 2 * d: 2] = values
        space = (self.seq_len - 2 * d) // 2
        gaps = torch.arange(1, space + 1, dtype=torch.float64)
        p = (self.power_a * gaps ** (self.power_a - 1)).expand(b, space)
        slots = torch.multinomial(p, d, replacement=False, generator=generator)
        query_pos = 2 * d + 2 * slots
        input_ids.scatter_(1, query_pos, keys)
        input_ids.scatter_(1, query_pos + 1, values)
        labels = torch.full_like(input_ids, IGNORE_INDEX)
        labels.scatter_(1, query_pos + 1, values)
        return input_ids, labels
