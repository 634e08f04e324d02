"""The MQAR and needle knobs produce the layouts their docstrings claim, checked row by row."""

from __future__ import annotations

import pytest
import torch

from nats.config import ConfigError
from nats.trainers import MQARTask, NeedleTask
from nats.trainers.text import stdlib_bytes

IGNORE = -100


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _pairs_and_queries(row: list[int], labels: list[int]) -> tuple[dict[int, int], list[int]]:
    """``{key position: value}`` of the pairs that queries ask, and the scored positions."""
    scored = [p for p, label in enumerate(labels) if label != IGNORE]
    pairs = {p: row[p + 1] for p in range(len(row) - 1)
             if any(row[p] == row[q - 1] and row[p + 1] == row[q] and p + 1 < q - 1
                    for q in scored)}
    return pairs, scored


def test_mqar_scattered_pairs_sit_among_filler_in_the_context() -> None:
    task = MQARTask(64, 64, 6, placement="scattered", filler="noise")
    x, y = task.sample(32, _gen())
    ctx = task.context_end
    assert ctx == 32
    starts = set()
    for row, labels in zip(x.tolist(), y.tolist(), strict=True):
        pairs, scored = _pairs_and_queries(row, labels)
        assert len(pairs) == 6 and len(scored) == 6
        assert all(p % 2 == 0 and p + 1 < ctx for p in pairs)  # even slots in the context
        assert all(q - 1 >= ctx for q in scored)                # queries after it
        starts.add(min(pairs))
    assert len(starts) > 3 and max(starts) > 0  # not all at the start of the row


def test_mqar_noise_filler_is_disjoint_from_keys_and_values() -> None:
    task = MQARTask(64, 48, 5, filler="noise", noise_vocab=16)
    assert task.noise_tokens == range(48, 64) and task.half == 24
    x, y = task.sample(16, _gen(1))
    mask = MQARTask.relevant_positions(x, y)
    queries = (y != IGNORE) | (y != IGNORE).roll(-1, 1)
    special = mask | queries
    assert (x[~special] >= 48).all()                       # filler: noise tokens only
    keys, values = x[:, 0:10:2], x[:, 1:10:2]
    assert ((keys >= 1) & (keys < 24)).all() and ((values >= 24) & (values < 48)).all()
    # Disjoint filler: no chance repeats, so the relevant positions are exactly the pairs.
    assert mask[:, :10].all() and not mask[:, 10:].any()


def test_mqar_constant_filler_and_queries_at_the_end() -> None:
    task = MQARTask(32, 40, 4, filler="constant", queries="end")
    x, y = task.sample(8, _gen(2))
    scored = (y != IGNORE).nonzero()[:, 1].view(8, 4)
    assert (scored == torch.tensor([33, 35, 37, 39])).all()  # the last 2 * pairs tokens
    assert (x[:, 8:32] == MQARTask.CONSTANT_FILLER).all()
    for row in x.tolist():
        context = dict(zip(row[0:8:2], row[1:8:2], strict=True))
        asked = dict(zip(row[32::2], row[33::2], strict=True))
        assert asked == context                             # every key once, in any order
    orders = {tuple(row[32::2]) for row in x.tolist()}
    assert len(orders) > 1


def test_mqar_scattered_with_queries_at_the_end_uses_everything_before_them() -> None:
    task = MQARTask(32, 40, 4, placement="scattered", filler="constant", queries="end")
    assert task.context_end == 32
    x, y = task.sample(64, _gen(3))
    body = x[:, :32]
    assert ((body != 0).sum(1) == 8).all()
    assert (body != 0).any(0).sum() > 16  # the pairs land all over the context region
    mask = MQARTask.relevant_positions(x, y)
    assert torch.equal(mask[:, :32], body != 0) and not mask[:, 32:].any()


@pytest.mark.parametrize(("changes", "field"), [
    ({"filler": "zeros"}, "MQARTask.filler"), ({"placement": "middle"}, "MQARTask.placement"),
    ({"queries": "start"}, "MQARTask.queries"), ({"noise_vocab": 4}, "MQARTask.noise_vocab"),
    ({"pairs": 16}, "MQARTask.pairs"), ({"seq_len": 20}, "MQARTask.seq_len"),
    ({"power_a": 0}, "MQARTask.power_a")])
def test_mqar_bad_knobs_name_the_field(changes: dict, field: str) -> None:
    args = {"vocab_size": 32, "seq_len": 32, "pairs": 6, **changes}
    with pytest.raises(ConfigError, match=field):
        MQARTask(**args)


