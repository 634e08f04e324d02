"""How training steers the routers: exploration before routes harden, and the budget.

Both are pure functions of the step and of what the step measured, so a resumed run steers
exactly as an uninterrupted one (the budget's biases are buffers saved with the weights).
"""

from __future__ import annotations

import math

import torch

from nats import NatsForCausalLM

from .config import TrainConfig


def exploration_noise(step: int, config: TrainConfig) -> float:
    """Gumbel noise scale on the routing logits at ``step``: 1 at the start, falling linearly
    to 0 at ``route_explore`` of the run. At 1 a chunk's route is a draw from the scorer's
    probabilities, so every chunk is tried on both sides while the scorer is still blind."""
    end = config.route_explore * config.steps
    return max(0.0, 1.0 - step / end) if end > 0 else 0.0


def set_exploration(model: NatsForCausalLM, noise: float) -> None:
    for layer in model.nats_layers:
        layer.route_noise = noise


def budget_active(step: int, config: TrainConfig) -> bool:
    """The budget, like the cost term, applies from ``reg_start`` of the run on."""
    return step >= config.reg_start * config.steps


def budget_target(step: int, config: TrainConfig) -> float | None:
    """The softmax fraction the budget holds at ``step``: 1 at the start of
    ``budget_anneal``, falling linearly to ``model.softmax_target`` at its end."""
    target = config.model.softmax_target
    end = config.budget_anneal * config.steps
    if target is None or step >= end:
        return target
    return 1.0 - (1.0 - target) * step / end


@torch.no_grad()
def update_budget(model: NatsForCausalLM, routable_frac: list[torch.Tensor | None],
                  target: float | None, config: TrainConfig) -> None:
    """One step of the budget's controller: move each routing bias against the error of
    the softmax fraction this step measured (the layer's own, or the mean over layers for
    ``budget_scope="model"``). An integral controller: the bias settles where the measured
    fraction equals ``target``, whatever the scorer's logits are."""
    cfg = model.config
    if target is None:
        return
    fracs = [float(f) for f in routable_frac if f is not None]
    if not fracs or any(math.isnan(f) for f in fracs):
        return  # sequences of a single chunk have nothing to route
    errors = fracs if cfg.budget_scope == "layer" else [sum(fracs) / len(fracs)] * len(fracs)
    for layer, error in zip(model.nats_layers, errors, strict=True):
        layer.budget.route_bias -= config.budget_rate * (error - target)


def route_bias_scalars(model: NatsForCausalLM) -> dict[str, float]:
    """``train/route_bias/layer{i}`` of every NAtS-L layer under a budget (TensorBoard)."""
    return {f"train/route_bias/layer{i}": float(block.mixer.budget.route_bias)
            for i, block in enumerate(model.blocks) if hasattr(block.mixer, "budget")}
