"""The latency a search can optimise: what is timed, on which tokens, and what it leaves."""

from __future__ import annotations

import time

import torch

from nats import NatsConfig, NatsForCausalLM
from nats.latency import median_ms, prefill_latency_ms, tile_tokens


def test_tile_tokens_lays_rows_end_to_end_and_repeats() -> None:
    ids = torch.tensor([[1, 2, 3], [4, 5, 6]])
    assert tile_tokens(ids, 4).tolist() == [[1, 2, 3, 4]]
    assert tile_tokens(ids, 8).tolist() == [[1, 2, 3, 4, 5, 6, 1, 2]]


def test_median_ms_times_every_repeat_after_the_warmup() -> None:
    calls = []

    def work() -> None:
        calls.append(1)
        time.sleep(0.004)

    ms = median_ms(work, torch.device("cpu"), warmup=2, repeats=3)
    assert len(calls) == 5
    assert ms >= 4.0


def test_prefill_latency_runs_the_model_on_the_tiled_tokens_and_restores_its_mode() -> None:
    cfg = NatsConfig(vocab_size=16, d_model=16, n_layers=1, n_heads=1, head_dim_k=8,
                     head_dim_v=8, chunk_size=16, layer_types=("nats",))
    model = NatsForCausalLM(cfg).train()
    seen: list[torch.Tensor] = []
    model.register_forward_pre_hook(lambda module, args: seen.append(args[0]))
    ids = torch.arange(10).view(2, 5)
    ms = prefill_latency_ms(model, ids, 24)
    assert ms > 0 and model.training
    assert all(t.shape == (1, 24) for t in seen) and len(seen) == 7  # 2 warm-up + 5 timed
    assert torch.equal(seen[0], tile_tokens(ids, 24))