def test_needle_distractors_have_distinct_keys_and_only_the_needle_is_relevant() -> None:
    task = NeedleTask(60, 120, 3, distractors=3)
    x, y = task.sample(64, _gen())
    keys, n = task.key_tokens, 10
    mask = task.relevant_positions(x, y)
    assert mask.sum(1).tolist() == [n] * 64
    real_ranks = set()
    for row, marked in zip(x.tolist(), mask.tolist(), strict=True):
        body, question = row[:-n], row[-n:]
        # Needles are the runs of key/digit tokens: each a key then 7 digits.
        starts = [i for i, t in enumerate(body) if t in keys and (i == 0 or body[i - 1] not in
                                                                   keys)]
        assert len(starts) == 4
        needles = [body[s:s + n] for s in starts]
        assert all(all(t < 10 for t in nd[3:]) and nd[3] != 0 for nd in needles)
        assert len({nd[0] for nd in needles}) == 4               # distinct first key tokens
        assert needles.count(question) == 1
        real = starts[needles.index(question)]
        assert [i for i, m in enumerate(marked) if m] == list(range(real, real + n))
        real_ranks.add(needles.index(question))
        others = [i for i, t in enumerate(body) if t < keys.stop and not real <= i < real + n]
        assert len(others) == 3 * n
    assert real_ranks == {0, 1, 2, 3}  # the real needle is not always first


def test_needle_repeated_haystack_is_the_passkey_sentence() -> None:
    task = NeedleTask(10 + 2 * 256, 300, 3, haystack="repeated")
    x, y = task.sample(4, _gen(1))
    mask = task.relevant_positions(x, y)
    filler_start = task.filler_tokens.start
    for row, marked in zip(x[:, :-10], mask[:, :-10], strict=True):
        hay = bytes((row[~marked] - filler_start).tolist())
        sentence = NeedleTask.REPEATED_FILLER
        assert hay == (sentence * 10)[:len(hay)]


def test_needle_text_haystack_is_stdlib_source_bytes() -> None:
    task = NeedleTask(10 + 2 * 256, 200, 3, distractors=1, haystack="text")
    x, _ = task.sample(4, _gen(2))
    source = bytes(stdlib_bytes().numpy())
    filler_start = task.filler_tokens.start
    hays = set()
    for row in x[:, :-10].tolist():
        hay = [t - filler_start for t in row if t >= filler_start]
        assert len(hay) == 200 - 3 * 10 and bytes(hay) in source
        hays.add(bytes(hay))
    assert len(hays) == 4
    # With fewer than 256 filler tokens the bytes fold into the filler range 25 .. 39.
    small = NeedleTask(40, 200, 3, haystack="text")
    body = small.sample(4, _gen(2))[0][:, :-10]
    assert ((body >= 25).sum(1) == 180).all() and body.max() < 40
    assert len(body[body >= 25].unique()) > 10


@pytest.mark.parametrize(("changes", "field"), [
    ({"haystack": "essays"}, "NeedleTask.haystack"),
    ({"distractors": 15}, "NeedleTask.distractors"), ({"distractors": -1}, "distractors"),
    ({"seq_len": 30, "distractors": 1}, "NeedleTask.seq_len"), ({"vocab_size": 12}, "vocab")])
def test_needle_bad_knobs_name_the_field(changes: dict, field: str) -> None:
    args = {"vocab_size": 40, "seq_len": 64, "key_len": 3, **changes}
    with pytest.raises(ConfigError, match=field):
        NeedleTask(**args)


def test_train_config_passes_the_knobs_to_its_batches(micro) -> None:
    from nats.trainers import build_batches

    config = micro(task="mqar", seq_len=48, mqar_pairs=4, mqar_filler="constant",
                   mqar_queries="end")
    assert config.synthetic_task() == MQARTask(64, 48, 4, filler="constant", queries="end")
    x, y = build_batches(config).train(0)
    assert (y[:, -8:][:, 1::2] != IGNORE).all() and (x[:, 8:40] == 0).all()
    config = micro(task="needle", seq_len=64, needle_distractors=2, needle_haystack="repeated")
    assert config.synthetic_task() == NeedleTask(64, 64, 3, distractors=2, haystack="repeated")


def test_train_config_names_a_bad_knob(micro) -> None:
    with pytest.raises(ConfigError, match=r"TrainConfig.mqar_filler = 'zeros'"):
        micro(task="mqar", mqar_filler="zeros")
    with pytest.raises(ConfigError, match=r"TrainConfig.needle_distractors = -1"):
        micro(task="needle", needle_distractors=-1)
    with pytest.raises(ConfigError, match=r"task 'needle': NeedleTask.seq_len = 25"):
        micro(task="needle", seq_len=25, needle_distractors=1)
