"""Copy and MQAR batches have exactly the structure and loss masks their docstrings state."""

from __future__ import annotations

import torch

from nats.trainers import CopyTask, MQARTask

IGNORE = -100


def test_copy_layout_and_labels_by_hand() -> None:
    x, y = CopyTask(seq_len=9, symbols=5).sample(3, torch.Generator().manual_seed(0))
    assert x.shape == y.shape == (3, 9) and x.dtype == y.dtype == torch.long
    for row, labels in zip(x.tolist(), y.tolist(), strict=True):
        src = row[:4]
        assert row == [*src, 0, *src]
        assert all(1 <= s <= 5 for s in src)
        # HF convention: labels[t] is the target of the logits at t - 1, so the separator
        # (position 4) predicts the first copied symbol and the source carries no loss.
        assert labels == [IGNORE] * 5 + src


def test_copy_even_length_pads_with_an_unscored_separator() -> None:
    x, y = CopyTask(seq_len=8, symbols=3).sample(2, torch.Generator().manual_seed(1))
    assert x[:, 3].eq(0).all() and x[:, -1].eq(0).all()
    assert torch.equal(x[:, :3], x[:, 4:7])
    assert y[:, :4].eq(IGNORE).all()
    assert y[:, -1].eq(IGNORE).all() and torch.equal(y[:, 4:7], x[:, :3])


def test_copy_is_a_function_of_the_generator() -> None:
    task = CopyTask(seq_len=17, symbols=8)
    a = task.sample(4, torch.Generator().manual_seed(7))
    b = task.sample(4, torch.Generator().manual_seed(7))
    c = task.sample(4, torch.Generator().manual_seed(8))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[0], c[0])


def test_mqar_structure() -> None:
    vocab, seq_len, pairs = 32, 40, 6
    x, y = MQARTask(vocab, seq_len, pairs).sample(16, torch.Generator().manual_seed(3))
    assert x.shape == y.shape == (16, seq_len)
    assert x.min() >= 0 and x.max() < vocab
    for row, labels in zip(x.tolist(), y.tolist(), strict=True):
        keys, values = row[0:2 * pairs:2], row[1:2 * pairs:2]
        assert len(set(keys)) == pairs and all(1 <= k < vocab // 2 for k in keys)
        assert len(set(values)) == pairs and all(vocab // 2 <= v < vocab for v in values)
        answer = dict(zip(keys, values, strict=True))
        scored = [p for p, label in enumerate(labels) if label != IGNORE]
        assert len(scored) == pairs and min(scored) > 2 * pairs
        # Each scored position holds the value that follows its key in the context, and
        # every key is asked exactly once.
        asked = [row[p - 1] for p in scored]
        assert sorted(asked) == sorted(keys)
        assert all(labels[p] == row[p] == answer[row[p - 1]] for p in scored)


def test_mqar_query_gaps_favour_early_positions() -> None:
    # The power law puts most queries soon after the context (Zoology's design).
    _, y = MQARTask(256, 512, 8).sample(64, torch.Generator().manual_seed(0))
    positions = (y != IGNORE).nonzero()[:, 1].float() - 16
    assert positions.median() < (512 - 16) / 4
