"""The default router learns which chunks matter and holds its budget (a CPU regression
test of what docs/RESULTS.md measures at GPU scale).

One run, shared by the tests: MQAR with its 4 key-value pairs in the first of four
16-token chunks (Zoology's layout), a 2-layer NAtS-L model of width 64 trained with the
defaults (route gradients for both options, budgeted standardised scores at 25 %) for 600
steps, about 75 s on one CPU core. Measured over seeds 0-2 (docs/RESULTS.md, "CPU
regression run"): the chunk holding the pairs went to softmax 47-55 % of the time, other
chunks 13-14 % (per layer the lift varies: one layer may route blind), and 25-28 % of
all routable chunks; accuracy was 0.96 (seed 0) and 0.17-0.20 (seeds 1, 2) against 0.06
for chance, while the same model forced all-linear reached 0.99. The official recipe
routed blind (0.64 against 0.63 after 300 steps).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from nats import NatsConfig
from nats.trainers import TrainConfig, train


@pytest.fixture(scope="module")
def metrics(tmp_path_factory: pytest.TempPathFactory) -> dict[str, float]:
    torch.set_num_threads(1)  # the measured numbers above are single-threaded
    model = NatsConfig(vocab_size=32, d_model=64, n_layers=2, n_heads=2,
                       softmax_heads_per_head=2, head_dim_k=32, head_dim_v=32, chunk_size=16,
                       layer_types=("nats", "nats"), rope=True)
    out: Path = tmp_path_factory.mktemp("routing") / "run"
    config = TrainConfig(model=model, task="mqar", steps=600, batch_size=32, seq_len=64,
                         mqar_pairs=4, lr=1e-2, warmup_steps=60, eval_interval=600,
                         eval_batches=4, log_interval=100, checkpoint_interval=1000,
                         device="cpu", out_dir=str(out))
    return train(config).eval_metrics


def test_the_chunk_holding_the_pairs_goes_to_softmax_far_more_often(metrics) -> None:
    assert metrics["eval/route_informative"] > 2.0 * metrics["eval/route_filler"]


def test_the_budget_holds_on_the_training_distribution(metrics) -> None:
    assert metrics["eval/route_frac"] == pytest.approx(0.25, abs=0.03)


def test_the_model_learns_some_of_the_recall(metrics) -> None:
    # Twice chance (1 in 16 values): every seed measured passes, while where it lands
    # above that depends on the seed (0.16-0.96), so no tighter bound is honest here.
    assert metrics["eval/acc"] > 0.12
