"""Routing statistics against a direct recount of a real model's routes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from nats import NatsConfig, NatsForCausalLM
from nats.analysis.route_stats import BINS, collect_route_stats
from nats.kernels import SOFTMAX


def test_statistics_equal_a_recount() -> None:
    torch.manual_seed(0)
    cfg = NatsConfig(vocab_size=32, d_model=32, n_layers=3, n_heads=2, softmax_heads_per_head=2,
                     head_dim_k=16, head_dim_v=16, chunk_size=16,
                     layer_types=("nats", "softmax", "nats"))
    model = NatsForCausalLM(cfg)
    with torch.no_grad():  # scorers that split the chunks: both routes occur
        for layer in model.nats_layers:
            layer.scorer.proj.weight.normal_(0, 2.0)
    seq_len = 40  # 3 chunks, the last partial (8 tokens)
    batches = [(torch.randint(0, 32, (3, seq_len)), torch.zeros(3, seq_len, dtype=torch.long))
               for _ in range(2)]

    def relevant(ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return ids == 5  # any fixed rule: the recount applies the same one

    stats = collect_route_stats(model, batches, relevant, progress=False)
    assert sorted(stats) == [0, 2]
    for i, s in stats.items():
        sm_tokens = np.zeros(2)
        sm_chunks = np.zeros(2)
        rel_chunks, rel_sm = 0, np.zeros(2)
        hist = np.zeros((2, BINS))
        chunks = 0
        for ids, labels in batches:
            with torch.no_grad():
                out = model(ids)
            r, p = out.routes[i], out.probs[i]
            mark = relevant(ids, labels)
            for b in range(ids.shape[0]):
                for c in range(3):
                    size = min(16, seq_len - 16 * c)
                    has = bool(mark[b, 16 * c: 16 * c + size].any())
                    rel_chunks += has
                    chunks += 1
                    for h in range(2):
                        is_sm = bool(r[b, c, h, SOFTMAX] > 0.5)
                        sm_tokens[h] += size * is_sm
                        sm_chunks[h] += is_sm
                        rel_sm[h] += is_sm and has
                        hist[h, min(int(float(p[b, c, h, SOFTMAX]) * BINS), BINS - 1)] += 1
        assert s.tokens == 2 * 3 * seq_len and s.chunks == chunks == 18
        assert s.softmax_tokens.tolist() == sm_tokens.tolist()
        assert s.softmax_fraction == pytest.approx(sm_tokens / (2 * 3 * seq_len))
        assert s.base_rate == pytest.approx(sm_chunks / 18)
        assert s.relevant_chunks == rel_chunks > 0
        assert s.relevant_rate == pytest.approx(rel_sm / rel_chunks)
        assert s.other_rate == pytest.approx((sm_chunks - rel_sm) / (18 - rel_chunks))
        assert s.prob_hist.tolist() == hist.tolist()
    assert 0 < sum(s.softmax_tokens.sum() for s in stats.values()) < 2 * 2 * 2 * 3 * seq_len


def test_without_a_mask_there_is_no_relevant_rate() -> None:
    cfg = NatsConfig(vocab_size=32, d_model=32, n_layers=1, n_heads=1, head_dim_k=16,
                     head_dim_v=16, chunk_size=16, layer_types=("nats",))
    batch = (torch.randint(0, 32, (1, 32)), torch.zeros(1, 32, dtype=torch.long))
    s = collect_route_stats(NatsForCausalLM(cfg), [batch], progress=False)[0]
    assert s.relevant_chunks == 0 and s.relevant_rate is None and s.other_rate is None
    assert s.prob_hist.sum() == 2
