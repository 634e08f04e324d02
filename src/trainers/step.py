"""One optimizer step's gradients: eager, or replayed from a CUDA graph.

A NAtS-L training step is bound by the host on a GPU: hundreds of small launches per layer
from Python (docs/BENCHMARKS.md, "What bounds it: the host"). :class:`GraphedGradients`
records the step's GPU work once (forward and backward of every micro-batch, gradient
clipping and the routing statistics' commit) and replays it with the next batch copied
into the same buffers. The optimizer, the budget's controller and everything the loop
logs stay eager, so checkpoints, resumption and the learning-rate schedule are the eager
run's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.nn.parallel import DistributedDataParallel

from nats import NatsForCausalLM
from nats.cuda_graph import warm_then_capture
from nats.model import next_token_cross_entropy

from .config import TrainConfig
from .distributed import World
from .evaluation import labelled_token_count
from .synthetic import Batch


@dataclass
class StepStats:
    loss: float
    ce: float
    reg: float
    attn_frac: list[torch.Tensor | None]
    routable_frac: list[torch.Tensor | None]
    grad_norm: torch.Tensor
    """The global gradient norm before clipping (on the device; read it only to log it)."""


@dataclass
class _Sums:
    """What the backward passes measured, still on the device."""

    totals: torch.Tensor
    """Cross-entropy summed over tokens, the cost term summed over rows."""
    fracs: list[torch.Tensor | None]
    routable: list[torch.Tensor | None]
    grad_norm: torch.Tensor


def _gradients(forward: Callable, ddp: DistributedDataParallel | None, model: NatsForCausalLM,
               input_ids: torch.Tensor, labels: torch.Tensor, config: TrainConfig,
               world: World, autocast: contextlib.AbstractContextManager,
               reg_weight: float | torch.Tensor, global_tokens: int | torch.Tensor,
               global_rows: int) -> _Sums:
    """Gradients of one global batch, split over ranks and ``grad_accum_steps`` micro-batches,
    clipped, and the routing statistics committed.

    Each micro-batch's loss is weighted by its share of the global batch's labelled tokens
    (the regulariser by its share of sequences), so the gradient equals that of the whole
    batch in one piece however it is split. Nothing here reads a value back from the GPU.
    """
    micro = len(input_ids) // config.grad_accum_steps
    totals = torch.zeros(2, device=input_ids.device)
    micro_fracs: list[list[torch.Tensor | None]] = []
    micro_routable: list[list[torch.Tensor | None]] = []
    for i in range(config.grad_accum_steps):
        part = slice(i * micro, (i + 1) * micro)
        last = i == config.grad_accum_steps - 1
        with contextlib.nullcontext() if ddp is None or last else ddp.no_sync():
            with autocast:
                out = forward(input_ids[part])
                ce_sum = next_token_cross_entropy(out.logits, labels[part], reduction="sum")
            reg = out.reg_loss.float() * reg_weight
            # DDP averages gradients over ranks: scale by the world size to get their sum.
            loss = (ce_sum / global_tokens + reg * micro / global_rows) * world.size
            loss.backward()
        totals += torch.stack([ce_sum.detach(), reg.detach() * micro])
        micro_fracs.append(out.attn_frac)
        micro_routable.append([None if f is None else f.view(1) for f in out.routable_frac])
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
    model.update_routing_statistics(world.sum)
    # Softmax fractions: mean over micro-batches (equal sizes).
    fracs = [_micro_mean(micro_fracs, j) for j in range(len(micro_fracs[0]))]
    routable = [_micro_mean(micro_routable, j) for j in range(len(micro_routable[0]))]
    return _Sums(totals, fracs, routable, grad_norm)


def _micro_mean(values: list[list[torch.Tensor | None]], layer: int) -> torch.Tensor | None:
    if values[0][layer] is None:
        return None
    return torch.stack([m[layer] for m in values]).float().mean(0)


def _stats(sums: _Sums, world: World, global_tokens: int, global_rows: int) -> StepStats:
    """The step's loss and fractions as the loop logs them: summed over ranks, read back."""
    present = [f for f in (*sums.fracs, *sums.routable) if f is not None]
    summed = world.sum(torch.cat([sums.totals, *present]).detach())
    ce, reg_mean = float(summed[0]) / global_tokens, float(summed[1]) / global_rows
    summed_fracs = iter(summed[2:].split([f.numel() for f in present]))
    attn_frac = [None if f is None else next(summed_fracs) / world.size for f in sums.fracs]
    routable_frac = [None if f is None else next(summed_fracs)[0] / world.size
                     for f in sums.routable]
    return StepStats(ce + reg_mean, ce, reg_mean, attn_frac, routable_frac, sums.grad_norm)


class EagerGradients:
    """``gradients(batch, reg_weight)``: the step's gradients in ``model``'s ``.grad``."""

    def __init__(self, forward: Callable, ddp: DistributedDataParallel | None,
                 model: NatsForCausalLM, config: TrainConfig, world: World,
                 device: torch.device, autocast: contextlib.AbstractContextManager) -> None:
        self.forward, self.ddp, self.model, self.config = forward, ddp, model, config
        self.world, self.device, self.autocast = world, device, autocast

    def __call__(self, batch: Batch, reg_weight: float) -> StepStats:
        input_ids, labels = batch
        global_rows, global_tokens = len(input_ids), max(labelled_token_count(labels), 1)
        rows = self.world.rows(global_rows)
        self.model.zero_grad(set_to_none=True)
        sums = _gradients(self.forward, self.ddp, self.model, input_ids[rows].to(self.device),
                          labels[rows].to(self.device), self.config, self.world, self.autocast,
                          reg_weight, global_tokens, global_rows)
        return _stats(sums, self.world, global_tokens, global_rows)


