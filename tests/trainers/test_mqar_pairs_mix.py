"""Training on a mixture of MQAR pair counts: one count per batch, drawn from the seed.

Each key is asked once, so a batch with ``n`` pairs has exactly ``n`` loss positions per
row; the tests count them instead of trusting the task's own bookkeeping.
"""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

import pytest
import torch

from nats.config import ConfigError
from nats.trainers import MQARTask, TrainConfig, build_batches, train
from nats.trainers.config import config_from_file, preset, run_config
from nats.trainers.synthetic import TaskMixture

from .conftest import MicroConfig

IGNORE = -100


def _mqar(micro: MicroConfig, **changes: Any) -> TrainConfig:
    return micro(**{"task": "mqar", "seq_len": 32, "mqar_pairs": 2, **changes})


def _pairs_per_batch(labels: torch.Tensor) -> int:
    """The batch's pair count: its loss positions per row, the same in every row."""
    per_row = (labels != IGNORE).sum(dim=1)
    assert (per_row == per_row[0]).all(), per_row
    return int(per_row[0])


def _answers_match_the_context(input_ids: torch.Tensor, labels: torch.Tensor,
                               pairs: int) -> bool:
    """Placement ``start``, queries ``end``: the pairs open the row, the queries close it,
    and every scored value is the one its key was paired with."""
    t = input_ids.shape[1]
    for row, lab in zip(input_ids.tolist(), labels.tolist(), strict=True):
        context = {row[2 * i]: row[2 * i + 1] for i in range(pairs)}
        scored = [p for p, v in enumerate(lab) if v != IGNORE]
        if len(context) != pairs or sorted(scored) != list(range(t - 2 * pairs + 1, t, 2)):
            return False
        if any(context.get(row[p - 1]) != lab[p] for p in scored):
            return False
    return True


def test_training_batches_draw_every_count_of_the_mix_and_only_those(
        micro: MicroConfig) -> None:
    config = _mqar(micro, mqar_pairs_mix=(1, 3, 8), mqar_queries="end")
    batches = build_batches(config)
    counts = Counter()
    for step in range(300):
        input_ids, labels = batches.train(step)
        pairs = _pairs_per_batch(labels)
        counts[pairs] += 1
        if step < 30:
            assert _answers_match_the_context(input_ids, labels, pairs), step
    assert set(counts) == {1, 3, 8}
    # Uniform: 100 expected each, standard deviation ~8.2.
    assert all(60 < c < 140 for c in counts.values()), counts
    # Evaluation stays on mqar_pairs alone.
    assert [_pairs_per_batch(y) for _, y in batches.eval(4)] == [2] * 4


def test_a_repeated_count_is_drawn_more_often(micro: MicroConfig) -> None:
    batches = build_batches(_mqar(micro, mqar_pairs_mix=(4, 4, 4, 1)))
    counts = Counter(_pairs_per_batch(batches.train(s)[1]) for s in range(200))
    assert set(counts) == {1, 4} and counts[4] > 2 * counts[1], counts


def test_the_mix_is_reproducible_from_the_seed(micro: MicroConfig) -> None:
    config = _mqar(micro, mqar_pairs_mix=(1, 2, 4, 8))
    first, again = build_batches(config), build_batches(config)
    other = build_batches(config.replace(seed=1))
    for step in range(20):
        for a, b in zip(first.train(step), again.train(step), strict=True):
            assert torch.equal(a, b)
    sequence = [_pairs_per_batch(first.train(s)[1]) for s in range(20)]
    other_sequence = [_pairs_per_batch(other.train(s)[1]) for s in range(20)]
    assert len(set(sequence)) > 1 and sequence != other_sequence


def test_without_a_mix_every_batch_has_mqar_pairs(micro: MicroConfig) -> None:
    config = _mqar(micro, mqar_pairs=3)
    assert isinstance(config.training_task(), MQARTask)
    batches = build_batches(config)
    assert {_pairs_per_batch(batches.train(s)[1]) for s in range(10)} == {3}


@pytest.mark.parametrize(("changes", "allowed"), [
    ({"task": "copy", "mqar_pairs_mix": (2, 4)}, "() unless task is 'mqar'"),
    ({"mqar_pairs_mix": (0, 4)}, "integers >= 1"),
    ({"mqar_pairs_mix": (True, 4)}, "integers >= 1"),
    ({"mqar_pairs_mix": (2.0, 4)}, "integers >= 1"),
    ({"mqar_pairs_mix": [2, 4]}, "a tuple of pair counts"),
    ({"mqar_pairs_mix": (4, 9)}, "1 .. seq_len // 4 = 8"),
    ({"seq_len": 256, "mqar_pairs_mix": (4, 32)}, "1 .. 31 (distinct keys"),
    # Noise filler takes V // 4 = 16 tokens: h = (64 - 16) // 2 = 24, so keys 1 .. 23.
    ({"seq_len": 256, "mqar_filler": "noise", "mqar_pairs_mix": (24,)}, "1 .. 23"),
])
def test_bad_mixes_name_the_field_and_the_allowed_values(
        micro: MicroConfig, changes: dict[str, Any], allowed: str) -> None:
    with pytest.raises(ConfigError) as err:
        _mqar(micro, **changes)
    assert "TrainConfig.mqar_pairs_mix = " in str(err.value)
    assert allowed in str(err.value)


def test_largest_allowed_counts_are_accepted(micro: MicroConfig) -> None:
    config = _mqar(micro, seq_len=256, mqar_filler="noise", mqar_pairs_mix=(1, 23))
    assert _pairs_per_batch(build_batches(config).train(0)[1]) in (1, 23)
    assert _mqar(micro, mqar_pairs_mix=(8,)).mqar_pairs_mix == (8,)


def test_mixture_rejects_no_tasks_and_unequal_lengths() -> None:
    with pytest.raises(ConfigError, match=r"TaskMixture\.tasks = \(\) .*non-empty"):
        TaskMixture(())
    with pytest.raises(ConfigError, match=r"TaskMixture\.tasks = .*one seq_len"):
        TaskMixture((MQARTask(32, 32, 2), MQARTask(32, 64, 2)))


def test_the_mix_survives_the_saved_train_config(micro: MicroConfig) -> None:
    config = _mqar(micro, mqar_pairs_mix=(1, 4, 8), steps=2, eval_interval=2)
    train(config)
    path = f"{config.out_dir}/train_config.json"
    with open(path) as f:
        assert json.load(f)["mqar_pairs_mix"] == [1, 4, 8]
    assert config_from_file(path, preset("tiny")) == config
    resumed = run_config("tiny", {"out_dir": config.out_dir, "steps": 4}, resume=True)
    assert resumed == config.replace(steps=4)
    assert resumed.mqar_pairs_mix == (1, 4, 8)
