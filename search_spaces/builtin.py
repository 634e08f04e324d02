"""The built-in search spaces (written as a YAML file would hold them) and search bases."""

from __future__ import annotations

from typing import Any

from nats.config import LINEAR_OPS
from nats.trainers import TrainConfig, preset

BUILTIN_SPACES: dict[str, dict[str, Any]] = {
    "hybrid": {
        "description": "each layer's type and the NAtS-L layers' softmax budget",
        "params": {
            "layers": {"choices": ["nats", "gdn", "softmax"]},
            "softmax_target": [0.125, 0.25, 0.5],
        },
    },
    "chunk-and-mix": {
        "description": "chunk size, each layer's type and the softmax budget",
        "params": {
            "chunk_size": [16, 32, 64],
            "layers": {"choices": ["nats", "gdn", "softmax"]},
            "softmax_target": [0.125, 0.25, 0.5],
        },
    },
    "layer-mix": {
        "description": "each layer's type only (chunk size and lambda from the base)",
        "params": {"layers": {"choices": ["nats", "gdn", "softmax"]}},
    },
    "nats-every-k": {
        "description": "depth and a pattern: every k-th layer NAtS-L, the others one type",
        "params": {
            "n_layers": [2, 3, 4],
            "layers": {"every": [1, 2, 3], "kind": "nats", "other": ["gdn", "softmax"]},
            "reg_lambda": {"low": 0.001, "high": 0.3, "log": True},
        },
    },
    "full": {
        "description": "depth (per-layer types follow it), width, chunk size, softmax heads "
                       "per routing head, linear operator, lambda and learning rate",
        "params": {
            "n_layers": [2, 3, 4],
            "d_model": [64, 128],
            "chunk_size": [16, 32, 64, 128, 256],
            "layers": {"choices": ["nats", "gdn", "softmax"]},
            "softmax_heads_per_head": [1, 2, 4],
            "linear_op": list(LINEAR_OPS),
            "reg_lambda": {"low": 0.001, "high": 0.3, "log": True},
            "lr": {"low": 0.001, "high": 0.01, "log": True},
        },
    },
}
"""Name -> space mapping; ``hybrid`` is the default."""

DEFAULT_SPACE = "hybrid"

SEARCH_BASES = ("mqar-search",)
"""Bases only a search uses (beside the trainer presets)."""
DEFAULT_BASE = "mqar-search"


def search_base(name: str) -> TrainConfig:
    """A search base by name: ``mqar-search`` or any trainer preset (``nats train
    --preset``).

    ``mqar-search`` is the ``mqar-tiny`` task (4 key-value pairs, vocabulary 32) at 64
    tokens, four 16-token chunks with all the pairs in the first, and NAtS-L layers (the
    default recipe), trained 400 steps at lr 1e-2 (~50 s a trial on one CPU core),
    evaluated and checkpointed every 200.
    """
    if name == "mqar-search":
        base = preset("mqar-tiny")
        return base.replace(model=base.model.replace(layer_types=("nats", "nats")), steps=400,
                            seq_len=64, lr=1e-2, warmup_steps=40, eval_interval=200,
                            checkpoint_interval=200, keep_checkpoints=1, out_dir="runs/search")
    return preset(name)
