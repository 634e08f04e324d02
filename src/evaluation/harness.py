"""Evaluate one model on task slices: accuracy, softmax fraction, speed, memory and cost.

Quality metrics are the trainer's own (:func:`nats.trainers.evaluate`), not a recount.
Speed is tokens per second of the evaluation forward passes (wall clock, CUDA synchronised).
Memory: on CUDA the peak of ``torch.cuda.max_memory_allocated`` during the slice; on the CPU
the process's peak resident set size (``ru_maxrss``, a high-water mark over the process's
whole life) and how much the slice raised it, which is 0 when an earlier peak was higher.
"""

from __future__ import annotations

import json
import resource
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from nats import NatsForCausalLM
from nats.atomic_write import atomic_write_bytes, check_output_file
from nats.config import whole_at_least
from nats.cost_model import IMPLIED_FRACTION, architecture_cost
from nats.eval_mode import eval_mode
from nats.latency import prefill_latency_ms
from nats.trainers import TrainConfig, build_batches, evaluate
from nats.trainers.evaluation import layer_fractions
from nats.trainers.loop import autocast_for
from nats.trainers.sources import LoadedModel
from nats.trainers.text import stdlib_fingerprint

from .slices import slice_name, slice_params

COST_CONTEXTS = (4096, 32768)
"""Context lengths the cost model is evaluated at for every slice."""


def length_label(seq_len: int, train_seq_len: int | None) -> str:
    """How the evaluated length relates to the training length."""
    if train_seq_len is None:
        return "training length unknown"
    if seq_len == train_seq_len:
        return "training length"
    side = "longer" if seq_len > train_seq_len else "shorter"
    return f"{side} than training ({train_seq_len})"


class _Memory:
    """Peak memory of one slice; see the module docstring for what is measured."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        if self.cuda:
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
        self.device = device
        self.rss_before = _peak_rss()

    def result(self) -> dict[str, Any]:
        if self.cuda:
            return {"what": "torch.cuda.max_memory_allocated during the slice",
                    "peak_bytes": torch.cuda.max_memory_allocated(self.device)}
        peak = _peak_rss()
        return {"what": "CPU: process peak RSS (ru_maxrss) after the slice and how much the "
                        "slice raised it (0: an earlier peak was higher)",
                "peak_rss_bytes": peak, "peak_rss_increase_bytes": peak - self.rss_before}


def _peak_rss() -> int:
    scale = 1 if sys.platform == "darwin" else 1024  # bytes on macOS, KiB on Linux
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale


def evaluate_slice(model: NatsForCausalLM, config: TrainConfig, batches: int,
                   device: torch.device, train_seq_len: int | None,
                   progress: tqdm | None = None) -> dict[str, Any]:
    """Metrics of ``model`` on ``batches`` evaluation batches of slice ``config``."""
    source = build_batches(config)
    data = source.eval(batches)
    autocast = autocast_for(config.precision, device)
    with torch.no_grad(), autocast:  # warm-up (kernel compilation, allocator): not timed
        model(data[0][0][:1].to(device))
    memory = _Memory(device)
    start = time.perf_counter()
    result = evaluate(model, data, device, autocast, source.bytes_per_token,
                      config.synthetic_task())
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    if progress is not None:
        progress.update(batches)
    m = result.metrics
    fractions = layer_fractions(model.config.layer_types, m)
    layers = [{"layer": i, "kind": kind, "measured": f is not None,
               "softmax_fraction": IMPLIED_FRACTION[kind] if f is None else f}
              for i, (kind, f) in enumerate(zip(model.config.layer_types, fractions,
                                                strict=True))]
    tokens = sum(x.numel() for x, _ in data)
    out: dict[str, Any] = {
        "name": slice_name(config), "task": config.task, "params": slice_params(config),
        "seq_len": config.seq_len, "train_seq_len": train_seq_len,
        "eval_seed": config.eval_seed,
        "length": length_label(config.seq_len, train_seq_len),
        "batches": batches, "batch_size": config.batch_size,
        "accuracy": m["eval/acc"], "sequence_accuracy": m["eval/seq_acc"],
        "loss": m["eval/ce"],
        "softmax_fraction": sum(x["softmax_fraction"] for x in layers) / len(layers),
        "layers": layers, "seconds": seconds, "tokens_per_second": tokens / seconds,
        "memory": memory.result(),
        "cost": {str(n): _cost_totals(model, fractions, n) for n in COST_CONTEXTS},
        "metrics": m}
    if "eval/bpb" in m:
        out["bits_per_byte"] = m["eval/bpb"]
    by_position = {k.removeprefix("eval/seq_acc/"): v for k, v in m.items()
                   if k.startswith("eval/seq_acc/")}
    if by_position:  # the needle: whole answers by where it sits
        out["by_position"] = by_position
    if "eval/route_informative" in m:  # the task knows which chunks hold the answers
        out["routing"] = {k.removeprefix("eval/"): v for k, v in m.items()
                          if k.startswith("eval/route_")}
    return out


def _cost_totals(model: NatsForCausalLM, fractions: list[float | None],
                 context: int) -> dict[str, float]:
    cost = architecture_cost(model.config, fractions, context).to_dict()
    return {k: v for k, v in cost.items() if k != "layers"}


def prefill_seconds(model: NatsForCausalLM, config: TrainConfig, seq_len: int,
                    device: torch.device) -> float:
    """Median wall time of a batch-1 forward over ``seq_len`` tokens of ``config``'s first
    evaluation batch (real data, so NAtS-L routes as it would): the search's latency
    measure (src/nats/latency.py), under the evaluation's autocast."""
    input_ids = build_batches(config).eval(1)[0][0]
    return prefill_latency_ms(model, input_ids, seq_len, autocast_for("auto", device)) / 1e3


