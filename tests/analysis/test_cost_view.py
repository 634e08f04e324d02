"""The cost table and picture carry the cost model's numbers (and hand counts)."""

from __future__ import annotations

import pytest

from nats import NatsConfig
from nats.analysis.cost_view import COST_METRICS, cost_figure, cost_rows
from nats.cost_model import all_linear, all_softmax, architecture_cost, compare_costs

CFG = NatsConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=2, softmax_heads_per_head=2,
                 head_dim_k=32, head_dim_v=32, chunk_size=16, layer_types=("nats", "softmax"))


def test_rows_are_the_cost_model_at_each_context() -> None:
    contexts = (1024, 4096)
    rows = cost_rows(compare_costs(CFG, [0.25, None], contexts=contexts))
    assert [r["context"] for r in rows] == list(contexts)
    for r, n in zip(rows, contexts, strict=True):
        for name, cfg, f in (("model", CFG, [0.25, None]),
                             ("all-softmax", all_softmax(CFG), [None, None]),
                             ("all-linear", all_linear(CFG), [None, None])):
            cost = architecture_cost(cfg, f, n)
            for m in COST_METRICS:
                assert r[f"{name}/{m.key}"] == pytest.approx(getattr(cost, m.key))


def test_kv_cache_hand_count() -> None:
    row = cost_rows(compare_costs(CFG, [0.25, None], contexts=(1024,)))[0]
    per_token = 2 * (32 + 32) * 2  # H (dk + dv) values of 2 bytes per layer
    # NAtS-L layer: a quarter of the 64 finished chunks of 16 tokens; softmax layer: all.
    assert row["model/kv_cache_bytes"] == 0.25 * 1024 * per_token + 1024 * per_token
    assert row["all-softmax/kv_cache_bytes"] == 2 * 1024 * per_token
    assert row["all-linear/kv_cache_bytes"] == 0


def test_figure_has_a_panel_per_metric() -> None:
    img = cost_figure(compare_costs(CFG, [0.25, None]))
    assert img.height == 360 * len(COST_METRICS) and img.width >= 760
