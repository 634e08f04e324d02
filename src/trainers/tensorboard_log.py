"""What a run shows in TensorBoard: scalars, routing maps, scorer histograms, hparams.

Tags: ``train/*`` and ``eval/*`` scalars (losses, learning rate, softmax fractions per
layer and routing head), ``routing/layer{i}`` images of the evaluation batch's routes
(rows: sequence x routing head), ``routing/all_layers`` the labelled figure of the first
evaluation sequence through every layer (the picture ``nats analyze`` draws),
``routing/softmax_prob/layer{i}`` histograms of the scorer's probabilities, the config as
text, and the config with the final metrics in the HParams tab (sub-run ``hparams``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from torch.utils.tensorboard import SummaryWriter

from nats.config import NatsConfig
from nats.trainers.routing_maps import routing_figure, routing_map_image

from .evaluation import Evaluation

MAP_SEQUENCES = 4
"""Sequences of the evaluation batch drawn in a routing map (rows: sequence x head)."""


def flat_hparams(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"model.d_model": 64, "task": "copy", ...}``: the scalar form HParams accepts."""
    out: dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flat_hparams(value, f"{name}."))
        elif isinstance(value, (list, tuple)):
            out[name] = ",".join(map(str, value))
        elif value is None:
            out[name] = "none"
        else:
            out[name] = value
    return out


class RunLog:
    """The TensorBoard events of a run; on a non-main rank every call does nothing."""

    def __init__(self, out_dir: Path, resume_step: int, enabled: bool) -> None:
        self.out_dir = out_dir
        # purge_step drops events a crashed run wrote after its last checkpoint; those of
        # the checkpoint's own step were written before it and are not repeated. A run that
        # starts over (resumed before its first checkpoint) drops all the earlier events.
        self.writer = (SummaryWriter(str(out_dir), purge_step=resume_step + 1 if resume_step
                                     else 0) if enabled else None)

    def config(self, config_json: str) -> None:
        if self.writer:
            self.writer.add_text("config", f"```\n{config_json}\n```", 0)

    def scalars(self, values: dict[str, float], step: int) -> None:
        if self.writer:
            for tag, value in values.items():
                self.writer.add_scalar(tag, value, step)

    def evaluation(self, result: Evaluation, step: int, model: NatsConfig, seq_len: int,
                   ) -> None:
        if not self.writer:
            return
        self.scalars(result.metrics, step)
        if any(r is not None for r in result.routes):
            figure = routing_figure(result.routes, model.layer_types, model.chunk_size, seq_len,
                                    title=f"routes of evaluation sequence 0 at step {step}")
            self.writer.add_image("routing/all_layers", np.asarray(figure), step,
                                  dataformats="HWC")
        for i, routes in enumerate(result.routes):
            if routes is not None:
                self.writer.add_image(f"routing/layer{i}",
                                      routing_map_image(routes[:MAP_SEQUENCES]), step,
                                      dataformats="HWC")
        for i, probs in enumerate(result.softmax_probs):
            if probs is not None:
                self.writer.add_histogram(f"routing/softmax_prob/layer{i}", probs, step,
                                          bins="auto")

    def hparams(self, config: dict[str, Any], metrics: dict[str, float]) -> None:
        """The run's config beside its final metrics, for comparing runs side by side."""
        if self.writer and metrics:
            self.writer.add_hparams(flat_hparams(config), metrics, run_name="hparams")

    def close(self) -> None:
        if self.writer:
            self.writer.close()
