"""Training checkpoints: one safetensors file per checkpoint, written atomically.

A checkpoint holds the model's weights, the optimizer's tensors (flattened into
safetensors keys) and the RNG states; everything that is not a tensor (the step, the
optimizer's scalars and param groups, the training config) is JSON in the file's
metadata. Nothing is ever unpickled. A file is written to a temporary name in the same
folder and renamed into place, so a crash leaves either the old or the new file.
"""

from __future__ import annotations

import hashlib
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save

from nats.atomic_write import atomic_write_bytes

FORMAT = "nats-checkpoint-1"


class CorruptCheckpoint(ValueError):
    """A checkpoint file that cannot be read, or whose tensors fail their digest."""


def tensor_digest(tensors: dict[str, torch.Tensor]) -> str:
    """SHA-256 over every tensor's name, dtype, shape and bytes, in name order: written
    with a checkpoint and checked on load, so flipped bytes inside tensor data (which
    safetensors loads without complaint) are caught instead of surfacing as a NaN loss."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().cpu().contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()
_NAME = re.compile(r"^step_(\d+)\.safetensors$")


def checkpoint_dir(out_dir: str | Path) -> Path:
    return Path(out_dir) / "checkpoints"


def list_checkpoints(out_dir: str | Path) -> list[tuple[int, Path]]:
    """``(step, path)`` of every complete checkpoint of a run, oldest first."""
    folder = checkpoint_dir(out_dir)
    if not folder.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in folder.iterdir() if (m := _NAME.match(p.name))]
    return sorted(found)


def latest_checkpoint(out_dir: str | Path) -> Path | None:
    found = list_checkpoints(out_dir)
    return found[-1][1] if found else None


def _cpu_copy(t: torch.Tensor) -> torch.Tensor:
    """A private contiguous CPU copy: safetensors refuses tensors that share storage."""
    return t.detach().to("cpu", copy=True).contiguous()


def save_checkpoint(out_dir: str | Path, step: int, model: torch.nn.Module,
                    optimizer: torch.optim.Optimizer, config: dict[str, Any],
                    keep: int) -> Path:
    """Save the state after ``step`` completed steps; keep only the ``keep`` newest. No
    data position is stored: the batch of a step depends only on the step."""
    tensors = {f"model/{k}": _cpu_copy(v) for k, v in model.state_dict().items()}
    opt = optimizer.state_dict()
    scalars: dict[str, dict[str, Any]] = {}
    for idx, state in opt["state"].items():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                tensors[f"optimizer/{idx}/{key}"] = _cpu_copy(value)
            else:
                scalars.setdefault(str(idx), {})[key] = value
    tensors["rng/cpu"] = torch.get_rng_state()
    if torch.cuda.is_available():
        for i, state in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"rng/cuda/{i}"] = state
    meta = {"format": FORMAT, "step": step, "config": config,
            "optimizer": {"param_groups": opt["param_groups"], "scalars": scalars},
            "digest": tensor_digest(tensors)}
    path = checkpoint_dir(out_dir) / f"step_{step:08d}.safetensors"
    atomic_write_bytes(path, save(tensors, metadata={"nats": json.dumps(meta)}))
    for _, old in list_checkpoints(out_dir)[:-keep]:
        old.unlink()
    return path


def read_checkpoint_meta(path: str | Path) -> dict[str, Any]:
    """The JSON part of a checkpoint: ``step``, ``config`` and optimizer scalars."""
    try:
        with safe_open(str(path), framework="pt") as f:
            raw = (f.metadata() or {}).get("nats")
        meta = json.loads(raw) if raw else {}
    except Exception as e:  # safetensors raises its own error types for a damaged file
        raise CorruptCheckpoint(f"{path} cannot be read ({type(e).__name__}: {e})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise ValueError(f"{path} is not a nats checkpoint ({FORMAT})")
    step, config, optimizer = meta.get("step"), meta.get("config"), meta.get("optimizer")
    if (not isinstance(step, int) or isinstance(step, bool) or step < 0
            or not isinstance(config, dict) or not isinstance(optimizer, dict)
            or not isinstance(optimizer.get("scalars"), dict)
            or not isinstance(optimizer.get("param_groups"), list)):
        raise CorruptCheckpoint(f"{path} has damaged metadata (its step, config or optimizer "
                                "state is missing or of the wrong type)")
    return meta


def newest_readable(out_dir: str | Path, warn: Any = None) -> tuple[Path, dict[str, Any]] | None:
    """The newest checkpoint of a run whose metadata reads, with that metadata; each
    newer one that does not read is reported through ``warn(message)``."""
    for _, path in reversed(list_checkpoints(out_dir)):
        try:
            return path, read_checkpoint_meta(path)
        except ValueError as e:
            if warn is not None:
                warn(f"nats: skipping checkpoint {path.name}: {e}")
    return None


def _from_legacy_groups(state: dict[int, dict[str, Any]], groups: list[dict[str, Any]],
                        now: list[dict[str, Any]], model: torch.nn.Module, path: str | Path,
                        ) -> tuple[dict[int, dict[str, Any]], list[dict[str, Any]]]:
    """The optimizer state of a checkpoint written before the scorers had a group of their
    own (two groups: matrices, then vectors), renumbered for today's groups."""
    if len(groups) != 2 or len(now) != 3:
        raise ValueError(f"cannot resume {path}: its optimizer has {len(groups)} parameter "
                         f"groups, this run's {len(now)}")
    params = [p for p in model.parameters() if p.requires_grad]
    legacy = [p for p in params if p.dim() >= 2] + [p for p in params if p.dim() < 2]
    scorers = {id(p) for name, p in model.named_parameters() if ".scorer." in name}
    current = ([p for p in params if p.dim() >= 2 and id(p) not in scorers]
               + [p for p in params if p.dim() < 2 and id(p) not in scorers]
               + [p for p in params if id(p) in scorers])
    index = {id(p): i for i, p in enumerate(current)}
    state = {index[id(legacy[i])]: values for i, values in state.items()}
    return state, [{**saved, "params": fresh["params"]} for saved, fresh in
                   zip([groups[0], groups[1], groups[0]], now, strict=True)]


