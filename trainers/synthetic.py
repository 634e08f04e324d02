"""Generated sequence tasks whose answers are known exactly: copy, MQAR and needle retrieval.

All return HF-style ``(input_ids, labels)``: labels have the shape of the inputs, the
model shifts them, and ``-100`` marks positions that carry no loss.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

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

    @staticmethod
    def relevant_positions(input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Bool ``[B, T]``: where the context states what the queries ask.

        For every query (a labelled value ``v`` at ``p`` after its key ``k`` at ``p - 1``),
        every earlier occurrence of the bigram ``k v`` (both tokens) ending before ``p - 1``.
        Read from the batch itself, so it holds for any pair placement; with random filler
        a chance repeat of ``k v`` is marked too (the model cannot tell it apart either).
        """
        rows, pos = (labels != IGNORE_INDEX).nonzero(as_tuple=True)
        keys, values = input_ids[rows, pos - 1], input_ids[rows, pos]
        ids = input_ids[rows]  # [Q, T]: each query's own row
        starts = torch.arange(ids.shape[1] - 1, device=ids.device)
        hit = ((ids[:, :-1] == keys[:, None]) & (ids[:, 1:] == values[:, None])
               & (starts[None] + 1 < (pos - 1)[:, None]))
        return _mark_spans(hit, rows, input_ids.shape, width=2)


@dataclass(frozen=True)
class NeedleTask:
    """Single-needle retrieval: a key and a 7-digit value hidden in a haystack, asked at the end.

    Tokens ``0 .. 9`` are the digits, ``10 .. 10 + k - 1`` (``k = (V - 10) // 2``) the key
    tokens and the rest filler, so neither a key nor a digit occurs in the haystack by
    chance. A row is ``filler[:depth] key value filler[depth:] key value``: the needle (a
    random key of ``key_len`` tokens and a 7-digit value with a non-zero first digit) sits
    after ``depth`` filler tokens, ``depth`` uniform in ``0 .. H`` with ``H = seq_len - 2 *
    (key_len + 7)``; the row ends by asking the key again. The loss is only on the 7 digits
    of that answer.
    """

    vocab_size: int
    seq_len: int
    key_len: int = 3

    DIGITS: ClassVar[int] = 10
    VALUE_DIGITS: ClassVar[int] = 7
    MIN_VOCAB: ClassVar[int] = 16

    @classmethod
    def min_seq_len(cls, key_len: int) -> int:
        """Two copies of the needle and at least one filler token."""
        return 2 * (key_len + cls.VALUE_DIGITS) + 1

    @property
    def key_tokens(self) -> range:
        return range(self.DIGITS, self.DIGITS + (self.vocab_size - self.DIGITS) // 2)

    @property
    def filler_tokens(self) -> range:
        return range(self.key_tokens.stop, self.vocab_size)

    def sample(self, batch_size: int, generator: torch.Generator) -> Batch:
        b, keys, filler = batch_size, self.key_tokens, self.filler_tokens
        needle_len = self.key_len + self.VALUE_DIGITS
        hay = self.seq_len - 2 * needle_len
        key = torch.randint(keys.start, keys.stop, (b, self.key_len), generator=generator)
        value = torch.cat([torch.randint(1, 10, (b, 1), generator=generator),
                           torch.randint(0, 10, (b, self.VALUE_DIGITS - 1),
                                         generator=generator)], dim=1)
        needle = torch.cat([key, value], dim=1)
        haystack = torch.randint(filler.start, filler.stop, (b, hay), generator=generator)
        depth = torch.randint(0, hay + 1, (b, 1), generator=generator)
        # Position p of the body holds filler p before the needle, needle p - depth inside
        # it and filler p - needle_len after it.
        pos = torch.arange(hay + needle_len).expand(b, -1)
        inside = (pos >= depth) & (pos < depth + needle_len)
        from_hay = torch.where(pos < depth, pos, pos - needle_len).clamp(0, max(hay - 1, 0))
        from_needle = (pos - depth).clamp(0, needle_len - 1)
        body = torch.where(inside, needle.gather(1, from_needle), haystack.gather(1, from_hay))
        input_ids = torch.cat([body, needle], dim=1)
        labels = torch.full_like(input_ids, IGNORE_INDEX)
        labels[:, -self.VALUE_DIGITS:] = value
        return input_ids, labels

    def relevant_positions(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Bool ``[B, T]``: the needle's tokens in the haystack (key and value), not the
        question at the end. Found by matching the question (the last ``key_len + 7``
        tokens) inside the body, so distractors with other keys are not marked."""
        del labels  # the question is always the row's last key_len + 7 tokens
        n = self.key_len + self.VALUE_DIGITS
        body, question = input_ids[:, :-n], input_ids[:, -n:]
        hit = (body.unfold(1, n, 1) == question[:, None, :]).all(-1)  # [B, T - 2n + 1]
        rows = torch.arange(input_ids.shape[0], device=input_ids.device)
        return _mark_spans(hit, rows, input_ids.shape, width=n)


def _mark_spans(starts: torch.Tensor, rows: torch.Tensor, shape: torch.Size,
                width: int) -> torch.Tensor:
    """Bool ``shape``: positions ``s .. s + width - 1`` of row ``rows[i]`` for every true
    ``starts[i, s]`` (rows may repeat: their spans are OR-ed)."""
    marks = torch.zeros(shape, dtype=torch.long, device=starts.device)
    for offset in range(width):
        span = torch.zeros(starts.shape[0], shape[1], dtype=torch.long, device=starts.device)
        span[:, offset: offset + starts.shape[1]] = starts.long()
        marks.index_add_(0, rows, span)
    return marks > 0
