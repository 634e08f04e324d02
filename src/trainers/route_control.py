"""How training steers the routers: exploration before routes harden, and the budget.

Both are pure functions of the step and of what the step measured, so a resumed run steers
exactly as an uninterrupted one (the budget's biases are buffers saved with the weights).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from tqdm import tqdm

from nats import NatsForCausalLM
from nats.config import nonnegative_finite, whole_at_least
from nats.eval_mode import eval_mode
from nats.kernels.reference.routes import budget_scores

from .config import TrainConfig
from .evaluation import evaluate


def exploration_noise(step: int, config: TrainConfig) -> float:
    """Gumbel noise scale on the routing logits at ``step``: 1 at the start, falling linearly
    to 0 at ``route_explore`` of the run. At 1 a chunk's route is a draw from the scorer's
    probabilities, so every chunk is tried on both sides while the scorer is still blind."""
    end = config.route_explore * config.steps
    return max(0.0, 1.0 - step / end) if end > 0 else 0.0


def set_exploration(model: NatsForCausalLM, noise: float) -> None:
    for layer in model.nats_layers:
        layer.route_noise = noise


def budget_active(step: int, config: TrainConfig) -> bool:
    """The budget, like the cost term, applies from ``reg_start`` of the run on."""
    return step >= config.reg_start * config.steps


def budget_target(step: int, config: TrainConfig) -> float | None:
    """The softmax fraction the budget holds at ``step``: 1 at the start of
    ``budget_anneal``, falling linearly to ``model.softmax_target`` at its end."""
    target = config.model.softmax_target
    end = config.budget_anneal * config.steps
    if target is None or step >= end:
        return target
    return 1.0 - (1.0 - target) * step / end


@torch.no_grad()
def update_budget(model: NatsForCausalLM, routable_frac: list[torch.Tensor | None],
                  target: float | None, config: TrainConfig) -> None:
    """One step of the budget's controller: move each routing bias against the error of
    the softmax fraction this step measured (the layer's own, or the mean over layers for
    ``budget_scope="model"``). An integral controller: the bias settles where the measured
    fraction equals ``target``, whatever the scorer's logits are."""
    cfg = model.config
    if target is None:
        return
    fracs = [float(f) for f in routable_frac if f is not None]
    if not fracs or any(math.isnan(f) for f in fracs):
        return  # sequences of a single chunk have nothing to route
    errors = fracs if cfg.budget_scope == "layer" else [sum(fracs) / len(fracs)] * len(fracs)
    for layer, error in zip(model.nats_layers, errors, strict=True):
        layer.budget.route_bias -= config.budget_rate * (error - target)


@dataclass(frozen=True)
class Calibration:
    """One layer's (or, with ``head`` set, one head's) calibrated routing bias, the share it
    was asked for and the share it routes on the calibration batches (off the target only
    where scores tie, as an untrained scorer's do)."""

    layer: int
    bias: float
    target: float
    share: float
    head: int | None = None


@torch.no_grad()
def calibrate_budget(model: NatsForCausalLM, batches: Sequence[torch.Tensor],
                     target: float | Sequence[float | Sequence[float]]) -> list[Calibration]:
    """Set every budgeted NAtS-L layer's routing bias so that it sends ``target`` of the
    routable chunks of ``batches`` (input ids) to softmax: one fraction in (0, 1) for every
    layer, or per layer, first to last, one fraction in [0, 1] or one per head (a split
    that :func:`split_budget` found, applied to other batches).

    The budget's controller holds the share on the training batches; data with other
    content routes another share (a recall model trained on a mixture of 8-32 pairs routed
    0.32 at 32 pairs under a 0.25 budget: docs/RESULTS.md). Calibrating on the workload
    makes the cost paid there the cost asked for. Layers are calibrated first to last (one
    pass over ``batches`` each), as a layer's routes change what the next one sees; each
    layer gets ``target`` (also under ``budget_scope="model"``, whose mean it then is; see
    :func:`split_budget` for a model-wide share split unevenly).
    """
    layers = _calibration_layers(model, batches)
    if isinstance(target, Sequence):
        if len(target) != len(layers):
            raise ValueError(f"{len(target)} calibration targets for {len(layers)} budgeted "
                             "NAtS-L layers")
        targets: list[float | list[float]] = []
        for t, (index, layer) in zip(target, layers, strict=True):
            if isinstance(t, Sequence):
                if len(t) != layer.budget.route_bias.numel():
                    raise ValueError(f"layer {index}: {len(t)} calibration targets for its "
                                     f"{layer.budget.route_bias.numel()} heads")
                for head in t:
                    _check_fraction(head, closed=True)
                targets.append([float(head) for head in t])
            else:
                _check_fraction(t, closed=True)
                targets.append(float(t))
    else:
        _check_fraction(target, closed=False)
        targets = [float(target)] * len(layers)
    return _calibrate(model, _Scores(model, layers, batches), targets)


