"""The training loop: AdamW steps, periodic evaluation, TensorBoard, checkpoints, export.

Ctrl-C does not kill a run: the first press finishes the current step, saves a
checkpoint and returns (``interrupted=True``); a second press stops at once.
"""

from __future__ import annotations

import contextlib
import json
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

import torch
from torch.utils.tensorboard import SummaryWriter
from tqdm import tqdm

from nats import NatsForCausalLM
from nats.analysis.routing_maps import routing_map_image
from nats.atomic_write import atomic_write_bytes

from .checkpoint import (
    latest_checkpoint,
    load_checkpoint,
    read_checkpoint_meta,
    save_checkpoint,
)
from .config import DEVICE_PATTERN, DEVICES, TrainConfig
from .data import Batches, build_batches
from .optim import build_optimizer, lr_at, set_lr
from .synthetic import Batch

EvalCallback = Callable[[int, dict[str, float]], None]
"""Called after every evaluation with the step and the metrics (e.g. to report to Tune)."""


@dataclass
class TrainResult:
    model: NatsForCausalLM
    step: int
    """Completed optimizer steps, counted from the start of the run (resumes included)."""
    train_losses: list[float]
    """Training loss of every step this call ran."""
    eval_metrics: dict[str, float]
    """Metrics of the last evaluation (empty if none ran)."""
    interrupted: bool
    checkpoint: Path | None
    """The newest checkpoint on disk when the call returned."""


def resolve_device(name: str) -> torch.device:
    """``auto`` means CUDA when there is one; asking for absent CUDA is an error."""
    if not DEVICE_PATTERN.match(name):
        raise ValueError(f"device {name!r} is invalid: must be {DEVICES}")
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} is invalid: CUDA is not available here")
    return torch.device(name)


class _StopRequest:
    """Set by the first SIGINT; the loop checks it between steps."""

    def __init__(self) -> None:
        self.requested = False

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.requested = True
        signal.signal(signal.SIGINT, signal.default_int_handler)  # a second press stops now
        tqdm.write("nats: stopping after this step (press Ctrl-C again to stop now)")

    @contextlib.contextmanager
    def installed(self) -> Iterator[_StopRequest]:
        """Catch SIGINT while training; signals can only be caught on the main thread."""
        if threading.current_thread() is not threading.main_thread():
            yield self
            return
        previous = signal.signal(signal.SIGINT, self._handle)
        try:
            yield self
        finally:
            signal.signal(signal.SIGINT, previous)


def _to(batch: Batch, device: torch.device) -> Batch:
    return batch[0].to(device), batch[1].to(device)


def _frac_scalars(prefix: str, attn_frac: list[torch.Tensor | None]) -> dict[str, float]:
    """``{prefix/attn_frac/layer{i}/head{h}: fraction}`` for every NAtS layer."""
    return {f"{prefix}/attn_frac/layer{i}/head{h}": float(v)
            for i, frac in enumerate(attn_frac) if frac is not None
            for h, v in enumerate(frac.detach().float().cpu())}


@torch.no_grad()
def evaluate(model: NatsForCausalLM, batches: list[Batch], device: torch.device,
             ) -> tuple[dict[str, float], list[torch.Tensor | None]]:
    """Mean eval metrics over ``batches``, and the routes the model took on the first one.

    Runs under a forked RNG so that evaluating never changes the training stream.
    """
    was_training = model.training
    model.eval()
    sums: dict[str, float] = {}
    first_routes: list[torch.Tensor | None] = []
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        for i, batch in enumerate(batches):
            input_ids, labels = _to(batch, device)
            out = model(input_ids, labels=labels)
            metrics = {"eval/loss": out.loss.item(), "eval/ce": out.ce_loss.item(),
                       "eval/reg": out.reg_loss.item(), **_frac_scalars("eval", out.attn_frac)}
            for k, v in metrics.items():
                sums[k] = sums.get(k, 0.0) + v
            if i == 0:
                first_routes = list(out.routes)
    model.train(was_training)
    return {k: v / len(batches) for k, v in sums.items()}, first_routes


def _log_eval(writer: SummaryWriter, step: int, metrics: dict[str, float],
              routes: list[torch.Tensor | None]) -> None:
    for tag, value in metrics.items():
        writer.add_scalar(tag, value, step)
    for i, r in enumerate(routes):
        if r is not None:
            writer.add_image(f"routing/layer{i}", routing_map_image(r), step, dataformats="HWC")
    fracs = " ".join(f"{v:.2f}" for k, v in metrics.items() if "/attn_frac/" in k)
    tqdm.write(f"step {step}: eval loss {metrics['eval/loss']:.4f}"
               f" ce {metrics['eval/ce']:.4f}" + (f" attn_frac [{fracs}]" if fracs else ""))


