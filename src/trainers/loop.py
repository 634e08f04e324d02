"""The training loop: AdamW steps with accumulation, evaluation, TensorBoard, checkpoints.

Ctrl-C (or SIGTERM) does not kill a run: the first signal finishes the current step,
saves a checkpoint and returns (``interrupted=True``); a second stops at once. Under
``torchrun`` the loop is data parallel (see :mod:`.distributed`).
"""

from __future__ import annotations

import contextlib
import json
import math
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

import torch
from torch.nn.parallel import DistributedDataParallel
from tqdm import tqdm

from nats import NatsConfig, NatsForCausalLM
from nats.atomic_write import atomic_write_bytes
from nats.folder_lock import FolderBusy, exclusive

from .checkpoint import (
    CorruptCheckpoint,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    read_checkpoint_meta,
    save_checkpoint,
)
from .config import TRAIN_CONFIG_FILE, TrainConfig
from .data import build_batches
from .distributed import World, joined_world
from .evaluation import evaluate, frac_scalars, route_frac_scalars
from .optim import build_optimizer, lr_at, set_lr
from .route_control import (
    budget_active,
    budget_target,
    exploration_noise,
    route_bias_scalars,
    set_exploration,
    update_budget,
)
from .step import EagerGradients, GraphedGradients, StepStats, check_graphable, records_graph
from .tensorboard_log import RunLog

EvalCallback = Callable[[int, dict[str, float], NatsForCausalLM], None]
"""Called after every evaluation with the step, the metrics and the model (e.g. to report
to Tune, or to time the model as it is routed now)."""


@dataclass
class TrainResult:
    model: NatsForCausalLM
    step: int
    """Completed optimizer steps, counted from the start of the run (resumes included)."""
    train_losses: list[float]
    """Training loss of every step this call ran."""
    eval_metrics: dict[str, float]
    """Metrics of the last evaluation (empty if none ran, and on every rank but 0)."""
    interrupted: bool
    checkpoint: Path | None
    """The newest checkpoint on disk when the call returned."""