@torch.no_grad()
def split_budget(model: NatsForCausalLM, batches: Sequence[tuple[torch.Tensor, torch.Tensor]],
                 target: float, levels: int = 2, unit: str = "layer", price: float = 0.0,
                 progress: bool = False,
                 on_split: Callable[[list[float], float], None] | None = None,
                 ) -> list[Calibration]:
    """Calibrate the routing biases so that the layers' shares average at most ``target``,
    split among the layers (``unit="layer"``) or among every layer's heads (``"head"``)
    where it lowers the loss on ``batches`` (input ids, labels).

    A softmax route is not worth the same in every layer: in the 2-layer recall models of
    docs/RESULTS.md ("Where the budget goes") the first layer's keep the pairs and the
    second's can all go to linear at no cost, so an even split pays for routes that buy
    nothing. Greedy: from every unit at ``target``, move a step of share from one unit to
    another while some move lowers the loss, the best move first; then halve the step,
    ``levels`` step sizes in all, from ``target / 2``. Each move tried costs a calibration
    and a loss pass over ``batches``. Where the moves stop, the split is a local optimum of
    the loss on these batches, never worse than the even split.

    Per head: the heads of one layer may take different parts, one sending the pairs of a
    recall task to softmax and another the noise; at a small share the first can hold it
    all (docs/RESULTS.md, "The heads of a layer split the work").

    Then the split gives share back. Once the task is solved the loss still falls a little
    with every extra route, so the moves above spend the rest of ``target`` on filler
    (docs/RESULTS.md, "The share split among heads, over seeds"). From the split found,
    the finest step of share is taken back, one unit at a time, from the unit where that
    raises the loss least, down to no share at all; of that path the split kept is the one
    with the least ``loss + price * share`` (the least share on a tie), so a route must buy
    ``price`` nats of loss (mean next-token loss) per unit of model-wide share. ``price=0``
    gives back only share whose routes do not lower the loss. The path is read whole, not
    cut at its first rise: the loss along it is not convex. ``on_split(shares, loss)``
    sees the start and every split taken, in order: the search's path of cost and loss,
    which :func:`kept_on_path` reads. What is returned is never worse than the even split
    in ``loss + price * share``.
    """
    _check_fraction(target, closed=False)
    if not whole_at_least(levels):
        raise ValueError(f"levels must be an integer >= 1, got {levels!r}")
    if unit not in ("layer", "head"):
        raise ValueError(f"unit must be 'layer' or 'head', got {unit!r}")
    if not nonnegative_finite(price):
        raise ValueError(f"price must be a number >= 0, got {price!r}")
    ids = [x for x, _ in batches]
    scores = _Scores(model, _calibration_layers(model, ids), ids)
    n_layers = len(scores.layers)
    heads = model.config.n_heads if unit == "head" else 1
    shares = [float(target)] * (n_layers * heads)
    step = target / 2
    slack = step * 1e-9  # share arithmetic on steps that are not powers of two

    def targets(flat: list[float]) -> list[float | list[float]]:
        if unit == "layer":
            return list(flat)
        return [flat[i * heads:(i + 1) * heads] for i in range(n_layers)]

    def loss(flat: list[float]) -> float:
        """The evaluation's mean next-token loss over the labelled tokens of ``batches``
        (``eval/ce``) with the layers calibrated to ``flat``."""
        _calibrate(model, scores, targets(flat))
        return evaluate(model, list(batches), ids[0].device).metrics["eval/ce"]

    def swaps() -> list[list[float]]:
        return [_moved(shares, i, -step, slack, j, step) for i in range(len(shares))
                for j in range(len(shares))
                if i != j and shares[i] - step >= -slack and shares[j] + step <= 1 + slack]

    def releases() -> list[list[float]]:
        return [_moved(shares, i, -step, slack) for i in range(len(shares))
                if shares[i] - step >= -slack]

    path: list[tuple[list[float], float]] = []

    def take(flat: list[float], value: float) -> None:
        path.append((flat, value))
        if on_split is not None:
            on_split(list(flat), value)

    take(shares, loss(shares))
    with tqdm(desc="nats: splitting the budget", unit="split", dynamic_ncols=True,
              disable=None if progress else True) as bar:  # None: no bar in a pipe

        def search(moves: Callable[[], list[list[float]]], better: bool) -> None:
            """Take the best of ``moves()`` while there is one (with ``better``: while it
            lowers the loss)."""
            nonlocal shares
            while True:
                tried = []
                for candidate in moves():
                    tried.append((loss(candidate), candidate))
                    bar.update()
                    bar.set_postfix(step=f"{step:g}", loss=f"{path[-1][1]:.4f}")
                if not tried:
                    return
                value, shares_tried = min(tried, key=lambda t: t[0])
                if better and value >= path[-1][1]:
                    return
                shares = shares_tried
                take(shares, value)

        for level in range(levels):
            if level:
                step /= 2
                slack = step * 1e-9
            search(swaps, better=True)
        search(releases, better=False)
    shares = list(path[kept_on_path(path, price)][0])
    return _calibrate(model, scores, targets(shares))


