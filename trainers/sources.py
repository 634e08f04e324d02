"""What a command is given: a run folder, a checkpoint file, or a saved or exported model
folder. One loader for all of them, so that every command takes the same sources and
knows the same about how a model was trained.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file

from nats.model import CONFIG_FILE, WEIGHTS_FILE, NatsForCausalLM

from .checkpoint import latest_checkpoint, read_checkpoint_meta
from .config import TRAIN_CONFIG_FILE, TrainConfig

TRAINING_FILE = "training.json"
"""An export's run config: the task and data its model was trained on."""


@dataclass(frozen=True)
class LoadedModel:
    """A model in eval mode and what is known of its training."""

    model: NatsForCausalLM
    train_config: TrainConfig | None
    """The run that trained it; ``None`` for a saved folder outside a run and not exported
    from one (its task and length are unknown)."""
    origin: str
    """One line for reports, e.g. ``run runs/tiny (model/, step 300)``."""


def load_model(source: str | os.PathLike, device: str | torch.device = "cpu") -> LoadedModel:
    """The model of ``source``: a run folder (its ``model/``, else its newest checkpoint),
    a checkpoint file, or a model folder (``config.json`` and ``model.safetensors``: a run's
    ``model/``, whose run is one level up, or an export, whose run is its
    ``training.json``). Bad input raises ``ValueError`` or ``OSError`` in one line."""
    path = Path(source)
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist: give a run folder, a checkpoint file "
                                "(run/checkpoints/step_*.safetensors), or a saved or exported "
                                "model folder")
    if path.is_file():
        return _load_checkpoint(path, device, origin=f"checkpoint {path}")
    if (path / TRAIN_CONFIG_FILE).is_file():
        return _load_run(path, device)
    if (path / CONFIG_FILE).is_file() and (path / WEIGHTS_FILE).is_file():
        return _load_model_folder(path, device)
    raise ValueError(f"{path} is neither a run folder ({TRAIN_CONFIG_FILE}) nor a model folder "
                     f"({CONFIG_FILE} and {WEIGHTS_FILE})")


def read_train_config(path: Path) -> TrainConfig:
    """A ``TrainConfig`` JSON file; a damaged one is a one-line ``ValueError``."""
    try:
        return TrainConfig.from_dict(json.loads(path.read_text()))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON ({e})") from None


def _load_run(path: Path, device: str | torch.device) -> LoadedModel:
    train_config = read_train_config(path / TRAIN_CONFIG_FILE)
    model_dir = path / "model"
    newest = latest_checkpoint(path)
    if (model_dir / CONFIG_FILE).is_file():
        model = NatsForCausalLM.from_pretrained(model_dir, device=device)
        if model.config != train_config.model:
            raise ValueError(f"{model_dir} holds another model than {path / TRAIN_CONFIG_FILE} "
                             "describes")
        step = _step_if_same_weights(newest, model) if newest else None
        when = f"step {step}" if step is not None else "final model"
        return LoadedModel(model.eval(), train_config, f"run {path} (model/, {when})")
    if newest is None:
        raise ValueError(f"{path} holds no trained model: neither model/ nor a checkpoint")
    return _load_checkpoint(newest, device, origin=f"run {path} (newest checkpoint)")


def _load_model_folder(path: Path, device: str | torch.device) -> LoadedModel:
    model = NatsForCausalLM.from_pretrained(path, device=device).eval()
    candidates = [(path / TRAINING_FILE, f"exported model {path}")]
    if path.name == "model":
        candidates.append((path.parent / TRAIN_CONFIG_FILE,
                           f"model folder {path} of run {path.parent}"))
    for run_config, origin in candidates:
        if run_config.is_file():
            config = read_train_config(run_config)
            if config.model == model.config:
                return LoadedModel(model, config, origin)
    return LoadedModel(model, None, f"model folder {path}")


def _load_checkpoint(path: Path, device: str | torch.device, origin: str) -> LoadedModel:
    try:
        meta = read_checkpoint_meta(path)
    except SafetensorError as e:
        raise ValueError(f"{path} is not a nats checkpoint: {e}") from None
    train_config = TrainConfig.from_dict(meta["config"])
    tensors = load_file(str(path), device=str(device))
    state = {k.removeprefix("model/"): v for k, v in tensors.items() if k.startswith("model/")}
    with torch.device(device):
        model = NatsForCausalLM(train_config.model)
    model = model.to(state["embed.weight"].dtype)
    model.load_state_dict(state)
    return LoadedModel(model.eval(), train_config, f"{origin}, step {meta['step']}")


def _step_if_same_weights(checkpoint: Path, model: NatsForCausalLM) -> int | None:
    """The checkpoint's step if it holds exactly ``model``'s weights (the run's last save)."""
    with safe_open(str(checkpoint), framework="pt") as f:
        keys = set(f.keys())
        for name, tensor in model.state_dict().items():
            key = f"model/{name}"
            if key not in keys or not torch.equal(f.get_tensor(key), tensor.cpu()):
                return None
    return int(read_checkpoint_meta(checkpoint)["step"])