def check_eval_arguments(batches: int, prefill_lens: Sequence[int],
                         out: str | Path | None) -> None:
    """What :func:`run_eval` is given, checked before any work (one-line errors)."""
    if not whole_at_least(batches):
        raise ValueError(f"--batches must be an integer >= 1, got {batches!r}")
    bad = [n for n in prefill_lens if not whole_at_least(n)]
    if bad:
        raise ValueError(f"--prefill lengths must be integers >= 1, got {bad}")
    if out is not None:
        check_output_file(out)


def run_eval(loaded: LoadedModel, slices: Sequence[TrainConfig], batches: int,
             device: torch.device, train_seq_len: int | None = None,
             prefill_lens: Sequence[int] = (), out: str | Path | None = None,
             show_progress: bool = True) -> dict[str, Any]:
    """Evaluate every slice (and time prefill at ``prefill_lens``); write JSON to ``out``."""
    check_eval_arguments(batches, prefill_lens, out)
    model = loaded.model.to(device)
    if train_seq_len is None and loaded.train_config is not None:
        train_seq_len = loaded.train_config.seq_len
    results = []
    with eval_mode(model), tqdm(total=batches * len(slices), desc="eval", unit="batch",
                                disable=not show_progress) as bar:
        for config in slices:
            bar.set_postfix_str(slice_name(config))
            results.append(evaluate_slice(model, config, batches, device, train_seq_len, bar))
    report: dict[str, Any] = {
        "source": loaded.origin, "device": str(device),
        "device_name": (torch.cuda.get_device_name(device) if device.type == "cuda"
                        else "cpu"),
        "torch": torch.__version__,
        "parameters": sum(p.numel() for p in model.parameters()),
        "model": model.config.to_dict(),
        "train_task": loaded.train_config.task if loaded.train_config else None,
        "train_seq_len": train_seq_len, "slices": results,
        "prefill": [{"seq_len": n, "batch_size": 1,
                     "seconds": prefill_seconds(model, slices[0], n, device)}
                    for n in prefill_lens]}
    if any(config.reads_stdlib() for config in slices):
        report["stdlib"] = stdlib_fingerprint()
    if out is not None:
        atomic_write_bytes(Path(out), (json.dumps(report, indent=2) + "\n").encode())
    return report


def summary_lines(report: dict[str, Any]) -> list[str]:
    """One line per slice for the terminal."""
    lines = [f"nats eval: {report['source']} on {report['device_name']}"]
    for s in report["slices"]:
        quality = (f"bpb {s['bits_per_byte']:.3f}" if "bits_per_byte" in s
                   else f"acc {s['accuracy']:.3f} seq_acc {s['sequence_accuracy']:.3f}")
        routing = s.get("routing", {})
        query = (f" (query chunks {routing['route_query']:.2f})" if "route_query" in routing
                 else "")  # a slice whose questions share every chunk with a pair has none
        precision = (f", informative chunks to softmax {routing['route_informative']:.2f} vs "
                     f"filler {routing['route_filler']:.2f}{query}" if routing else "")
        lines.append(f"  {s['name']}: {quality}, softmax fraction {s['softmax_fraction']:.3f}"
                     f"{precision}, {s['tokens_per_second']:,.0f} tok/s ({s['length']})")
        heads = [(k.removeprefix("route_informative/"), v) for k, v in routing.items()
                 if k.startswith("route_informative/") and "/head" in k]
        if heads:  # heads of one layer may take different parts: show each
            lines.append("    per head, informative / filler to softmax: " + ", ".join(
                f"{name.replace('/', ' ')} {v:.2f} / {routing[f'route_filler/{name}']:.2f}"
                for name, v in heads))
        if "by_position" in s:  # whole answers by where the needle sat
            lines.append("    whole answers by the needle's depth (% of the row) and chunks: "
                         + ", ".join(f"{k.removeprefix('depth_').replace('_', ' ')} {v:.3f}"
                                     for k, v in s["by_position"].items()))
    for p in report["prefill"]:
        lines.append(f"  prefill {p['seq_len']} tokens: {1000 * p['seconds']:.2f} ms")
    return lines
