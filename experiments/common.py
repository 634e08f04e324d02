"""What the experiment scripts share: scales, the time budget, train-then-evaluate, tables.

Not a package users import: ``python experiments/mqar.py --scale cpu`` and its siblings put
this folder on ``sys.path`` themselves. Only torch, tqdm, safetensors and tensorboard are
needed (no ray, optuna or ``datasets``).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from nats.evaluation import LoadedModel, run_eval
from nats.trainers import TrainConfig, resolve_device, train
from nats.trainers.config import ARCHITECTURES, with_architecture

PREFILL_LEN = 4096
"""Batch-1 prefill timed on a GPU (CPU timings would say nothing about the kernels)."""


def parse_args(description: str, scales: dict[str, dict[str, Any]],
               ) -> tuple[argparse.Namespace, dict[str, Any]]:
    """The command line, and the chosen scale's settings (its ``minutes`` is the default
    time budget)."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--scale", choices=list(scales), default="cpu",
                   help="cpu: reduced, minutes on a CPU; gpu: the issue's size, < 1 h on one "
                        "GPU; gpu-quick: a few minutes on one GPU")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    p.add_argument("--max-minutes", type=float, default=None,
                   help="stop starting new runs after this long (default: the scale's)")
    p.add_argument("--archs", nargs="+", choices=ARCHITECTURES, default=list(ARCHITECTURES))
    p.add_argument("--out", type=Path, default=None, help="results folder")
    args = p.parse_args()
    scale = scales[args.scale]
    if args.max_minutes is None:
        args.max_minutes = scale["minutes"]
    return args, scale


@dataclass
class Budget:
    """Runs start only while time is left; the ones that could not are recorded as skipped."""

    minutes: float
    start: float = 0.0

    def __post_init__(self) -> None:
        self.start = time.monotonic()

    def left(self) -> bool:
        return time.monotonic() - self.start < 60 * self.minutes


def train_and_eval(config: TrainConfig, arch: str, slices: Sequence[TrainConfig],
                   eval_batches: int, device: torch.device, out: Path,
                   prefill: bool) -> dict[str, Any]:
    """Train ``config`` with ``arch``'s mixers, then evaluate it on ``slices``."""
    config = with_architecture(config, arch).replace(device=str(device))
    started = time.monotonic()
    result = train(config)
    train_seconds = time.monotonic() - started
    loaded = LoadedModel(result.model.eval(), config, f"run {config.out_dir}")
    slices = [s.replace(model=config.model) for s in slices]
    report = run_eval(loaded, slices, eval_batches, device, out=out,
                      prefill_lens=[PREFILL_LEN] if prefill else [])
    report.update(arch=arch, lr=config.lr, seed=config.seed, steps=result.step,
                  train_seconds=train_seconds, final_train_loss=result.train_losses[-1])
    out.write_text(json.dumps(report, indent=2) + "\n")
    return report


def run_grid(name: str, args: argparse.Namespace, base: TrainConfig, lrs: Sequence[float],
             seeds: Sequence[int], slices: Sequence[TrainConfig], eval_batches: int,
             select: Callable[[dict[str, Any]], float]) -> list[dict[str, Any]]:
    """Every architecture x learning rate x seed, in that order of priority under the budget
    (all architectures at the first seed before any second seed). A run whose JSON report
    is already in the folder is read back, not trained again, so the same command with more
    ``--max-minutes`` finishes a grid the budget cut short. Returns the reports."""
    device = resolve_device(args.device)
    out = args.out or Path("runs/experiments") / f"{name}-{args.scale}"
    out.mkdir(parents=True, exist_ok=True)
    budget = Budget(args.max_minutes)
    reports, skipped, diverged = [], [], []
    for seed in seeds:
        for arch in args.archs:
            for lr in lrs:
                tag = f"{arch}-lr{lr:g}-seed{seed}"
                done = out / f"{tag}.json"
                if done.is_file():  # finished by an earlier call: a cut-short grid goes on
                    report = json.loads(done.read_text())
                elif not budget.left():
                    skipped.append(tag)
                    continue
                else:
                    run = base.replace(lr=lr, seed=seed, out_dir=str(out / "runs" / tag))
                    try:
                        report = train_and_eval(run, arch, slices, eval_batches, device, done,
                                                prefill=device.type == "cuda")
                    except ValueError as e:  # one diverging lr must not cost the whole table
                        if not str(e).startswith("training diverged"):
                            raise
                        diverged.append(f"{tag} ({e})")
                        continue
                report["selection_score"] = select(report)
                reports.append(report)
    summary = {"experiment": name, "scale": args.scale, "device": str(device),
               "device_name": reports[0]["device_name"] if reports else None,
               "minutes": (time.monotonic() - budget.start) / 60, "skipped": skipped,
               "diverged": diverged, "runs": [_brief(r) for r in reports]}
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return reports


