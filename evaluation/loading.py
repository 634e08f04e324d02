"""What ``nats eval`` reads: a run folder, a checkpoint file, or a saved/exported model folder.

A run or checkpoint carries its training config (the task and length it was trained on), as
does an export (``training.json``); a saved folder (``config.json`` + ``model.safetensors``)
carries only the model, unless it is a run's ``model/`` folder, whose run config sits one
level up.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from nats import NatsForCausalLM
from nats.export import TRAIN_CONFIG_FILE, TRAINING_FILE, load_source
from nats.model import CONFIG_FILE, WEIGHTS_FILE
from nats.trainers import TrainConfig


@dataclass(frozen=True)
class LoadedModel:
    """A model in eval mode and what is known of its training."""

    model: NatsForCausalLM
    train_config: TrainConfig | None
    """``None`` for a saved folder outside a run: the training task and length are unknown."""
    origin: str


def load_for_eval(path: str | os.PathLike, device: torch.device) -> LoadedModel:
    """Load ``path`` onto ``device``; a bad path is a one-line ``ValueError``/``OSError``."""
    path = Path(path)
    if path.is_dir() and (path / CONFIG_FILE).is_file() and (path / WEIGHTS_FILE).is_file() \
            and not (path / TRAIN_CONFIG_FILE).is_file():
        model = NatsForCausalLM.from_pretrained(path, device=device).eval()
        candidates = [(path / TRAINING_FILE, f"exported model {path}")]
        if path.name == "model":
            candidates.append((path.parent / TRAIN_CONFIG_FILE,
                               f"model folder {path} of run {path.parent}"))
        for run_config, origin in candidates:
            if run_config.is_file():
                config = _read_train_config(run_config)
                if config.model == model.config:
                    return LoadedModel(model, config, origin)
        return LoadedModel(model, None, f"model folder {path}")
    if path.is_dir() and not (path / TRAIN_CONFIG_FILE).is_file():
        raise ValueError(f"{path} is neither a run folder ({TRAIN_CONFIG_FILE}) nor a saved "
                         f"model folder ({CONFIG_FILE} and {WEIGHTS_FILE})")
    loaded = load_source(path, device)
    return LoadedModel(loaded.model.eval(), loaded.train_config, loaded.origin)


def _read_train_config(path: Path) -> TrainConfig:
    try:
        return TrainConfig.from_dict(json.loads(path.read_text()))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON ({e})") from None
