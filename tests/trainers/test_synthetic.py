"""Copy, MQAR and needle batches have exactly the structure and loss masks their docstrings
state."""

from __future__ import annotations

import torch

from nats.trainers import CopyTask, MQARTask, NeedleTask

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


def test_mqar_labels_are_only_on_query_values() -> None:
    x, y = MQARTask(64, 48, 5).sample(8, torch.Generator().manual_seed(5))
    scored = y != IGNORE
    assert torch.equal(y[scored], x[scored])
    assert scored[:, :10].sum() == 0 and scored.sum(1).tolist() == [5] * 8
    # The token before every scored value is a key of the context (a query).
    before = torch.roll(scored, -1, dims=1)
    keys = x[:, 0:10:2]
    assert all(set(x[i][before[i]].tolist()) == set(keys[i].tolist()) for i in range(8))


def test_needle_layout_and_answer_labels() -> None:
    vocab, seq_len, key_len = 40, 60, 3
    task = NeedleTask(vocab, seq_len, key_len)
    x, y = task.sample(256, torch.Generator().manual_seed(0))
    assert x.shape == y.shape == (256, seq_len) and x.dtype == y.dtype == torch.long
    n = key_len + 7
    hay = seq_len - 2 * n
    keys = range(10, 10 + (vocab - 10) // 2)
    depths = []
    for row, labels in zip(x.tolist(), y.tolist(), strict=True):
        body, question = row[:-n], row[-n:]
        key, value = question[:key_len], question[key_len:]
        assert all(t in keys for t in key)
        assert all(0 <= d <= 9 for d in value) and value[0] != 0
        # The only key and digit tokens of the body are the needle, at its depth.
        special = [i for i, t in enumerate(body) if t < keys.stop]
        depth = special[0]
        assert special == list(range(depth, depth + n))
        assert body[depth:depth + n] == question
        assert all(keys.stop <= t < vocab for i, t in enumerate(body) if i not in special)
        assert labels == [IGNORE] * (seq_len - 7) + value
        depths.append(depth)
    assert min(depths) <= 2 and max(depths) >= hay - 2 and len(set(depths)) > hay // 2
    assert abs(sum(depths) / len(depths) - hay / 2) < hay / 8  # uniform over 0 .. hay


def test_needle_works_at_the_smallest_vocab_and_length() -> None:
    task = NeedleTask(NeedleTask.MIN_VOCAB, NeedleTask.min_seq_len(2), 2)
    x, y = task.sample(64, torch.Generator().manual_seed(1))
    assert x.shape[1] == 2 * 9 + 1 and x.max() < 16
    assert torch.equal(y[:, -7:], x[:, -7:]) and (y[:, :-7] == IGNORE).all()
    depth = (x[:, :-9] < 13).int().argmax(1)
    assert set(depth.tolist()) == {0, 1}
    again = task.sample(64, torch.Generator().manual_seed(1))
    assert torch.equal(x, again[0]) and torch.equal(y, again[1])


def test_mqar_relevant_positions_by_hand() -> None:
    # Row 0: pairs (3,9) (4,8), filler, query 4 -> 8 at 6-7, query 3 -> 9 at 8-9.
    # Row 1: the pair (5,9) also occurs by chance at 4-5; both occurrences are marked, the
    # query itself (6-7) is not, and the unqueried pair (2,8) at 0-1 is not.
    x = torch.tensor([[3, 9, 4, 8, 1, 1, 4, 8, 3, 9],
                      [2, 8, 5, 9, 5, 9, 5, 9, 1, 1]])
    y = torch.full_like(x, IGNORE)
    y[0, 7], y[0, 9], y[1, 7] = 8, 9, 9
    mask = MQARTask.relevant_positions(x, y)
    assert mask.dtype == torch.bool and mask.shape == x.shape
    assert mask.nonzero().tolist() == [[0, 0], [0, 1], [0, 2], [0, 3],
                                       [1, 2], [1, 3], [1, 4], [1, 5]]


def test_mqar_relevant_positions_are_the_context_pairs() -> None:
    vocab, pairs = 64, 5
    x, y = MQARTask(vocab, 48, pairs).sample(8, torch.Generator().manual_seed(2))
    mask = MQARTask.relevant_positions(x, y)
    # Every key is queried, so the whole context (2 * pairs tokens) is relevant; beyond it
    # only a chance repeat of a key-value bigram in the random filler could be.
    assert mask[:, :2 * pairs].all()
    for i, j in mask[:, 2 * pairs:].nonzero().tolist():
        j += 2 * pairs
        pair = dict(zip(x[i, 0:2 * pairs:2].tolist(), x[i, 1:2 * pairs:2].tolist(),
                        strict=True))
        assert pair.get(int(x[i, j])) == x[i, j + 1] or pair.get(int(x[i, j - 1])) == x[i, j]


def test_needle_relevant_positions_by_hand() -> None:
    task = NeedleTask(vocab_size=16, seq_len=28, key_len=2)
    # Digits 0-9, keys 10-12, filler 13-15. Needle key (11, 12), value 1234567; row 1 also
    # holds a distractor with key (10, 12) and the same value, which is not marked.
    needle = [11, 12, 1, 2, 3, 4, 5, 6, 7]
    distractor = [10, 12, 1, 2, 3, 4, 5, 6, 7]
    x = torch.tensor([[*needle, *[14] * 10, *needle],
                      [15, *distractor, *needle, *needle]])
    y = torch.full_like(x, IGNORE)
    y[:, -7:] = torch.tensor([1, 2, 3, 4, 5, 6, 7])
    mask = task.relevant_positions(x, y)
    assert mask[0].nonzero().flatten().tolist() == list(range(0, 9))
    assert mask[1].nonzero().flatten().tolist() == list(range(10, 19))


def test_needle_relevant_positions_match_the_sampled_depth() -> None:
    task = NeedleTask(40, 60, 3)
    x, y = task.sample(32, torch.Generator().manual_seed(4))
    mask = task.relevant_positions(x, y)
    assert mask.sum(1).tolist() == [10] * 32 and not mask[:, -10:].any()
    depth = (x[:, :-10] < 25).int().argmax(1)  # first key or digit token of the body
    for i, d in enumerate(depth.tolist()):
        assert mask[i].nonzero().flatten().tolist() == list(range(d, d + 10))
