"""Evaluation of a model on a run's fixed batches: loss, perplexity, accuracy, routing.

Sums are taken over labelled tokens of all batches before dividing, so a metric does not
depend on how the evaluation set is cut into batches.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field

import torch

from nats import NatsForCausalLM
from nats.kernels import SOFTMAX
from nats.model import IGNORE_INDEX, next_token_cross_entropy

from .synthetic import Batch


@dataclass
class Evaluation:
    """Metrics keyed by TensorBoard tag, and the routing decisions behind them."""

    metrics: dict[str, float]
    routes: list[torch.Tensor | None] = field(default_factory=list)
    """Per layer, the routes ``[B, N, H, 2]`` of the first batch (``None``: not NAtS-L)."""
    softmax_probs: list[torch.Tensor | None] = field(default_factory=list)
    """Per layer, the scorer's softmax probability of every chunk of every batch, flat."""


def frac_scalars(prefix: str, attn_frac: list[torch.Tensor | None]) -> dict[str, float]:
    """Softmax fraction per NAtS-L layer and routing head, per layer, and over all layers.

    Tags: ``{prefix}/attn_frac`` (mean over layers), ``{prefix}/attn_frac/layer{i}`` and
    ``{prefix}/attn_frac/layer{i}/head{h}``; empty when the model has no NAtS-L layer.
    """
    out: dict[str, float] = {}
    layer_means = []
    for i, frac in enumerate(attn_frac):
        if frac is None:
            continue
        values = frac.detach().float().cpu()
        for h, v in enumerate(values):
            out[f"{prefix}/attn_frac/layer{i}/head{h}"] = float(v)
        layer_means.append(float(values.mean()))
        out[f"{prefix}/attn_frac/layer{i}"] = layer_means[-1]
    if layer_means:
        out[f"{prefix}/attn_frac"] = sum(layer_means) / len(layer_means)
    return out


def labelled_token_count(labels: torch.Tensor) -> int:
    """Positions whose next-token label carries loss (the shift drops the first label)."""
    return int((labels[:, 1:] != IGNORE_INDEX).sum())


@torch.no_grad()
def evaluate(model: NatsForCausalLM, batches: list[Batch], device: torch.device,
             autocast: contextlib.AbstractContextManager | None = None,
             bytes_per_token: float | None = None) -> Evaluation:
    """Evaluate ``model`` on ``batches`` in eval mode.

    ``eval/acc`` is the share of labelled tokens predicted exactly (greedy) and
    ``eval/seq_acc`` the share of sequences whose labelled tokens are all right, e.g. MQAR
    queries or a needle's digits. ``eval/bpb`` (bits per byte) needs ``bytes_per_token``.
    """
    was_training = model.training
    model.eval()
    ce_sum = reg_sum = 0.0
    tokens = correct = sequences = solved = 0
    frac_sums: dict[str, float] = {}
    routes: list[torch.Tensor | None] = []
    probs: list[list[torch.Tensor]] = []
    for i, (input_ids, labels) in enumerate(batches):
        input_ids, labels = input_ids.to(device), labels.to(device)
        with autocast or contextlib.nullcontext():
            out = model(input_ids)
        ce_sum += float(next_token_cross_entropy(out.logits, labels, reduction="sum"))
        reg_sum += float(out.reg_loss)
        target = labels[:, 1:]
        mask = target != IGNORE_INDEX
        hit = (out.logits[:, :-1].argmax(-1) == target) & mask
        tokens += int(mask.sum())
        correct += int(hit.sum())
        has_labels = mask.any(1)
        sequences += int(has_labels.sum())
        solved += int((has_labels & (hit == mask).all(1)).sum())
        for k, v in frac_scalars("eval", out.attn_frac).items():
            frac_sums[k] = frac_sums.get(k, 0.0) + v
        if i == 0:
            routes = [r.detach() if r is not None else None for r in out.routes]
            probs = [[] for _ in out.probs]
        for layer, p in zip(probs, out.probs, strict=True):
            if p is not None:
                layer.append(p[..., SOFTMAX].detach().float().flatten().cpu())
    model.train(was_training)

    n = len(batches)
    ce = ce_sum / max(tokens, 1)
    metrics = {"eval/loss": ce + reg_sum / n, "eval/ce": ce, "eval/reg": reg_sum / n,
               "eval/ppl": math.exp(min(ce, 80.0)), "eval/acc": correct / max(tokens, 1),
               "eval/seq_acc": solved / max(sequences, 1),
               **{k: v / n for k, v in frac_sums.items()}}
    if bytes_per_token is not None:
        metrics["eval/bpb"] = ce / math.log(2) / bytes_per_token
    return Evaluation(metrics, routes, [torch.cat(p) if p else None for p in probs])