def read_checkpoint_tensors(path: str | Path, meta: dict[str, Any],
                            device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint whose ``meta`` was read, checked against its digest."""
    try:
        tensors = load_file(str(path), device=str(device))
    except Exception as e:  # safetensors raises its own error types for a damaged file
        raise CorruptCheckpoint(f"{path} cannot be read ({type(e).__name__}: {e})") from None
    if "digest" in meta and tensor_digest(tensors) != meta["digest"]:
        raise CorruptCheckpoint(f"{path} fails its digest: its tensor data changed after it "
                                "was written")
    return tensors


@dataclass(frozen=True)
class Restored:
    step: int
    config: dict[str, Any]


def load_checkpoint(path: str | Path, model: torch.nn.Module,
                    optimizer: torch.optim.Optimizer) -> Restored:
    """Restore model, optimizer and RNG states in place; return the step and config."""
    meta = read_checkpoint_meta(path)
    tensors = read_checkpoint_tensors(path, meta)
    try:
        return _restore(meta, tensors, model, optimizer, path)
    except (KeyError, TypeError, IndexError, RuntimeError) as e:  # well-formed, wrong inside
        reason = " ".join(str(e).split())  # one line: load_state_dict lists every key
        raise CorruptCheckpoint(f"{path} does not hold this run's state "
                                f"({type(e).__name__}: {reason})") from None


def _restore(meta: dict[str, Any], tensors: dict[str, torch.Tensor], model: torch.nn.Module,
             optimizer: torch.optim.Optimizer, path: str | Path) -> Restored:
    model.load_state_dict({k.removeprefix("model/"): v for k, v in tensors.items()
                           if k.startswith("model/")})
    state: dict[int, dict[str, Any]] = {
        int(idx): dict(values) for idx, values in meta["optimizer"]["scalars"].items()}
    for key, value in tensors.items():
        if key.startswith("optimizer/"):
            _, idx, name = key.split("/", 2)
            state.setdefault(int(idx), {})[name] = value
    groups = meta["optimizer"]["param_groups"]
    now = optimizer.state_dict()["param_groups"]
    if [len(g["params"]) for g in groups] != [len(g["params"]) for g in now]:
        state, groups = _from_legacy_groups(state, groups, now, model, path)
    optimizer.load_state_dict({"state": state, "param_groups": groups})
    for group, fresh in zip(optimizer.param_groups, now, strict=True):
        # What the run's config sets (weight decay, the scorers' rate) is the config's now,
        # not the checkpoint's: a resume may change them.
        for key in ("weight_decay", "lr_scale"):
            if key in fresh:
                group[key] = fresh[key]
    restore_rng(tensors)
    return Restored(step=meta["step"], config=meta["config"])


def restore_rng(tensors: dict[str, torch.Tensor]) -> None:
    """The CPU generator and one per GPU this process sees, of those the checkpoint holds:
    a run saved where more (or fewer) GPUs were visible resumes with a warning that the
    others' random streams are not continued, instead of being refused as damaged."""
    torch.set_rng_state(tensors["rng/cpu"])
    saved = [tensors[f"rng/cuda/{i}"] for i in range(sum(k.startswith("rng/cuda/")
                                                         for k in tensors))]
    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for i, state in enumerate(saved[:visible]):
        torch.cuda.set_rng_state(state, i)
    if saved and len(saved) != visible:
        print(f"nats: warning: the checkpoint holds the random state of {len(saved)} GPU(s) "
              f"and this process sees {visible}: {min(len(saved), visible)} restored, "
              "so the run does not repeat exactly", file=sys.stderr)
