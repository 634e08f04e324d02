"""Evaluation of a model on a run's fixed batches: loss, perplexity, accuracy, routing.

Sums are taken over labelled tokens of all batches before dividing, so a metric does not
depend on how the evaluation set is cut into batches.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

from nats import NatsForCausalLM
from nats.eval_mode import eval_mode
from nats.kernels import SOFTMAX
from nats.model import IGNORE_INDEX, next_token_cross_entropy

from .synthetic import Batch, SyntheticTask


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


def layer_fractions(layer_types: tuple[str, ...],
                    metrics: Mapping[str, float]) -> list[float | None]:
    """Each layer's softmax fraction read back from :func:`frac_scalars`' tags (prefix
    ``eval``): measured for NAtS-L layers, ``None`` for the others, whose fraction their
    type fixes."""
    out: list[float | None] = []
    for i, kind in enumerate(layer_types):
        if kind != "nats":
            out.append(None)
            continue
        key = f"eval/attn_frac/layer{i}"
        if key not in metrics:
            raise ValueError(f"metrics lack {key}, the softmax fraction of NAtS-L layer {i}")
        out.append(float(metrics[key]))
    return out


def route_frac_scalars(prefix: str, routable_frac: list[torch.Tensor | None]) -> dict[str, float]:
    """The share of routable chunks (all but a sequence's last) sent to softmax, per NAtS-L
    layer and over layers: ``{prefix}/route_frac[/layer{i}]``, what a budget holds (the
    per-token ``attn_frac`` also counts every sequence's last chunk)."""
    values = {i: float(f) for i, f in enumerate(routable_frac)
              if f is not None and not math.isnan(float(f))}
    out = {f"{prefix}/route_frac/layer{i}": v for i, v in values.items()}
    if values:
        out[f"{prefix}/route_frac"] = sum(values.values()) / len(values)
    return out


RelevantFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""``(input_ids, labels) -> bool [B, T]``: the positions a task's answers are read from
(MQAR's key-value pairs, a needle); see ``relevant_positions`` of the synthetic tasks."""


def informative_chunks(relevant: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """``[B, N]``: whether chunk ``c`` holds a relevant position (``relevant`` ``[B, T]``)."""
    b, t = relevant.shape
    n = -(-t // chunk_size)
    padded = torch.zeros(b, n * chunk_size, dtype=torch.bool, device=relevant.device)
    padded[:, :t] = relevant
    return padded.view(b, n, chunk_size).any(-1)


def question_positions(labels: torch.Tensor) -> torch.Tensor:
    """Bool ``[B, T]``: the positions of a synthetic task's questions: each labelled token
    and the token before it, from which it is predicted (an MQAR query's key and value)."""
    asked = labels != IGNORE_INDEX
    asked[:, :-1] |= asked[:, 1:].clone()
    return asked


class RoutingPrecision:
    """How often routable chunks (all but a sequence's last) go to softmax, apart for the
    chunks that hold what the queries ask (informative), the chunks that hold the questions
    and nothing informative (query), and the rest (filler), summed over heads and batches
    per NAtS-L layer.

    ``route_lift = informative rate / filler rate`` is the picture of a router that learned
    content: 1 for a content-blind router, large when the few chunks that matter are the
    ones kept in the KV cache. Query chunks are neither: counted as filler they made a
    layer that sent every question and no noise to softmax look like one that sends noise
    there (docs/RESULTS.md, "Query chunks are not filler").
    """

    KINDS = ("informative", "query", "filler")

    def __init__(self) -> None:
        self.counts: dict[int, torch.Tensor] = {}
        """Layer -> ``[kind, head, (softmax decisions, decisions)]`` over :attr:`KINDS`."""

    def add(self, routes: list[torch.Tensor | None], relevant: torch.Tensor,
            asked: torch.Tensor, chunk_size: int) -> None:
        """Count one batch: ``relevant`` and ``asked`` (:func:`question_positions`) are
        bool ``[B, T]``."""
        info = informative_chunks(relevant, chunk_size)[:, :-1].cpu()  # last: no route
        query = informative_chunks(asked, chunk_size)[:, :-1].cpu() & ~info
        kinds = (info, query, ~info & ~query)
        for i, r in enumerate(routes):
            if r is None or r.shape[1] < 2:
                continue
            sm = (r[:, :-1, :, SOFTMAX].detach() > 0.5).cpu()  # [B, N - 1, H]
            row = torch.stack([torch.stack([(sm & m[..., None]).sum((0, 1)),
                                            m.sum().expand(sm.shape[-1])], -1)
                               for m in kinds]).to(torch.float64)  # [kind, H, 2]
            self.counts[i] = self.counts.get(i, torch.zeros_like(row)) + row

    def metrics(self) -> dict[str, float]:
        """``eval/route_informative``, ``eval/route_query``, ``eval/route_filler`` and
        ``eval/route_lift``, per layer (``.../layer{i}``), per head of a layer with more
        than one (``.../layer{i}/head{h}``) and over all layers' decisions.

        A layer's rates pool its heads, and heads may take different parts: in trained
        recall models one head of a layer often sends the pairs to softmax and no noise,
        while the other sends noise and no pairs (keeping its linear state clean); the
        pooled lift then reads as a blind router, the per-head one does not.
        """
        out: dict[str, float] = {}
        if not self.counts:
            return out
        groups = [("", sum(c.sum(1) for c in self.counts.values()))]
        for i, c in self.counts.items():
            groups.append((f"/layer{i}", c.sum(1)))
            if c.shape[1] > 1:
                groups += [(f"/layer{i}/head{h}", c[:, h]) for h in range(c.shape[1])]
        for name, c in groups:
            if c[0, 1] == 0 or c[2, 1] == 0:
                continue  # no informative (or no filler) chunk was seen
            rates = {k: float(c[j, 0] / c[j, 1]) for j, k in enumerate(self.KINDS)
                     if c[j, 1] > 0}
            for k, v in rates.items():
                out[f"eval/route_{k}{name}"] = v
            if rates["filler"] > 0:
                out[f"eval/route_lift{name}"] = rates["informative"] / rates["filler"]
        return out


def span_bounds(relevant: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """First and last relevant position of every row of ``relevant`` bool ``[B, T]`` (0
    and ``T - 1`` for a row with none)."""
    first = relevant.int().argmax(1)
    return first, relevant.shape[1] - 1 - relevant.flip(1).int().argmax(1)


class SpanPosition:
    """Share of rows answered whole by where their one informative span sits: the fifth of
    the row its first token falls in, and whether it lies in one chunk or crosses a chunk
    boundary (its two parts then take separate routes). A needle missed only past a depth,
    or only across a boundary, points at the routing or the chunking rather than at the
    model's reading of the needle."""

    BINS = 5

    def __init__(self) -> None:
        self.counts = torch.zeros(self.BINS + 2, 2, dtype=torch.float64)
        """Rows ``[depth bins..., in one chunk, across chunks]`` x ``(solved, rows)``."""

    def add(self, relevant: torch.Tensor, solved: torch.Tensor, chunk_size: int) -> None:
        """Count one batch: ``relevant`` bool ``[B, T]`` (one span per row), ``solved``
        bool ``[B]``; rows with no relevant position are left out."""
        relevant, solved = relevant.cpu(), solved.cpu()
        t = relevant.shape[1]
        has = relevant.any(1)
        first, last = span_bounds(relevant)
        depth = torch.clamp(first * self.BINS // t, max=self.BINS - 1)
        across = first // chunk_size != last // chunk_size
        chunks = torch.where(across, self.BINS + 1, self.BINS)
        for group in (depth[has], chunks[has]):
            self.counts[:, 0].index_add_(0, group, solved[has].double())
            self.counts[:, 1].index_add_(0, group, torch.ones(len(group), dtype=torch.float64))

    def metrics(self) -> dict[str, float]:
        """``eval/seq_acc/depth_{lo}-{hi}`` (per cent of the row), ``eval/seq_acc/in_one_chunk``
        and ``eval/seq_acc/across_chunks``, for the groups that hold a row."""
        step = 100 // self.BINS
        names = [f"depth_{i * step}-{(i + 1) * step}" for i in range(self.BINS)]
        names += ["in_one_chunk", "across_chunks"]
        return {f"eval/seq_acc/{name}": float(solved / rows)
                for name, (solved, rows) in zip(names, self.counts.tolist(), strict=True)
                if rows > 0}


def labelled_token_count(labels: torch.Tensor) -> int:
    """Positions whose next-token label carries loss (the shift drops the first label)."""
    return int((labels[:, 1:] != IGNORE_INDEX).sum())


@torch.no_grad()
def evaluate(model: NatsForCausalLM, batches: list[Batch], device: torch.device,
             autocast: contextlib.AbstractContextManager | None = None,
             bytes_per_token: float | None = None,
             task: SyntheticTask | None = None) -> Evaluation:
    """Evaluate ``model`` on ``batches`` (of the synthetic ``task``, if any) in eval mode.

    ``eval/acc`` is the share of labelled tokens predicted exactly (greedy) and
    ``eval/seq_acc`` the share of sequences whose labelled tokens are all right, e.g. MQAR
    queries or a needle's digits. ``eval/bpb`` (bits per byte) needs ``bytes_per_token``;
    the routing precision (:class:`RoutingPrecision`) needs the task's
    ``relevant_positions`` (a :data:`RelevantFn`), and a task whose positions are one span
    per row (``ONE_SPAN``, the needle) adds :class:`SpanPosition`'s accuracies.
    """
    relevant: RelevantFn | None = getattr(task, "relevant_positions", None)
    by_position: bool = getattr(task, "ONE_SPAN", False)
    ce_sum = reg_sum = 0.0
    tokens = correct = sequences = solved = 0
    frac_sums: dict[str, float] = {}
    routes: list[torch.Tensor | None] = []
    probs: list[list[torch.Tensor]] = []
    precision = RoutingPrecision()
    where = SpanPosition()
    with eval_mode(model):
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
            row_solved = has_labels & (hit == mask).all(1)
            solved += int(row_solved.sum())
            for k, v in {**frac_scalars("eval", out.attn_frac),
                         **route_frac_scalars("eval", out.routable_frac)}.items():
                frac_sums[k] = frac_sums.get(k, 0.0) + v
            marked = relevant(input_ids, labels) if relevant is not None else None
            if marked is not None and model.nats_layers:
                precision.add(out.routes, marked, question_positions(labels),
                              model.config.chunk_size)
            if marked is not None and by_position:
                where.add(marked, row_solved, model.config.chunk_size)
            if i == 0:
                routes = [r.detach() if r is not None else None for r in out.routes]
                probs = [[] for _ in out.probs]
            for layer, p in zip(probs, out.probs, strict=True):
                if p is not None:
                    layer.append(p[..., SOFTMAX].detach().float().flatten().cpu())
    if tokens == 0:
        raise ValueError(f"the {len(batches)} evaluation batches hold no labelled token: loss, "
                         "perplexity and accuracy are undefined")

    n = len(batches)
    ce = ce_sum / max(tokens, 1)
    metrics = {"eval/loss": ce + reg_sum / n, "eval/ce": ce, "eval/reg": reg_sum / n,
               "eval/ppl": math.exp(min(ce, 80.0)), "eval/acc": correct / max(tokens, 1),
               "eval/seq_acc": solved / max(sequences, 1),
               **{k: v / n for k, v in frac_sums.items()}, **precision.metrics(),
               **where.metrics()}
    if bytes_per_token is not None:
        metrics["eval/bpb"] = ce / math.log(2) / bytes_per_token
    return Evaluation(metrics, routes, [torch.cat(p) if p else None for p in probs])
