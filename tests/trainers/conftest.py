"""A micro training config that runs a step in well under a second on a CPU."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from nats import NatsConfig
from nats.trainers import TrainConfig

MicroConfig = Callable[..., TrainConfig]


@pytest.fixture
def micro(tmp_path: Path) -> MicroConfig:
    """``micro(**changes)``: a 2-layer NAtS copy-task run writing under ``tmp_path``."""

    def make(**changes: Any) -> TrainConfig:
        model = NatsConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=2,
                           softmax_heads_per_head=2, head_dim_k=16, head_dim_v=16,
                           chunk_size=16, layer_types=("nats", "nats"))
        base = TrainConfig(model=model, task="copy", steps=6, batch_size=2, seq_len=33,
                           lr=3e-3, warmup_steps=2, eval_interval=3, eval_batches=1,
                           log_interval=1, checkpoint_interval=100, copy_symbols=8,
                           device="cpu", out_dir=str(tmp_path / "run"))
        return base.replace(**changes)

    return make
