"""The built-in search spaces (written as a YAML file would hold them) and search bases."""

from __future__ import annotations

from typing import Any

from nats.config import LINEAR_OPS
from nats.trainers import TrainConfig, preset

BUILTIN_SPACES: dict[str, dict[str, Any]] = {
    "hybrid": {
        "description": "each layer's type and the NAtS-L layers' softmax budget",
        "params": {
            "layers": {"choices": ["nats", "linear", "softmax"]},
            "softmax_target": [0.125, 0.25, 0.5],
        },
    },
    "chunk-and-mix": {
        "description": "chunk size, each layer's type and the softmax budget",
        "params": {
            "chunk_size": [16, 32, 64],
            "layers": {"choices": ["nats", "linear", "softmax"]},
            "softmax_target": [0.125, 0.25, 0.5],
        },
    },
    "layer-mix": {
        "description": "each layer's type only (chunk size and lambda from the base)",
        "params": {"layers": {"choices": ["nats", "linear", "softmax"]}},
    },
    "nats-every-k": {
        "description": "depth and a pattern: every k-th layer NAtS-L, the others one type",
        "params": {
            "n_layers": [2, 3, 4],
            "layers": {"every": [1, 2, 3], "kind": "nats", "other": ["linear", "softmax"]},
            "reg_lambda": {"low": 0.001, "high": 0.3, "log": True},
        },
    },
    "full": {
        "description": "depth (per-layer types follow it), width, chunk size, softmax heads "
                       "per routing head, linear operator, branch norm, softmax gain, softmax "
                       "q/k/v, scorer pool, budget annealing, lambda and learning rate",
        "params": {
            "n_layers": [2, 3, 4],
            "d_model": [64, 128],
            "chunk_size": [16, 32, 64, 128, 256],
            "layers": {"choices": ["nats", "linear", "softmax"]},
            "softmax_heads_per_head": [1, 2, 4],
            "linear_op": list(LINEAR_OPS),
            # Recall learns best with "scaled", the byte LM with "scaled" and a learned
            # softmax gain started at 0.05; "linear" once won the needle on 3 seeds of 3,
            # which did not reproduce (docs/RESULTS.md).
            "branch_norm": ["both", "linear", "scaled"],
            "softmax_gain_init": [None, 0.05],
            # Its own q/k/v let the routed model retrieve the needle on a GPU (docs/RESULTS.md).
            "softmax_qkv": ["shared", "own"],
            # The mean (the official layer's pool) learned small-scale recall faster on a
            # CPU; the max (the default) answers needles a boundary cuts and learned
            # concentrated recall on more seeds (docs/RESULTS.md, "The max pool at GPU scale").
            "scorer_pool": ["mean", "max"],
            # Annealed over 30 % of the run, concentrated recall was learned on every seed
            # with a higher routing lift (docs/RESULTS.md, "Beyond the linear state").
            "budget_anneal": [0.0, 0.3],
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

    ``mqar-search`` is a recall load concentrated in one chunk, sized so that a laptop
    finds a hybrid: 8 key-value pairs (vocabulary 80) open a 64-token sequence, filling
    the first of its four 16-token chunks, and are asked among noise filler in the rest.
    In 300 steps at lr 1e-2 (about 1-1.5 min a trial on one CPU core) Gated DeltaNet
    and the transformer stay near chance while NAtS-L learns it (docs/RESULTS.md, "The
    README's main job"). Its NAtS-L layers hold a softmax budget of 0.5: three of the
    four chunks are routable (the last one's route changes nothing) and one holds the
    pairs, a third, more than 0.25 allows. The scorers learn at 5x the lr, so the pairs'
    chunk is found before the recall is learned rather than after. The softmax output is
    merged at the linear branch's scale (``branch_norm="scaled"``), with which every seed
    learns the recall, in 300 steps as well as the default norm did in 400 (0.91-1.00;
    0.77-1.00 with the default norm in 400 steps).
    """
    if name == "mqar-search":
        base = preset("mqar-tiny")
        model = base.model.replace(vocab_size=80, layer_types=("nats", "nats"),
                                   softmax_target=0.5, branch_norm="scaled")
        return base.replace(model=model, steps=300, seq_len=64, mqar_pairs=8,
                            mqar_filler="noise", lr=1e-2, warmup_steps=40,
                            router_lr_scale=5.0, eval_interval=150, checkpoint_interval=150,
                            keep_checkpoints=1, out_dir="runs/search")
    return preset(name)
