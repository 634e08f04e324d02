"""What a command is given: a run folder, a checkpoint file, or a saved or exported model
folder. One loader for all of them, so that every command takes the same sources and
knows the same about how a model was trained.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from nats.model import CONFIG_FILE, WEIGHTS_FILE, NatsForCausalLM, read_json_object

from .checkpoint import (
    CorruptCheckpoint,
    latest_checkpoint,
    list_checkpoints,
    read_checkpoint_meta,
    read_checkpoint_tensors,
)
from .config import TRAIN_CONFIG_FILE, TrainConfig
from .tokenization import BYTE_VOCAB_LIMIT, Tokenizer, load_tokenizer

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


def text_tokenizer(loaded: LoadedModel, tokenizer: str | None, source: str | os.PathLike,
                   ) -> Tokenizer:
    """The tokenizer that text for ``loaded`` goes through: ``tokenizer`` where given, else
    the text run's own (bytes or its ``tokenizer.json``), else bytes for a byte-level
    model; a larger vocabulary without its text run needs ``tokenizer`` (bytes fed to it
    would be read as other tokens)."""
    if tokenizer is not None:
        return load_tokenizer(tokenizer)
    run = loaded.train_config
    if run is not None and run.task == "text":
        return load_tokenizer(run.tokenizer)
    vocab = loaded.model.config.vocab_size
    if vocab >= BYTE_VOCAB_LIMIT:
        raise ValueError(f"{source} is a model with a {vocab}-token vocabulary, not of UTF-8 "
                         "bytes, without its text run: give --tokenizer (the tokenizer.json "
                         "it was trained with), or its run folder")
    return load_tokenizer(None)


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
    return TrainConfig.from_dict(read_json_object(path))


def _load_run(path: Path, device: str | torch.device) -> LoadedModel:
    """The run's ``model/`` where it is current, else its newest checkpoint.

    ``model/`` is saved with the run's last checkpoint. A newest checkpoint that holds
    other weights and was written after ``model/`` is the newer model (the run resumed and
    went on); a ``model/`` written after it (changed by hand) is kept. A ``model/`` cut
    short (killed between its two files) or damaged gives way to the newest checkpoint."""
    train_config = read_train_config(path / TRAIN_CONFIG_FILE)
    model_dir = path / "model"
    newest = latest_checkpoint(path)
    if model_dir.is_dir() and newest is not None and not _whole_files(model_dir):
        print(f"nats: warning: {model_dir} is incomplete or its weights cannot be read; "
              f"using the newest checkpoint, {newest.name}", file=sys.stderr)
        return _load_newest_whole(path, device, "model/ incomplete or unreadable")
    if (model_dir / CONFIG_FILE).is_file():
        model = NatsForCausalLM.from_pretrained(model_dir, device=device)
        if model.config != train_config.model:
            raise ValueError(f"{model_dir} holds another model than {path / TRAIN_CONFIG_FILE} "
                             "describes")
        same = _holds_weights(newest, model) if newest is not None else None
        when = "final model"
        if same is False and (newest.stat().st_mtime
                              > (model_dir / WEIGHTS_FILE).stat().st_mtime):
            try:
                return _load_checkpoint(
                    newest, device, origin=f"run {path} (newest checkpoint, newer than model/)")
            except CorruptCheckpoint as e:  # the newer model is lost; model/ is whole
                when = f"final model; the newer {newest.name} is damaged: {e}"
        elif same:
            when = f"step {read_checkpoint_meta(newest)['step']}"
        return LoadedModel(model.eval(), train_config, f"run {path} (model/, {when})")
    if newest is None:
        raise ValueError(f"{path} holds no trained model: neither model/ nor a checkpoint")
    return _load_newest_whole(path, device)


def _load_newest_whole(run: Path, device: str | torch.device, why: str = "") -> LoadedModel:
    """The model of the run's newest checkpoint that loads whole; each newer damaged one
    is skipped with a warning, as resuming skips it (a run killed mid-save, a bad copy).
    None whole: the newest one's error."""
    skipped: list[tuple[Path, ValueError]] = []
    for _, checkpoint in reversed(list_checkpoints(run)):
        which = "newest whole checkpoint" if skipped else "newest checkpoint"
        try:
            loaded = _load_checkpoint(checkpoint, device,
                                      origin=f"run {run} ({which}{'; ' + why if why else ''})")
        except ValueError as e:
            skipped.append((checkpoint, e))
            continue
        for path, error in skipped:
            print(f"nats: warning: skipping checkpoint {path.name}: {error}", file=sys.stderr)
        return loaded
    if not skipped:
        raise ValueError(f"{run} holds no checkpoint")
    raise skipped[0][1]