def _one_gpu(device: torch.device, world: World) -> bool:
    """Where a step can be recorded: one process on a CUDA GPU."""
    return device.type == "cuda" and world.size == 1


def check_graphable(device: torch.device, world: World) -> None:
    """Refuse ``cuda_graph`` where it cannot record; the loop calls this before it builds
    data or touches the run folder, so a wrong device costs nothing."""
    if not _one_gpu(device, world):
        raise ValueError("TrainConfig.cuda_graph = True needs one process on a CUDA GPU "
                         f"(got device {device}, {world.size} processes)")


def records_graph(config: TrainConfig, device: torch.device, world: World) -> bool:
    """Whether a run's steps are replayed from a CUDA graph: as ``config.cuda_graph`` says,
    and where it says nothing (``None``) wherever recording works, as the eager step is
    mostly host work on a GPU (docs/BENCHMARKS.md, "Training with ``nats train
    --cuda-graph``")."""
    if config.cuda_graph is not None:
        return config.cuda_graph
    return _one_gpu(device, world) and not config.compile and config.route_explore == 0


class GraphedGradients:
    """:class:`EagerGradients` on one GPU, from the second step on replayed from a CUDA graph.

    The first step runs eagerly (it compiles and autotunes every kernel); the second runs
    eagerly on a side stream and records the graph, and is the step's real work; each
    later step copies its batch into the recorded buffers and replays. What changes from
    step to step enters through tensors the graph reads: the batch, its labelled-token
    count and the cost term's weight; the budget's biases are buffers updated in place.
    The gradients stay in the graph's memory (``.grad`` is never reset), which every
    replay overwrites.
    """

    def __init__(self, model: NatsForCausalLM, config: TrainConfig, world: World,
                 device: torch.device, autocast: contextlib.AbstractContextManager) -> None:
        check_graphable(device, world)
        self.model, self.config, self.world, self.autocast = model, config, world, autocast
        self.eager = EagerGradients(model, None, model, config, world, device, autocast)
        self.steps = 0
        """Calls so far (this process's steps, counted from a resume)."""
        self.graph: torch.cuda.CUDAGraph | None = None
        self.recorded: _Sums | None = None
        self.ids: torch.Tensor | None = None
        self.labels: torch.Tensor | None = None
        self.tokens = torch.ones((), device=device)
        self.reg_weight = torch.zeros((), device=device)

    def __call__(self, batch: Batch, reg_weight: float) -> StepStats:
        self.steps += 1
        if self.steps == 1:
            return self.eager(batch, reg_weight)
        input_ids, labels = batch
        global_rows, global_tokens = len(input_ids), max(labelled_token_count(labels), 1)
        if self.ids is None:
            self.ids = input_ids.to(self.tokens.device)
            self.labels = labels.to(self.tokens.device)
        elif input_ids.shape != self.ids.shape or labels.shape != self.labels.shape:
            raise ValueError(f"CUDA-graphed steps need batches of one shape: "
                             f"{tuple(self.ids.shape)} was recorded, this process's step "
                             f"{self.steps} has {tuple(input_ids.shape)} (train with "
                             f"TrainConfig.cuda_graph = False)")
        else:
            self.ids.copy_(input_ids)
            self.labels.copy_(labels)
        self.tokens.fill_(global_tokens)
        self.reg_weight.fill_(reg_weight)
        if self.graph is None:
            return self._record(global_tokens, global_rows)
        self.graph.replay()
        return _stats(self.recorded, self.world, global_tokens, global_rows)

    def _gradients(self, global_rows: int) -> _Sums:
        return _gradients(self.model, None, self.model, self.ids, self.labels, self.config,
                          self.world, self.autocast, self.reg_weight, self.tokens, global_rows)

    def _record(self, global_tokens: int, global_rows: int) -> StepStats:
        params = [p for p in self.model.parameters() if p.requires_grad]

        def this_step() -> tuple[StepStats, list[torch.Tensor | None]]:
            self.model.zero_grad(set_to_none=True)
            stats = _stats(self._gradients(global_rows), self.world, global_tokens,
                           global_rows)
            grads = [p.grad for p in params]
            # Without gradients the recording makes them in the graph's own memory.
            self.model.zero_grad(set_to_none=True)
            return stats, grads

        try:
            (stats, grads), self.graph, self.recorded = warm_then_capture(
                this_step, lambda: self._gradients(global_rows), self.tokens.device)
        except torch.cuda.OutOfMemoryError as error:
            # The graph keeps the step's working memory in a pool of its own, so a run that
            # fits eagerly may not fit recorded: say how to train without the graph.
            raise torch.cuda.OutOfMemoryError(
                f"{error}\nRecording the training step in a CUDA graph ran out of GPU memory: "
                "train eagerly with TrainConfig.cuda_graph = False (nats train "
                "--no-cuda-graph)") from error
        # The recording ran nothing: give this step's gradients to the optimizer in the
        # tensors that replays will fill.
        for p, grad in zip(params, grads, strict=True):
            if grad is not None:
                p.grad.copy_(grad)
        return stats