def swaps_end(path: Sequence[tuple[Sequence[float], float]]) -> int:
    """Where :func:`split_budget`'s moves end on its path (``on_split``'s calls, in order):
    the last split that still spends the whole share."""
    spent = [sum(shares) / len(shares) for shares, _ in path]
    return max(i for i, s in enumerate(spent) if s >= spent[0] * (1 - 1e-9))


def kept_on_path(path: Sequence[tuple[Sequence[float], float]], price: float) -> int:
    """The split :func:`split_budget` keeps at ``price`` from its path: of the splits from
    where the moves end on, the least ``loss + price * share``, the least share on a tie."""
    start = swaps_end(path)
    cost = [loss + price * sum(shares) / len(shares) for shares, loss in path[start:]]
    return start + max(i for i, c in enumerate(cost) if c == min(cost))


def _moved(shares: list[float], i: int, by: float, slack: float, j: int | None = None,
           back: float = 0.0) -> list[float]:
    """``shares`` with ``by`` added at ``i`` (and ``back`` at ``j``); a share within
    ``slack`` of 0 or 1 is set to it, so that rounding leaves no sliver of share."""
    out = list(shares)
    out[i] += by
    if j is not None:
        out[j] += back
    return [0.0 if x <= slack else 1.0 if x >= 1 - slack else x for x in out]


def _check_fraction(value: Any, closed: bool) -> None:
    interval = "[0, 1]" if closed else "(0, 1)"
    if (isinstance(value, bool) or not isinstance(value, (int, float))
            or not (0 <= value <= 1 if closed else 0 < value < 1)):
        raise ValueError(f"the calibration target must be a fraction in {interval}, got "
                         f"{value!r}")


def _calibration_layers(model: NatsForCausalLM, batches: Sequence[Any],
                        ) -> list[tuple[int, torch.nn.Module]]:
    if not batches:
        raise ValueError("no calibration batches")
    layers = budgeted_layers(model)
    if not layers:
        raise ValueError("the model has no NAtS-L layer under a softmax budget "
                         "(softmax_target) to calibrate")
    return layers


def _calibrate(model: NatsForCausalLM, scores: _Scores,
               targets: Sequence[float | Sequence[float]]) -> list[Calibration]:
    """Each layer to its target, first to last: one share for all its heads (one bias, over
    their pooled scores), or a share per head (a bias each)."""
    out = []
    with eval_mode(model):
        for position, ((index, layer), target) in enumerate(
                zip(scores.layers, targets, strict=True)):
            z = scores.of(position, targets[:position])
            # The route is the argmax of [z + bias, 0]: a tie goes to softmax (index 0).
            if isinstance(target, Sequence):
                z = z.view(-1, layer.budget.route_bias.numel())
                for head, t in enumerate(target):
                    bias = _threshold(z[:, head].contiguous(), t)
                    layer.budget.route_bias[head] = bias
                    out.append(Calibration(index, bias, t, float((z[:, head] + bias >= 0)
                                                                 .float().mean()), head))
            else:
                bias = _threshold(z, target)
                layer.budget.route_bias.fill_(bias)
                out.append(Calibration(index, bias, target,
                                       float((z + bias >= 0).float().mean())))
    return out