def _whole_files(model_dir: Path) -> bool:
    """Whether ``model_dir`` holds both files of a saved model, each readable (a run killed
    between the two writes, or a damaged copy, does not); whether the config describes a
    valid model is the loader's to say."""
    if not ((model_dir / CONFIG_FILE).is_file() and (model_dir / WEIGHTS_FILE).is_file()):
        return False
    try:
        read_json_object(model_dir / CONFIG_FILE)
        with safe_open(str(model_dir / WEIGHTS_FILE), framework="pt") as f:
            f.keys()
    except Exception:  # safetensors raises its own error types for a damaged file
        return False
    return True


def _load_model_folder(path: Path, device: str | torch.device) -> LoadedModel:
    model = NatsForCausalLM.from_pretrained(path, device=device).eval()
    candidates = [(path / TRAINING_FILE, f"exported model {path}")]
    if path.name == "model":
        candidates.append((path.parent / TRAIN_CONFIG_FILE,
                           f"model folder {path} of run {path.parent}"))
    for run_config, origin in candidates:
        if run_config.is_file():
            try:
                config = read_train_config(run_config)
            except ValueError as e:  # the model is whole; only what trained it is unknown
                print(f"nats: warning: {e}; the model is read without its training run",
                      file=sys.stderr)
                continue
            if config.model == model.config:
                return LoadedModel(model, config, origin)
    return LoadedModel(model, None, f"model folder {path}")


def _load_checkpoint(path: Path, device: str | torch.device, origin: str) -> LoadedModel:
    """A checkpoint's model; a damaged file (unreadable, failing its digest, or holding
    tensors its config does not describe) is a one-line ``ValueError``."""
    meta = read_checkpoint_meta(path)
    train_config = TrainConfig.from_dict(meta["config"])
    tensors = read_checkpoint_tensors(path, meta, device)
    state = {k.removeprefix("model/"): v for k, v in tensors.items() if k.startswith("model/")}
    with torch.device(device):
        model = NatsForCausalLM(train_config.model)
    try:
        model = model.to(state["embed.weight"].dtype)
        model.load_state_dict(state)
    except (KeyError, RuntimeError) as e:
        reason = " ".join(str(e).split())  # one line: load_state_dict lists every key
        raise ValueError(f"{path} does not hold the model its config describes ({reason[:300]})"
                         ) from None
    return LoadedModel(model.eval(), train_config, f"{origin}, step {meta['step']}")


def _holds_weights(checkpoint: Path, model: NatsForCausalLM) -> bool | None:
    """Whether the checkpoint holds exactly ``model``'s weights (the run's last save);
    ``None`` if it cannot be read (a damaged newest checkpoint says nothing of ``model/``)."""
    try:
        read_checkpoint_meta(checkpoint)
        with safe_open(str(checkpoint), framework="pt") as f:
            keys = set(f.keys())
            return all(f"model/{name}" in keys
                       and torch.equal(f.get_tensor(f"model/{name}"), tensor.cpu())
                       for name, tensor in model.state_dict().items())
    except Exception:  # safetensors raises its own error types for a damaged file
        return None