def _start_or_resume(config: TrainConfig, resume: bool, model: NatsForCausalLM,
                     optimizer: torch.optim.Optimizer) -> int:
    """The first step to run: 0 for a new run, the checkpoint's step when resuming."""
    path = latest_checkpoint(config.out_dir)
    if path is None:
        return 0
    if not resume:
        raise FileExistsError(f"{config.out_dir} already holds a run ({path.name}); resume it "
                              "(--resume) or choose another output folder (--out)")
    if read_checkpoint_meta(path)["config"].get("model") != config.model.to_dict():
        raise ValueError(f"cannot resume {path}: it was trained with another model config")
    restored = load_checkpoint(path, model, optimizer)
    tqdm.write(f"nats: resuming from {path} at step {restored.step}")
    return restored.step


def train(config: TrainConfig, *, resume: bool = False,
          on_eval: EvalCallback | None = None) -> TrainResult:
    """Train ``config.model`` on ``config.task``; write logs, checkpoints and the model.

    ``out_dir`` receives ``train_config.json``, TensorBoard events, ``checkpoints/`` and,
    at the end, the trained model in ``model/`` (``NatsForCausalLM.from_pretrained``).
    With ``resume``, training continues exactly where the newest checkpoint left off.
    """
    device = resolve_device(config.device)
    out_dir = Path(config.out_dir)
    batches: Batches = build_batches(config)
    eval_batches = batches.eval(config.eval_batches)

    torch.manual_seed(config.seed)
    model = NatsForCausalLM(config.model).to(device)
    optimizer = build_optimizer(model, config)
    step = _start_or_resume(config, resume, model, optimizer)
    config_json = json.dumps(config.to_dict(), indent=2)
    atomic_write_bytes(out_dir / "train_config.json", config_json.encode())
    writer = SummaryWriter(str(out_dir), purge_step=step if step else None)
    if step == 0:
        writer.add_text("config", f"```\n{config_json}\n```", 0)

    losses: list[float] = []
    eval_metrics: dict[str, float] = {}
    checkpoint = latest_checkpoint(out_dir)
    saved_step = step if checkpoint is not None else -1
    stop = _StopRequest()
    started = time.perf_counter()
    model.train()
    with stop.installed(), tqdm(total=config.steps, initial=step, disable=None,
                                dynamic_ncols=True) as bar:
        n_params = sum(p.numel() for p in model.parameters())
        tqdm.write(f"nats: training {n_params:,} parameters on '{config.task}' ({device}), "
                   f"steps {step} -> {config.steps}, writing to {out_dir}")
        while step < config.steps and not stop.requested:
            lr = lr_at(step, config)
            set_lr(optimizer, lr)
            input_ids, labels = _to(batches.train(step), device)
            out = model(input_ids, labels=labels)
            optimizer.zero_grad(set_to_none=True)
            out.loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
            optimizer.step()
            step += 1
            losses.append(out.loss.item())
            bar.update(1)
            bar.set_postfix(loss=f"{losses[-1]:.4f}", lr=f"{lr:.2e}")

            if step % config.log_interval == 0:
                scalars = {"train/loss": losses[-1], "train/ce": out.ce_loss.item(),
                           "train/reg": out.reg_loss.item(), "train/lr": lr,
                           "train/grad_norm": float(grad_norm),
                           **_frac_scalars("train", out.attn_frac)}
                for tag, value in scalars.items():
                    writer.add_scalar(tag, value, step)
            if step % config.eval_interval == 0 or step == config.steps:
                eval_metrics, routes = evaluate(model, eval_batches, device)
                _log_eval(writer, step, eval_metrics, routes)
                if on_eval is not None:
                    on_eval(step, eval_metrics)
            if step % config.checkpoint_interval == 0:
                checkpoint = save_checkpoint(out_dir, step, model, optimizer, config.to_dict(),
                                             config.keep_checkpoints)
                saved_step = step

    if saved_step != step:
        checkpoint = save_checkpoint(out_dir, step, model, optimizer, config.to_dict(),
                                     config.keep_checkpoints)
    interrupted = step < config.steps
    if interrupted:
        tqdm.write(f"nats: interrupted at step {step}; checkpoint saved to {checkpoint}")
    else:
        model.save_pretrained(out_dir / "model")
        tqdm.write(f"nats: done, {step} steps in {time.perf_counter() - started:.1f} s; "
                   f"model saved to {out_dir / 'model'}")
    writer.close()
    return TrainResult(model, step, losses, eval_metrics, interrupted, checkpoint)
