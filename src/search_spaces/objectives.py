"""What a search optimises: a quality metric of the evaluation and a cost from the cost model.

The cost of a trial is :func:`nats.cost_model.architecture_cost` of its model at
a target context length, with each NAtS-L layer's softmax fraction as measured by the
trial's latest evaluation (``eval/attn_frac/layer{i}``); plain softmax and linear
layers have their implied fractions (1 and 0).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from nats.config import NatsConfig
from nats.cost_model import architecture_cost
from nats.trainers.evaluation import layer_fractions

QUALITY = {
    "loss": ("eval/ce", "min"),
    "acc": ("eval/acc", "max"),
    "seq_acc": ("eval/seq_acc", "max"),
    "bpb": ("eval/bpb", "min"),
}
"""``--metric`` -> (reported key, mode). ``loss`` is the cross-entropy without the routing
regulariser (``eval/loss`` adds lambda times the scorer's mean softmax probability, which
would make trials with different lambda incomparable); ``bpb`` exists for task ``text`` only."""

COSTS = {
    "flops": ("cost/flops_per_token", "min"),
    "kv": ("cost/kv_cache_bytes", "min"),
    "cache": ("cost/cache_bytes", "min"),
    "latency": ("cost/latency_ms", "min"),
}
"""``--cost`` -> (reported key, mode): token-mixer FLOPs per token averaged over a
``context``-token sequence, KV-cache bytes after ``context`` tokens, KV cache plus
recurrent state (batch 1; bf16 KV, fp32 state), or the measured milliseconds of one
forward pass over ``latency_len`` tokens on the trial's device (:mod:`nats.latency`)."""

MEASURED_COSTS = ("latency",)
"""Costs timed on the trial's device rather than computed from the cost model."""

OBJECTIVES = ("pareto", "quality", "cost")
"""``pareto``: quality and cost (multi-objective); ``quality`` or ``cost`` alone."""


def cost_metrics(config: NatsConfig, metrics: Mapping[str, float],
                 context: int) -> dict[str, float]:
    """``cost/*`` values of the model at ``context`` tokens with the measured fractions."""
    cost = architecture_cost(config, layer_fractions(config.layer_types, metrics), context)
    return {"cost/flops_per_token": float(cost.flops_per_token),
            "cost/softmax_flops_per_token": float(cost.softmax_flops_per_token),
            "cost/kv_cache_bytes": float(cost.kv_cache_bytes),
            "cost/cache_bytes": float(cost.cache_bytes)}


def objective_keys(objective: str, quality: str, cost: str) -> tuple[list[str], list[str]]:
    """Reported keys and modes that the searcher optimises."""
    if objective not in OBJECTIVES:
        raise ValueError(f"--objective {objective!r}: must be one of {OBJECTIVES}")
    if quality not in QUALITY:
        raise ValueError(f"--metric {quality!r}: must be one of {tuple(QUALITY)}")
    if cost not in COSTS:
        raise ValueError(f"--cost {cost!r}: must be one of {tuple(COSTS)}")
    chosen = {"pareto": [QUALITY[quality], COSTS[cost]], "quality": [QUALITY[quality]],
              "cost": [COSTS[cost]]}[objective]
    return [k for k, _ in chosen], [m for _, m in chosen]


def finite(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) \
        and math.isfinite(value)