def _threshold(z: torch.Tensor, target: float) -> float:
    """The bias that sends the ``round(target * n)`` largest of ``n`` scores to softmax:
    minus the midpoint between that score and the next (sorting, as ``torch.quantile``
    refuses more than 2^24 values). None or all of them: the bias lies past the extreme
    score by one plus the scores' range, so that other data's chunks follow too (a fixed
    unit missed some under a max-pooled scorer, whose scores spread wider) while a budget
    trained on afterwards can still move it back."""
    ranked = z.sort(descending=True).values
    k = round(target * ranked.numel())
    margin = 1.0 + float(ranked[0] - ranked[-1])
    if k == 0:
        return -float(ranked[0]) - margin
    if k == ranked.numel():
        return -float(ranked[-1]) + margin
    return -float(ranked[k - 1] + ranked[k]) / 2


class _StopForward(Exception):
    """Raised by the score hook: the layers after the one calibrated need not run."""


class _Scores:
    """The routing scores ``z`` (the bias left out) of every routable chunk and head of each
    budgeted layer on the calibration batches, memoised. Layer ``i``'s scores depend only on
    the targets of the layers before it (its own bias acts after its scorer), so they are
    computed once for each distinct prefix of targets, by a forward pass that stops right
    after layer ``i``'s scorer. Valid while the weights stay as they are: one per search.

    Reading layer ``i`` needs the earlier layers' biases set for that prefix, as
    :func:`_calibrate` does, going first to last."""

    def __init__(self, model: NatsForCausalLM, layers: list[tuple[int, torch.nn.Module]],
                 batches: Sequence[torch.Tensor]) -> None:
        self.model, self.layers, self.batches = model, layers, batches
        self._memo: dict[tuple[int, str], torch.Tensor] = {}

    def of(self, position: int, earlier: Sequence[float | Sequence[float]]) -> torch.Tensor:
        key = (position, repr(list(earlier)))
        if key not in self._memo:
            self._memo[key] = self._read(self.layers[position][1])
        return self._memo[key]

    def _read(self, layer: torch.nn.Module) -> torch.Tensor:
        scores: list[torch.Tensor] = []
        budget = layer.budget

        def keep(module: torch.nn.Module, _: Any, logits: torch.Tensor) -> None:
            # The scorer's logits as the budget scores them (its bias is zero here); a
            # sequence's last chunk is not routable (no query sees its route).
            z = budget_scores(logits, budget.state(False, logits.device))
            scores.append(z[:, :-1, :, 0].flatten().float().cpu())
            raise _StopForward

        bias = budget.route_bias.clone()
        budget.route_bias.zero_()  # the hook then sees z itself
        handle = layer.scorer.register_forward_hook(keep)
        try:
            for ids in self.batches:
                with contextlib.suppress(_StopForward):
                    self.model(ids)
        finally:
            handle.remove()
            budget.route_bias.copy_(bias)
        z = torch.cat(scores) if scores else torch.empty(0)
        if z.numel() == 0:
            raise ValueError("the calibration batches hold no sequence of more than one chunk")
        return z


def budgeted_layers(model: NatsForCausalLM) -> list[tuple[int, torch.nn.Module]]:
    """``(block index, layer)`` of every NAtS-L layer under a softmax budget."""
    return [(i, block.mixer) for i, block in enumerate(model.blocks)
            if hasattr(block.mixer, "budget")]


def route_bias_scalars(model: NatsForCausalLM) -> dict[str, float]:
    """``train/route_bias/layer{i}`` of every NAtS-L layer under a budget (TensorBoard)."""
    return {f"train/route_bias/layer{i}": float(layer.budget.route_bias.mean())
            for i, layer in budgeted_layers(model)}