class StopRequest:
    """Set by the first SIGINT (Ctrl-C) or SIGTERM (what ``kill`` and job schedulers send);
    the loop checks it between steps, saves a checkpoint and returns."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)
    MESSAGE = "stopping after this step and saving a checkpoint"

    def __init__(self) -> None:
        self.requested = False

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.requested = True
        # A second signal stops at once, as the default handlers do.
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        name = signal.Signals(signum).name
        tqdm.write(f"nats: {name}: {self.MESSAGE} (send it again to stop now)")

    @contextlib.contextmanager
    def installed(self) -> Iterator[StopRequest]:
        """Catch the signals while training; signals can only be caught on the main
        thread."""
        if threading.current_thread() is not threading.main_thread():
            yield self
            return
        previous = {s: signal.signal(s, self._handle) for s in self.SIGNALS}
        try:
            yield self
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)


def autocast_for(precision: str, device: torch.device) -> contextlib.AbstractContextManager:
    """bf16 autocast when asked for, or by default on a GPU with bf16; else nothing."""
    bf16 = precision == "bf16" or (precision == "auto" and device.type == "cuda"
                                   and torch.cuda.is_bf16_supported())
    if not bf16:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=torch.bfloat16)


def reg_weight_at(step: int, config: TrainConfig) -> float:
    """Weight of the routing cost term at ``step``: 0 before ``reg_start`` of the run, 1 after."""
    return 0.0 if step < config.reg_start * config.steps else 1.0


def _start_or_resume(config: TrainConfig, resume: bool, model: NatsForCausalLM,
                     optimizer: torch.optim.Optimizer, skipped: list[Path],
                     say: Callable[[str], None]) -> int:
    """The first step to run: 0 for a new run, the checkpoint's step when resuming.

    A newest checkpoint that cannot be read or fails its digest (a disk that filled up, a
    copy cut short) is skipped with a warning for the older one ``keep_checkpoints`` kept,
    and added to ``skipped``.
    """
    found = list_checkpoints(config.out_dir)
    if not found:
        if (Path(config.out_dir) / TRAIN_CONFIG_FILE).is_file() and not resume:
            # A run that stopped before its first checkpoint: starting another over it would
            # replace its config and mix two runs' logs.
            raise FileExistsError(f"{config.out_dir} already holds a run without a checkpoint "
                                  "(stopped before its first, or starting elsewhere); start "
                                  "it over (--resume) or choose another output folder (--out)")
        if resume:
            say(f"nats: {config.out_dir} holds no checkpoint: starting from step 0")
        if config.init_from is not None:
            _load_initial_weights(model, config)
        return 0
    if not resume:
        raise FileExistsError(f"{config.out_dir} already holds a run ({found[-1][1].name}); "
                              "resume it (--resume) or choose another output folder (--out)")
    for _, path in reversed(found):
        try:
            saved = read_checkpoint_meta(path)["config"].get("model")
            if saved is None or NatsConfig.from_dict(saved) != config.model:
                raise ValueError(f"cannot resume {path}: it was trained with another model "
                                 "config")
            restored = load_checkpoint(path, model, optimizer)
        except CorruptCheckpoint as e:
            say(f"nats: warning: skipping {path.name}: {e}")
            skipped.append(path)
            continue
        if restored.step > config.steps:
            raise ValueError(f"cannot resume {path} at step {restored.step} for {config.steps} "
                             f"steps: give --steps {restored.step} or more")
        say(f"nats: resuming from {path} at step {restored.step}")
        return restored.step
    raise ValueError(f"cannot resume {config.out_dir}: none of its {len(found)} checkpoints "
                     "can be read (see the warnings above)")


def _hold_folder(config: TrainConfig, world: World, device: torch.device,
                 hold: contextlib.ExitStack) -> None:
    """Rank 0, the only writer, locks the run folder once the inputs proved good and before
    any write; every rank learns whether it could, so none waits for a rank that left."""
    busy: FolderBusy | None = None
    if world.is_main:
        try:
            hold.enter_context(exclusive(config.out_dir, "run folder"))
        except FolderBusy as e:
            busy = e
    if busy is not None:
        if world.size > 1:
            world.sum(torch.ones(1, device=device))
        raise busy
    if world.size > 1 and float(world.sum(torch.zeros(1, device=device))) > 0:
        raise FolderBusy(f"run folder {config.out_dir} is in use by another process (rank 0 "
                         "could not lock it)")


def _stop_agreed(stop: StopRequest, world: World, device: torch.device) -> bool:
    """Whether any rank was asked to stop: SIGTERM reaches ranks at different moments, and
    a rank that left alone would leave the others waiting in the next all-reduce."""
    if world.size == 1:
        return stop.requested
    return float(world.sum(torch.tensor([float(stop.requested)], device=device))) > 0


def _load_initial_weights(model: NatsForCausalLM, config: TrainConfig) -> None:
    """Start from a saved model's weights; its architecture must be the run's."""
    saved = NatsForCausalLM.from_pretrained(config.init_from)
    if saved.config != config.model:
        diff = sorted(k for k, v in config.model.to_dict().items()
                      if saved.config.to_dict().get(k) != v)
        raise ValueError(f"init_from: {config.init_from} holds another architecture than "
                         f"the run's model (differs in {', '.join(diff)})")
    model.load_state_dict(saved.state_dict())
    tqdm.write(f"nats: starting from the weights in {config.init_from}")


def _postfix(stats: StepStats, lr: float, tokens_per_s: float) -> dict[str, str]:
    postfix = {"loss": f"{stats.loss:.4f}", "lr": f"{lr:.2e}", "tok/s": f"{tokens_per_s:,.0f}"}
    frac = frac_scalars("train", stats.attn_frac).get("train/attn_frac")
    if frac is not None:
        postfix["attn_frac"] = f"{frac:.2f}"
    return postfix


def train(config: TrainConfig, *, resume: bool = False,
          on_eval: EvalCallback | None = None) -> TrainResult:
    """Train ``config.model`` on ``config.task``; write logs, checkpoints and the model.

    ``out_dir`` receives ``train_config.json``, TensorBoard events, ``checkpoints/`` and,
    at the end, the trained model in ``model/`` (``NatsForCausalLM.from_pretrained``).
    With ``resume``, training continues exactly where the newest checkpoint left off.
    Under ``torchrun`` every rank calls this; only rank 0 writes files and evaluates
    (``on_eval`` runs there, and the other ranks' ``eval_metrics`` stay empty).
    """
    with joined_world(config.device) as (world, device), contextlib.ExitStack() as hold:
        return _train(config, resume, on_eval, world, device, hold)


def _train(config: TrainConfig, resume: bool, on_eval: EvalCallback | None, world: World,
           device: torch.device, hold: contextlib.ExitStack) -> TrainResult:
    if config.batch_size % (world.size * config.grad_accum_steps):
        raise ValueError(f"TrainConfig.batch_size = {config.batch_size} is invalid: must be "
                         f"a multiple of {world.size} processes x grad_accum_steps = "
                         f"{config.grad_accum_steps}")
    if world.size > 1 and (config.route_explore > 0 or config.model.sampler == "gumbel"):
        # Every rank seeds alike, so each would draw the same noise for its own rows.
        raise ValueError("route_explore > 0 and sampler = 'gumbel' are not supported with "
                         "several processes yet: every process would draw the same routing "
                         "noise; train them in one process (grad_accum_steps for the batch)")
    if config.cuda_graph:
        check_graphable(device, world)
    if config.compile and device.type == "cpu" and config.seq_len % config.model.chunk_size:
        raise ValueError(
            f"TrainConfig.compile = True is invalid here: on a CPU, TorchInductor miscompiles "
            f"the backward of a sequence that ends inside a chunk (seq_len={config.seq_len}, "
            f"chunk_size={config.model.chunk_size}); use a multiple of chunk_size or no compile")
    out_dir = Path(config.out_dir)
    batches = build_batches(config)
    eval_batches = batches.eval(config.eval_batches)
    task = config.synthetic_task()
    autocast = autocast_for(config.precision, device)

    torch.manual_seed(config.seed)
    model = NatsForCausalLM(config.model).to(device)
    optimizer = build_optimizer(model, config)
    skipped: list[Path] = []
    # Every rank reads the checkpoint; one says so.
    say = tqdm.write if world.is_main else (lambda _: None)
    step = _start_or_resume(config, resume, model, optimizer, skipped, say)
    _hold_folder(config, world, device, hold)
    if world.is_main:
        for path in skipped:  # out of the way of latest_checkpoint, export and pruning
            path.rename(path.with_name(path.name + ".corrupt"))
    ddp = DistributedDataParallel(model) if world.size > 1 else None
    forward = ddp or model
    if config.compile:
        forward = torch.compile(forward)
    graphed = records_graph(config, device, world)
    if graphed:
        gradients = GraphedGradients(model, config, world, device, autocast)
    else:
        gradients = EagerGradients(forward, ddp, model, config, world, device, autocast)
    config_dict = config.to_dict()
    config_json = json.dumps(config_dict, indent=2)
    if world.is_main:
        atomic_write_bytes(out_dir / TRAIN_CONFIG_FILE, config_json.encode())
    log = RunLog(out_dir, step, enabled=world.is_main)
    if step == 0:
        log.config(config_json)

    def checkpoint_now() -> Path | None:
        if not world.is_main:
            return None
        return save_checkpoint(out_dir, step, model, optimizer, config_dict,
                               config.keep_checkpoints)

    losses: list[float] = []
    eval_metrics: dict[str, float] = {}
    checkpoint = latest_checkpoint(out_dir)
    saved_step = step if checkpoint is not None else -1
    stop = StopRequest()
    started, first_step = time.perf_counter(), step
    paused = 0.0  # seconds of evaluations and checkpoints, left out of the tokens/s
    tokens_per_step = config.batch_size * config.seq_len
    model.train()
    try:
        with stop.installed(), tqdm(total=config.steps, initial=step, dynamic_ncols=True,
                                    disable=None if world.is_main else True) as bar:
            n_params = sum(p.numel() for p in model.parameters())
            if world.is_main:
                tqdm.write(f"nats: training {n_params:,} parameters on '{config.task}' ({device}"
                           f"{f' x {world.size} processes' if world.size > 1 else ''}"
                           f"{', steps from a CUDA graph' if graphed else ''}), "
                           f"steps {step} -> {config.steps}, writing to {out_dir}")
            while step < config.steps and not _stop_agreed(stop, world, device):
                lr = lr_at(step, config)
                set_lr(optimizer, lr)
                noise = exploration_noise(step, config)
                set_exploration(model, noise)
                stats = gradients(batches.train(step), reg_weight_at(step, config))
                if not math.isfinite(stats.loss):
                    raise ValueError(f"training diverged: the loss is {stats.loss} at step "
                                     f"{step + 1}; the newest checkpoint is {checkpoint}")
                optimizer.step()
                if budget_active(step, config):
                    update_budget(model, stats.routable_frac, budget_target(step, config), config)
                step += 1
                losses.append(stats.loss)
                rate = tokens_per_step * (step - first_step) / (
                    time.perf_counter() - started - paused)
                bar.update(1)
                bar.set_postfix(_postfix(stats, lr, rate))

                if step % config.log_interval == 0:
                    log.scalars({"train/loss": stats.loss, "train/ce": stats.ce,
                                 "train/reg": stats.reg, "train/lr": lr,
                                 "train/grad_norm": float(stats.grad_norm),
                                 "train/tokens_per_s": rate,
                                 "train/route_noise": noise,
                                 **frac_scalars("train", stats.attn_frac),
                                 **route_frac_scalars("train", stats.routable_frac),
                                 **route_bias_scalars(model)}, step)
                # Rank 0 evaluates alone (every rank holds the same weights); the others
                # go on and wait for it in the next step's all-reduce.
                pause = time.perf_counter()
                if world.is_main and (step % config.eval_interval == 0
                                      or step == config.steps):
                    result = evaluate(model, eval_batches, device, autocast,
                                      batches.bytes_per_token, task)
                    eval_metrics = result.metrics
                    log.evaluation(result, step, config.model, config.seq_len)
                    tqdm.write(_eval_line(step, eval_metrics))
                    if on_eval is not None:
                        on_eval(step, eval_metrics, model)
                if step % config.checkpoint_interval == 0:
                    checkpoint = checkpoint_now()
                    saved_step = step
                paused += time.perf_counter() - pause

            # Inside the handlers: a Ctrl-C now asks to stop, which the end of the run
            # already does, instead of cutting the last checkpoint and the model short.
            if saved_step != step:
                checkpoint = checkpoint_now()
            interrupted = step < config.steps
            if interrupted:
                if world.is_main:
                    tqdm.write(f"nats: interrupted at step {step}; checkpoint saved to "
                               f"{checkpoint}")
            else:
                log.hparams(config_dict, eval_metrics)
                if world.is_main:
                    model.save_pretrained(out_dir / "model")
                    seconds = time.perf_counter() - started
                    tqdm.write(f"nats: done, {step} steps in {seconds:.1f} s; model saved to "
                               f"{out_dir / 'model'}")
    finally:
        log.close()  # also when the run diverges or a second Ctrl-C stops it
    return TrainResult(model, step, losses, eval_metrics, interrupted, checkpoint)


def _eval_line(step: int, metrics: dict[str, float]) -> str:
    """One console line per evaluation: the headline metrics, not every head's fraction."""
    names = ("loss", "ppl", "bpb", "acc", "seq_acc", "attn_frac", "route_lift")
    parts = [f"{name} {metrics[f'eval/{name}']:.4g}" for name in names
             if f"eval/{name}" in metrics]
    return f"step {step}: eval " + ", ".join(parts)
