"""Generated sequence tasks whose answers are known exactly: copy, MQAR and needle retrieval
(and a per-batch mixture of them, for training on several difficulties).

All return HF-style ``(input_ids, labels)``: labels have the shape of the inputs, the
model shifts them, and ``-100`` marks positions that carry no loss.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, NoReturn

import torch

from nats.config import fail, whole_at_least
from nats.model import IGNORE_INDEX

from .text import stdlib_bytes

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

    ``pairs`` key-value pairs (keys from ``1 .. h - 1``, values from ``h .. 2h - 1``, all
    distinct, ``h = (V - noise) // 2``) form the context; then every key is asked once. A
    query is the key followed by its value; the loss is only on that value. The knobs
    (defaults: Zoology's layout):

    * ``placement``: ``start``, the pairs open the sequence back to back; ``scattered``,
      they sit at random even offsets among filler in the context region (the first
      ``2 * (T // 4)`` tokens, or everything before the queries when they are at the end);
      ``block``, back to back at one random even offset in that region: concentrated
      recall, where a few chunks hold everything the queries ask and the rest is filler.
    * ``filler`` (every other position): ``random`` tokens of the whole vocabulary (keys
      and values included), ``constant`` token 0 (never a key or value), or ``noise`` from
      the top ``noise_vocab`` tokens (default ``V // 4``), disjoint from keys and values.
    * ``queries``: ``power-law``, at gaps after the context drawn from ``p(g) ~ g^(power_a
      - 1)`` so that most come soon after it; ``end``, all in the last ``2 * pairs`` tokens
      in random order.
    """

    vocab_size: int
    seq_len: int
    pairs: int
    power_a: float = 0.01
    placement: str = "start"
    filler: str = "random"
    queries: str = "power-law"
    noise_vocab: int | None = None

    PLACEMENTS: ClassVar[tuple[str, ...]] = ("start", "scattered", "block")
    FILLERS: ClassVar[tuple[str, ...]] = ("random", "constant", "noise")
    QUERIES: ClassVar[tuple[str, ...]] = ("power-law", "end")
    CONSTANT_FILLER: ClassVar[int] = 0

    def __post_init__(self) -> None:
        for name in ("vocab_size", "seq_len", "pairs"):
            _check_int(self, name, 1)
        for name, allowed in (("placement", self.PLACEMENTS), ("filler", self.FILLERS),
                              ("queries", self.QUERIES)):
            if getattr(self, name) not in allowed:
                _fail(self, name, f"one of {allowed}")
        if not isinstance(self.power_a, (int, float)) or isinstance(self.power_a, bool) \
                or not 0 < self.power_a <= 1:
            _fail(self, "power_a", "a number in (0, 1]")
        if self.noise_vocab is not None:
            if self.filler != "noise":
                _fail(self, "noise_vocab", "None unless filler is 'noise'")
            _check_int(self, "noise_vocab", 1)
        if self.pairs > self.half - 1:
            _fail(self, "pairs", f"1 .. {self.half - 1}: keys are distinct tokens 1 .. h - 1, "
                  f"h = (vocab_size - noise tokens) // 2 = {self.half}")
        if self.seq_len < 4 * self.pairs:
            _fail(self, "seq_len", f"at least 4 * pairs = {4 * self.pairs}")

    @property
    def noise_tokens(self) -> range:
        """The noise filler's tokens (empty unless ``filler == "noise"``)."""
        n = 0 if self.filler != "noise" else self.noise_vocab or self.vocab_size // 4
        return range(self.vocab_size - n, self.vocab_size)

    @property
    def half(self) -> int:
        """``h``: keys are ``1 .. h - 1``, values ``h .. 2h - 1``."""
        return self.noise_tokens.start // 2

    @property
    def context_end(self) -> int:
        """End of the region that holds the pairs (queries come after it)."""
        if self.placement == "start":
            return 2 * self.pairs
        return self.seq_len - 2 * self.pairs if self.queries == "end" else 2 * (self.seq_len // 4)

    def sample(self, batch_size: int, generator: torch.Generator) -> Batch:
        b, d, half, t = batch_size, self.pairs, self.half, self.seq_len
        keys = torch.rand(b, half - 1, generator=generator).argsort(dim=1)[:, :d] + 1
        values = torch.rand(b, half, generator=generator).argsort(dim=1)[:, :d] + half
        if self.filler == "random":
            input_ids = torch.randint(0, self.vocab_size, (b, t), generator=generator)
        elif self.filler == "constant":
            input_ids = torch.full((b, t), self.CONSTANT_FILLER, dtype=torch.long)
        else:
            noise = self.noise_tokens
            input_ids = torch.randint(noise.start, noise.stop, (b, t), generator=generator)
        if self.placement == "start":
            pair_pos = torch.arange(0, 2 * d, 2).expand(b, d)
        elif self.placement == "block":
            offset = 2 * torch.randint(0, (self.context_end - 2 * d) // 2 + 1, (b, 1),
                                       generator=generator)
            pair_pos = offset + torch.arange(0, 2 * d, 2)
        else:
            slots = self.context_end // 2
            pair_pos = 2 * torch.rand(b, slots, generator=generator).argsort(dim=1)[:, :d]
        input_ids.scatter_(1, pair_pos, keys)
        input_ids.scatter_(1, pair_pos + 1, values)
        if self.queries == "power-law":
            space = (t - self.context_end) // 2
            gaps = torch.arange(1, space + 1, dtype=torch.float64)
            p = (self.power_a * gaps ** (self.power_a - 1)).expand(b, space)
            slots = torch.multinomial(p, d, replacement=False, generator=generator)
            query_pos = self.context_end + 2 * slots
        else:
            query_pos = t - 2 * d + 2 * torch.rand(b, d, generator=generator).argsort(dim=1)
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

    ``distractors`` more needles (keys whose first tokens differ from the real key's and
    from each other's, random values) hide at their own uniform depths, in random order,
    leaving ``H`` filler tokens less ``distractors`` needles. The haystack is ``random``
    filler tokens, the ``repeated`` passkey sentence (:data:`REPEATED_FILLER`, as in
    passkey retrieval), or ``text``: a random window of the Python standard library's
    sources. Text bytes become filler token ``filler_start + byte % len(filler)``, exact
    bytes when there are at least 256 filler tokens (printable ASCII from 128 on).
    """

    vocab_size: int
    seq_len: int
    key_len: int = 3
    distractors: int = 0
    haystack: str = "random"

    DIGITS: ClassVar[int] = 10
    VALUE_DIGITS: ClassVar[int] = 7
    ONE_SPAN: ClassVar[bool] = True
    """:meth:`relevant_positions` marks one span per row: evaluation reports accuracy by
    where it sits (:class:`~nats.trainers.evaluation.SpanPosition`)."""
    MIN_VOCAB: ClassVar[int] = 16
    HAYSTACKS: ClassVar[tuple[str, ...]] = ("random", "repeated", "text")
    REPEATED_FILLER: ClassVar[bytes] = (b"The grass is green. The sky is blue. The sun is "
                                        b"yellow. Here we go. There and back again. ")

    def __post_init__(self) -> None:
        _check_int(self, "vocab_size", self.MIN_VOCAB)
        _check_int(self, "key_len", 1)
        _check_int(self, "distractors", 0)
        if self.haystack not in self.HAYSTACKS:
            _fail(self, "haystack", f"one of {self.HAYSTACKS}")
        if self.distractors + 1 > len(self.key_tokens):
            _fail(self, "distractors", f"0 .. {len(self.key_tokens) - 1} (each needle's key "
                  f"starts with its own key token)")
        _check_int(self, "seq_len", self.min_seq_len(self.key_len, self.distractors))

    @classmethod
    def min_seq_len(cls, key_len: int, distractors: int = 0) -> int:
        """Every needle, the question and at least one filler token."""
        return (distractors + 2) * (key_len + cls.VALUE_DIGITS) + 1

    @property
    def key_tokens(self) -> range:
        return range(self.DIGITS, self.DIGITS + (self.vocab_size - self.DIGITS) // 2)

    @property
    def filler_tokens(self) -> range:
        return range(self.key_tokens.stop, self.vocab_size)

    def sample(self, batch_size: int, generator: torch.Generator) -> Batch:
        b, keys, m = batch_size, self.key_tokens, self.distractors
        needle_len = self.key_len + self.VALUE_DIGITS
        hay = self.seq_len - (m + 2) * needle_len
        key = torch.randint(keys.start, keys.stop, (b, self.key_len), generator=generator)
        value = self._values(b, generator)
        haystack = self._haystack(b, hay, generator)
        depth = torch.randint(0, hay + 1, (b, m + 1), generator=generator).sort(dim=1).values
        if m:
            first = torch.rand(b, len(keys), generator=generator).argsort(dim=1)[:, :m + 1]
            key[:, 0] = first[:, 0] + keys.start  # the first key tokens are all distinct
        needle = torch.cat([key, value], dim=1)
        needles = needle[:, None]  # [B, m + 1, n], in the order of their depths
        if m:
            other = torch.randint(keys.start, keys.stop, (b, m, self.key_len),
                                  generator=generator)
            other[..., 0] = first[:, 1:] + keys.start
            values = self._values(b * m, generator).view(b, m, self.VALUE_DIGITS)
            everything = torch.cat([needle[:, None], torch.cat([other, values], -1)], 1)
            order = torch.rand(b, m + 1, generator=generator).argsort(dim=1)
            needles = everything.gather(1, order[..., None].expand(-1, -1, needle_len))
        # Needle j (in depth order) starts after depth[j] filler tokens and j needles.
        body_len = hay + (m + 1) * needle_len
        starts = depth + torch.arange(m + 1) * needle_len
        in_needle = torch.zeros(b, body_len, dtype=torch.bool)
        for offset in range(needle_len):
            in_needle.scatter_(1, starts + offset, True)
        body = torch.empty(b, body_len, dtype=torch.long)
        body[in_needle] = needles.flatten()
        body[~in_needle] = haystack.flatten()
        input_ids = torch.cat([body, needle], dim=1)
        labels = torch.full_like(input_ids, IGNORE_INDEX)
        labels[:, -self.VALUE_DIGITS:] = needle[:, self.key_len:]
        return input_ids, labels

    def _values(self, count: int, generator: torch.Generator) -> torch.Tensor:
        """``count`` 7-digit values, the first digit non-zero."""
        return torch.cat([torch.randint(1, 10, (count, 1), generator=generator),
                          torch.randint(0, 10, (count, self.VALUE_DIGITS - 1),
                                        generator=generator)], dim=1)

    def _haystack(self, b: int, hay: int, generator: torch.Generator) -> torch.Tensor:
        filler = self.filler_tokens
        if self.haystack == "random":
            return torch.randint(filler.start, filler.stop, (b, hay), generator=generator)
        if self.haystack == "repeated":
            sentence = torch.tensor(list(self.REPEATED_FILLER))
            data = sentence.repeat(hay // len(sentence) + 1)[:hay].expand(b, hay)
        else:
            text = stdlib_bytes()
            if len(text) < hay:
                raise ValueError(f"the standard library holds {len(text)} bytes, fewer than "
                                 f"a haystack of {hay}")
            start = torch.randint(0, len(text) - hay + 1, (b, 1), generator=generator)
            data = text[start + torch.arange(hay)]
        return filler.start + data.long() % len(filler)

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


SyntheticTask = CopyTask | MQARTask | NeedleTask


@dataclass(frozen=True)
class TaskMixture:
    """Each batch from one of ``tasks``, picked uniformly by the batch's own generator.

    Zoology trains MQAR on a mixture of difficulties (4 .. 64 pairs): the easy batches
    teach the recall mechanism that the hard ones need and that a model trained on the
    hard ones alone may never find. One task per batch, not per row, keeps the rows
    stackable and every row's loss positions alike, so all tasks share one ``seq_len``.
    A task listed twice is drawn twice as often.
    """

    tasks: tuple[SyntheticTask, ...]

    def __post_init__(self) -> None:
        if not isinstance(self.tasks, tuple) or not self.tasks:
            _fail(self, "tasks", "a non-empty tuple of tasks")
        if len({task.seq_len for task in self.tasks}) > 1:
            _fail(self, "tasks", "tasks of one seq_len (their rows share a batch)")

    def sample(self, batch_size: int, generator: torch.Generator) -> Batch:
        pick = int(torch.randint(len(self.tasks), (), generator=generator))
        return self.tasks[pick].sample(batch_size, generator)


def _fail(task: object, name: str, allowed: str) -> NoReturn:
    fail(type(task).__name__, name, getattr(task, name), allowed)


def _check_int(task: object, name: str, least: int) -> None:
    value = getattr(task, name)
    if not whole_at_least(value, least):
        _fail(task, name, f"an integer >= {least}")


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
