"""AdamW and its learning-rate schedule (linear warmup, then cosine decay).

The rate is a pure function of the step, set on the optimizer before every step, so
there is no scheduler state to save: a resumed run gets the same rate by construction.
"""

from __future__ import annotations

import math

import torch

from .config import TrainConfig


def build_optimizer(model: torch.nn.Module, config: TrainConfig) -> torch.optim.AdamW:
    """AdamW that decays matrices only; norms' gains and biases are not pulled to zero.

    The chunk scorers are a group of their own, at ``router_lr_scale`` times the rate and
    without weight decay: decay would pull every chunk back toward undecided, and their
    gradients (straight-through, through ``p (1 - p)``) are small beside the weights'.
    """
    scorers = {id(p) for name, p in model.named_parameters() if ".scorer." in name}
    params = [p for p in model.parameters() if p.requires_grad and id(p) not in scorers]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": config.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    if scorers:
        groups.append({"params": [p for p in model.parameters() if id(p) in scorers],
                       "weight_decay": 0.0, "lr_scale": config.router_lr_scale})
    return torch.optim.AdamW(groups, lr=config.lr, betas=(0.9, 0.95))


def lr_at(step: int, config: TrainConfig) -> float:
    """Rate for 0-based ``step``: warmup to ``lr``, cosine down to ``lr * min_lr_ratio``."""
    if step < config.warmup_steps:
        return config.lr * (step + 1) / config.warmup_steps
    progress = (step - config.warmup_steps) / max(1, config.steps - config.warmup_steps)
    cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return config.lr * (config.min_lr_ratio + (1 - config.min_lr_ratio) * cosine)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_scale", 1.0)