def _brief(report: dict[str, Any]) -> dict[str, Any]:
    keep = ("arch", "lr", "seed", "steps", "train_seconds", "final_train_loss",
            "selection_score", "parameters", "prefill")
    slices = [{k: s[k] for k in ("name", "length", "accuracy", "sequence_accuracy",
                                 "softmax_fraction", "cost", "tokens_per_second")}
              | ({"bits_per_byte": s["bits_per_byte"]} if "bits_per_byte" in s else {})
              for s in report["slices"]]
    return {**{k: report[k] for k in keep}, "slices": slices}


def best_per_seed(reports: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """Per architecture, the best learning rate's report of each seed (highest score)."""
    best: dict[tuple[str, int], dict[str, Any]] = {}
    for r in reports:
        key = (r["arch"], r["seed"])
        if key not in best or r["selection_score"] > best[key]["selection_score"]:
            best[key] = r
    out: dict[str, list[dict[str, Any]]] = {}
    for (arch, _), r in sorted(best.items(), key=lambda kv: kv[0][1]):
        out.setdefault(arch, []).append(r)
    return out


def mean_std(values: Sequence[float]) -> str:
    """``mean ± std`` (population std over seeds), or the value alone for one seed."""
    m = sum(values) / len(values)
    if len(values) == 1:
        return f"{m:.3f}"
    sd = (sum((v - m) ** 2 for v in values) / len(values)) ** 0.5
    return f"{m:.3f} ± {sd:.3f}"


def cost_cells(report: dict[str, Any], slice_index: int = 0) -> list[str]:
    """Mixer GFLOPs/token and KV-cache MiB at 4k and 32k, and the GPU prefill time."""
    cost = report["slices"][slice_index]["cost"]
    cells = []
    for n in ("4096", "32768"):
        cells.append(f"{cost[n]['flops_per_token'] / 1e6:.2f}")
        cells.append(f"{cost[n]['kv_cache_bytes'] / 2**20:.2f}")
    prefill = report.get("prefill") or []
    cells.append(f"{1000 * prefill[0]['seconds']:.1f}" if prefill else "n/a (CPU)")
    return cells


COST_HEADER = ["MFLOPs/tok @4k", "KV MiB @4k", "MFLOPs/tok @32k", "KV MiB @32k",
               "prefill ms @4k"]


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def write_table(out: Path, title: str, table: str, notes: Sequence[str]) -> None:
    """``table.md`` in ``out``, with the device and the runs the budget skipped."""
    summary = json.loads((out / "summary.json").read_text())
    ran = (f"Ran on {summary['device_name']} ({summary['device']}) in "
           f"{summary['minutes']:.1f} min, torch {torch.__version__}.")
    if summary["skipped"]:
        ran += f" Skipped for the time budget: {', '.join(summary['skipped'])}."
    if summary["diverged"]:
        ran += f" Diverged (no row): {'; '.join(summary['diverged'])}."
    text = "\n".join([f"## {title}", "", table, "", *notes, "", ran, ""])
    (out / "table.md").write_text(text)
    print(text)
