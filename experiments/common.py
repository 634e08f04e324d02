"""What the experiment scripts share: scales, the time budget, train-then-evaluate, tables.

Not a package users import: ``python experiments/mqar.py --scale cpu`` and its siblings put
this folder on ``sys.path`` themselves (and spawned workers inherit that path). Only torch,
tqdm, safetensors and tensorboard are needed (no ray, optuna or ``datasets``).

The grid's models are so small that one training leaves a GPU mostly idle (each step is
bound by kernel launches), so ``--jobs N`` trains N grid cells at once, each in its own
process. Prefill is timed afterwards, one run at a time, so that no other run shares the
device while it is measured. Ctrl-C, or SIGTERM to the script (what ``kill`` and job
schedulers send), reaches every run in flight: each saves a checkpoint, and the same
command resumes them.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import multiprocessing
import os
import signal
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, Executor, Future, ProcessPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

import nats.trainers.loop as loop
from nats import NatsConfig, NatsForCausalLM
from nats.atomic_write import atomic_write_bytes
from nats.evaluation import prefill_seconds, run_eval
from nats.trainers import TrainConfig, resolve_device, train
from nats.trainers.config import ARCHITECTURES, with_architecture
from nats.trainers.sources import LoadedModel, load_model

PREFILL_LEN = 4096
"""Batch-1 prefill timed on a GPU (CPU timings would say nothing about the kernels)."""
TEST_EVAL_SEED = 1001
"""Data stream of the test slices; runs are validated (and learning rates chosen) on their
training config's ``eval_seed`` stream, a different one."""
RECIPES = ("official", "softmax", "linear")
ARCH_CHOICES = (*ARCHITECTURES,
                *(f"{a}:{r}" for r in RECIPES for a in ("natsl", "natsl-all")),
                "layer-hybrid:4")
"""Grid rows: an architecture (``nats train --arch``), or a NAtS-L one with a recipe:
``:official``, its NAtS-L layers trained with the official layer's recipe
(``NatsConfig.official_recipe``) instead of the defaults; ``:softmax`` / ``:linear``, every
route of its NAtS-L layers forced to that side in training and evaluation (what the layer
does without its router); ``layer-hybrid:4``, softmax in every 4th layer instead of every
2nd (a quarter of the layers: the layer hybrid at NAtS-L's default budget)."""


def recall_model(scale: dict[str, Any]) -> NatsConfig:
    """The 2-layer model of the recall experiments (``mqar.py``, ``recall.py``) at a scale."""
    return NatsConfig(vocab_size=scale["vocab"], d_model=scale["d_model"], n_layers=2,
                      n_heads=2, softmax_heads_per_head=2, head_dim_k=scale["head_dim"],
                      head_dim_v=scale["head_dim"], chunk_size=scale["chunk"],
                      layer_types=("nats", "nats"), rope=True)


def parse_args(description: str, scales: dict[str, dict[str, Any]],
               ) -> tuple[argparse.Namespace, dict[str, Any]]:
    """The command line, and the chosen scale's settings (its ``minutes`` is the default
    time budget)."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--scale", choices=list(scales), default="cpu",
                   help="cpu: reduced, minutes on a CPU; the gpu scales run on one GPU, gpu "
                        "at the issue's size in < 1 h (every scale's sizes: the script's "
                        "SCALES)")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    p.add_argument("--max-minutes", type=float, default=None,
                   help="stop starting new runs after this long (default: the scale's)")
    p.add_argument("--archs", nargs="+", choices=ARCH_CHOICES, default=list(ARCHITECTURES))
    p.add_argument("--out", type=Path, default=None, help="results folder")
    p.add_argument("--router-lr-scale", type=float, default=None,
                   help="the scorers' lr as a multiple of the lr (default: the trainer's); "
                        "use a fresh --out, the run names do not say it (the same as --set "
                        "router_lr_scale=X)")
    p.add_argument("--set", dest="settings", nargs="+", type=_setting, default=[],
                   metavar="FIELD=VALUE",
                   help="a TrainConfig or NatsConfig field of every run, the value as JSON "
                        "(budget_anneal=0.5, branch_norm=\"linear\", layer_types=[\"nats\", "
                        "\"linear\"]: over the row's architecture); use a fresh --out")
    p.add_argument("--seeds", nargs="+", type=int, default=None,
                   help="seeds to train (default: the scale's)")
    p.add_argument("--lrs", nargs="+", type=float, default=None,
                   help="learning rates to train (default: the scale's)")
    p.add_argument("--steps", type=_positive_int, default=None,
                   help="training steps of every run (default: the scale's); use a fresh "
                        "--out, the run names do not say it")
    p.add_argument("--no-prefill", action="store_true",
                   help="do not time prefill after training (its column says 'not timed')")
    p.add_argument("--jobs", type=_positive_int, default=1,
                   help="grid cells trained at once, each in its own process (one run of "
                        "these tiny models leaves a GPU mostly idle)")
    args = p.parse_args()
    scale = scales[args.scale]
    overrides = {"seeds": args.seeds and tuple(args.seeds), "lrs": args.lrs and tuple(args.lrs),
                 "steps": args.steps}
    scale = {**scale, **{k: v for k, v in overrides.items() if v}}
    if args.router_lr_scale is not None:
        args.settings.append(("router_lr_scale", args.router_lr_scale))
    if args.max_minutes is None:
        args.max_minutes = scale["minutes"]
    return args, scale


def _setting(text: str) -> tuple[str, Any]:
    name, sep, value = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"must be FIELD=VALUE, got {text!r}")
    try:
        return name, json.loads(value)
    except json.JSONDecodeError:
        return name, value  # a bare word: a string


def with_settings(config: TrainConfig, settings: dict[str, Any]) -> TrainConfig:
    """``config`` with each named field set on itself or, failing that, on its model."""
    train_fields = {f.name for f in dataclasses.fields(TrainConfig)}
    model_fields = {f.name for f in dataclasses.fields(NatsConfig)}
    unknown = set(settings) - train_fields - model_fields
    if unknown:
        raise ValueError(f"--set: {sorted(unknown)} are not TrainConfig or NatsConfig fields")
    model = {k: v for k, v in settings.items() if k not in train_fields}
    train_changes = {k: v for k, v in settings.items() if k in train_fields}
    return config.replace(model=config.model.replace(**model), **train_changes)


def _positive_int(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}")
    return int(text)


@dataclass
class Budget:
    """Runs start only while time is left; the ones that could not are recorded as skipped."""

    minutes: float
    start: float = 0.0

    def __post_init__(self) -> None:
        self.start = time.monotonic()

    def left(self) -> bool:
        return time.monotonic() - self.start < 60 * self.minutes


def train_and_eval(config: TrainConfig, arch: str, settings: dict[str, Any],
                   slices: Sequence[TrainConfig], eval_batches: int, device: torch.device,
                   out: Path, console: Path | None = None) -> dict[str, Any]:
    """Train ``config`` with grid row ``arch``'s mixers and then ``settings``
    (:func:`with_settings`: they win over the row, so ``layer_types`` can name a mix no row
    does), evaluate it on ``slices`` and write the report to ``out`` (no prefill:
    :func:`add_prefill` times it alone). With ``console``, the run's terminal output goes
    to that file (progress bars of parallel runs would overwrite each other).

    A run folder left by an interrupted call is resumed from its newest checkpoint (the
    training time then counts this call's part only). A run interrupted now (Ctrl-C: the
    trainer saves a checkpoint and returns) writes no report, so the next call resumes it
    instead of reading back a half-trained model.
    """
    with _console_to(console), routes_forced(arch.partition(":")[2]):
        config = with_settings(with_row(config, arch), settings).replace(device=str(device))
        started = time.monotonic()
        result = train_to_end(config)
        train_seconds = time.monotonic() - started
        loaded = LoadedModel(result.model.eval(), config, f"run {config.out_dir}")
        show = console is None
        validation = run_eval(loaded, [config], eval_batches, device, show_progress=show)
        slices = [s.replace(model=config.model, eval_seed=TEST_EVAL_SEED) for s in slices]
        report = run_eval(loaded, slices, eval_batches, device, show_progress=show)
    report.update(arch=arch, lr=config.lr, seed=config.seed, steps=result.step,
                  validation_loss=validation["slices"][0]["loss"],
                  train_seconds=train_seconds,
                  final_train_loss=result.train_losses[-1] if result.train_losses else None)
    _write_report(out, report)
    return report


def train_to_end(config: TrainConfig) -> loop.TrainResult:
    """Train ``config``, resuming its folder from the newest checkpoint an earlier call left;
    an interruption (Ctrl-C: the trainer checkpoints and returns) raises
    ``KeyboardInterrupt``, so that no caller reports a half-trained model."""
    result = train(config, resume=True)
    if result.interrupted:
        raise KeyboardInterrupt(f"{config.out_dir} interrupted at step {result.step}; the "
                                "same command resumes it")
    return result


ROW_METRICS_FILE = "eval_metrics.json"
"""A finished row's final evaluation and the config it ran, in its run folder
(:func:`train_row`)."""


def train_row(config: TrainConfig) -> dict[str, float]:
    """The final evaluation metrics of ``config``'s run: read back from its folder when an
    earlier call finished it, else trained (resumed where an earlier call was cut short), so
    that rerunning a script goes on where it stopped instead of being refused. A folder
    holding another config's row is refused: its numbers are not this row's."""
    done = Path(config.out_dir) / ROW_METRICS_FILE
    if done.is_file():
        saved = json.loads(done.read_text())
        if saved.get("config") != config.to_dict():
            raise ValueError(f"{done.parent} holds a row of another config (other options "
                             "or scale): give another --out, or remove the folder")
        return saved["metrics"]
    result = train_to_end(config)
    metrics = result.eval_metrics
    if not metrics:  # finished by an earlier call that stopped before writing them
        loaded = LoadedModel(result.model.eval(), config, f"run {config.out_dir}")
        report = run_eval(loaded, [config], config.eval_batches,
                          next(result.model.parameters()).device, show_progress=False)
        metrics = report["slices"][0]["metrics"]
    atomic_write_bytes(done, (json.dumps({"config": config.to_dict(), "metrics": metrics},
                                         indent=1) + "\n").encode())
    return metrics


def with_row(config: TrainConfig, arch: str) -> TrainConfig:
    """``config`` with grid row ``arch``'s mixers (and recipe, see ``ARCH_CHOICES``)."""
    name, _, recipe = arch.partition(":")
    config = with_architecture(config, name, int(recipe) if recipe.isdigit() else 2)
    return config.replace(model=config.model.official_recipe()) if recipe == "official" \
        else config


@contextlib.contextmanager
def routes_forced(side: str) -> Iterator[None]:
    """While open, the trainer forces every NAtS-L route to ``side`` (``"softmax"`` or
    ``"linear"``; anything else forces nothing) before every step, so also in evaluation."""
    if side not in ("softmax", "linear"):
        yield
        return
    original = loop.set_exploration

    def set_exploration(model: NatsForCausalLM, noise: float) -> None:
        original(model, noise)
        model.set_route_override(side)

    loop.set_exploration = set_exploration
    try:
        yield
    finally:
        loop.set_exploration = original


@contextlib.contextmanager
def _console_to(path: Path | None) -> Iterator[None]:
    if path is None:
        yield
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    # Appended: a resumed run's log keeps what the interrupted call wrote.
    with path.open("a") as f, contextlib.redirect_stdout(f), contextlib.redirect_stderr(f):
        yield


def _write_report(path: Path, report: dict[str, Any]) -> None:
    atomic_write_bytes(path, (json.dumps(report, indent=2) + "\n").encode())


def add_prefill(report: dict[str, Any], run_dir: Path, first_slice: TrainConfig,
                device: torch.device) -> None:
    """Time the batch-1 prefill of the run's final model (``run_dir/model``, safetensors)
    on ``first_slice``'s data, as ``nats eval`` would, into ``report["prefill"]``."""
    model = load_model(run_dir, device).model
    seconds = prefill_seconds(model, first_slice.replace(model=model.config), PREFILL_LEN,
                              device)
    report["prefill"] = [{"seq_len": PREFILL_LEN, "batch_size": 1, "seconds": seconds}]


class _InProcess(Executor):
    """``--jobs 1``: each run in this process when submitted, so the grid has one code path
    and no process start-up cost."""

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future:
        future: Future = Future()
        try:
            future.set_result(fn(*args, **kwargs))
        except (Exception, KeyboardInterrupt) as e:  # surfaces through future.result(),
            future.set_exception(e)                  # as from a worker
        return future


def _worker_setup(threads: int) -> None:
    """N processes on the CPU must not each start one thread per core. SIGTERM and SIGINT
    are ignored outside training (the trainer catches them while it trains): a worker that
    died while evaluating or idle would break the pool and lose the other runs' results."""
    torch.set_num_threads(threads)
    for sig in _GridStop.SIGNALS:
        signal.signal(sig, signal.SIG_IGN)


class _GridStop(loop.StopRequest):
    """While installed, the first SIGTERM or SIGINT to this process stops the grid starting
    runs; SIGTERM is also passed on to the worker processes (Ctrl-C in a terminal reaches
    them itself), so each run finishes its step and saves a checkpoint. Without it the
    workers, untouched by their parent's death, trained on unseen and kept their run
    folders locked against the command that would resume them."""

    MESSAGE = "no new runs start; the runs in flight save a checkpoint"

    def _handle(self, signum: int, frame: Any) -> None:
        super()._handle(signum, frame)
        if signum == signal.SIGTERM:
            for child in multiprocessing.active_children():
                os.kill(child.pid, signal.SIGTERM)


def _executor(jobs: int) -> Executor:
    if jobs == 1:
        return _InProcess()
    return ProcessPoolExecutor(  # spawn: a forked process cannot use CUDA
        jobs, mp_context=multiprocessing.get_context("spawn"), initializer=_worker_setup,
        initargs=(max(1, torch.get_num_threads() // jobs),))


def run_grid(name: str, args: argparse.Namespace, base: TrainConfig, lrs: Sequence[float],
             seeds: Sequence[int], slices: Sequence[TrainConfig], eval_batches: int,
             ) -> list[dict[str, Any]]:
    """Every architecture x learning rate x seed, in that order of priority under the budget
    (all architectures at the first seed before any second seed), ``args.jobs`` at a time.
    Each run is scored on its training distribution's validation stream (``eval_seed``),
    which picks the learning rate, and tested on ``slices`` drawn from a separate stream
    (``TEST_EVAL_SEED``), so the tables never report data the choice was made on.
    A run starts only while the budget lasts; runs in flight finish. A run whose JSON report
    is already in the folder is read back, not trained again, so the same command with more
    ``--max-minutes`` finishes a grid the budget cut short. On CUDA, the prefill of every
    report that lacks it is then timed alone. Returns the reports, in grid order."""
    device = resolve_device(args.device)
    out = args.out or Path("runs/experiments") / f"{name}-{args.scale}"
    out.mkdir(parents=True, exist_ok=True)
    settings = dict(args.settings)
    with_settings(base, settings)  # an unknown field fails here, before any run starts
    budget = Budget(args.max_minutes)
    cells = [(f"{arch.replace(':', '_')}-lr{lr:g}-seed{seed}", arch, lr, seed)
             for seed in seeds for arch in args.archs for lr in lrs]
    reports: dict[str, dict[str, Any]] = {}
    skipped: list[str] = []
    diverged: dict[str, str] = {}
    running: dict[Future, str] = {}
    interrupted: list[str] = []
    with _GridStop().installed() as stop, _executor(args.jobs) as pool, \
            tqdm(total=len(cells), desc=name, unit="run") as bar:

        def collect(finished: set[Future]) -> None:
            for future in finished:
                tag = running.pop(future)
                bar.update(1)
                try:
                    reports[tag] = future.result()
                except KeyboardInterrupt as e:  # checkpointed: the others still finish
                    interrupted.append(f"{tag} ({e})")
                except ValueError as e:  # one diverging lr must not cost the whole table
                    if not str(e).startswith("training diverged"):
                        raise _failed(name, tag, e, out, args.jobs) from e
                    diverged[tag] = f"{tag} ({e})"
                except Exception as e:
                    raise _failed(name, tag, e, out, args.jobs) from e

        for tag, arch, lr, seed in cells:
            done = out / f"{tag}.json"
            if done.is_file():  # finished by an earlier call: a cut-short grid goes on
                reports[tag] = json.loads(done.read_text())
                bar.update(1)
                continue
            while len(running) >= args.jobs:
                collect(wait(running, return_when=FIRST_COMPLETED).done)
            if stop.requested or interrupted:
                break
            if not budget.left():
                skipped.append(tag)
                bar.update(1)
                continue
            run = base.replace(lr=lr, seed=seed, out_dir=str(out / "runs" / tag))
            console = _console_log(out, tag) if args.jobs > 1 else None
            running[pool.submit(train_and_eval, run, arch, settings, slices, eval_batches,
                                device, done, console)] = tag
        collect(wait(running).done)
    if interrupted or stop.requested:
        raise SystemExit(f"{name}: interrupted, the same command resumes: "
                         + ("; ".join(interrupted) or "no run was in flight"))
    order = [tag for tag, *_ in cells]
    ordered = [reports[tag] for tag in order if tag in reports]
    if device.type == "cuda" and not args.no_prefill:
        # A report read back without its run folder (copied off another machine) keeps no
        # prefill: its table cell says n/a instead of the whole grid failing.
        for tag in tqdm([t for t in order if t in reports and not reports[t].get("prefill")
                         and (out / "runs" / tag).is_dir()], desc="prefill", unit="run"):
            add_prefill(reports[tag], out / "runs" / tag, slices[0], device)
            _write_report(out / f"{tag}.json", reports[tag])
    for tag in order:
        if tag in reports and "validation_loss" not in reports[tag]:
            raise ValueError(f"{out / tag}.json predates validation-based selection (no "
                             "validation_loss); delete it and its run folder to retrain")
    summary = {"experiment": name, "scale": args.scale, "device": str(device),
               "device_name": ordered[0]["device_name"] if ordered else None,
               "stdlib": ordered[0].get("stdlib") if ordered else None,
               "jobs": args.jobs, "minutes": (time.monotonic() - budget.start) / 60,
               "skipped": skipped, "diverged": [diverged[t] for t in order if t in diverged],
               "runs": [_brief(r) for r in ordered]}
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return ordered


def _console_log(out: Path, tag: str) -> Path:
    return out / "runs" / tag / "console.log"


def _failed(name: str, tag: str, error: Exception, out: Path, jobs: int) -> RuntimeError:
    """A run that failed other than by diverging stops the grid, naming the run."""
    where = f"; its output is in {_console_log(out, tag)}" if jobs > 1 else ""
    return RuntimeError(f"{name} run {tag} failed: {type(error).__name__}: {error}{where}")


def _brief(report: dict[str, Any]) -> dict[str, Any]:
    keep = ("arch", "lr", "seed", "steps", "train_seconds", "final_train_loss",
            "validation_loss", "parameters", "prefill")
    slices = [{k: s[k] for k in ("name", "length", "accuracy", "sequence_accuracy",
                                 "softmax_fraction", "cost", "tokens_per_second")}
              | ({"bits_per_byte": s["bits_per_byte"]} if "bits_per_byte" in s else {})
              for s in report["slices"]]
    return {**{k: report[k] for k in keep}, "slices": slices}


def best_per_seed(reports: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """Per architecture, the report of each seed at the learning rate of the lowest
    validation loss."""
    best: dict[tuple[str, int], dict[str, Any]] = {}
    for r in reports:
        key = (r["arch"], r["seed"])
        if key not in best or r["validation_loss"] < best[key]["validation_loss"]:
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
    missing = "n/a (CPU)" if str(report.get("device", "cpu")).startswith("cpu") else "not timed"
    cells.append(f"{1000 * prefill[0]['seconds']:.1f}" if prefill else missing)
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
    if summary.get("jobs", 1) > 1:
        ran += (f" Up to {summary['jobs']} runs trained at once on the device: training "
                "times and evaluation tokens/s were measured while they shared it (peak "
                "memory is per process; prefill was timed alone, after all training).")
    text = "\n".join([f"## {title}", "", table, "", *notes, "", ran, ""])
    (out / "table.md").write_text(text)
    print(text)


def run_rows_per_seed(run: Callable[[str, int, Path], dict[str, Any]], rows: Sequence[str],
                      seeds: Sequence[int], out: Path) -> None:
    """``run(row, seed, out)`` for every seed and row, in this process on one thread (as a
    search trial trains): a JSON line per run printed as it ends, all of them in
    ``out``/results.json."""
    torch.set_num_threads(1)
    results = []
    for seed in seeds:
        for row in rows:
            results.append(run(row, seed, out))
            print(json.dumps(results[-1]), flush=True)
    (out / "results.json").write_text(json.dumps(results, indent=1))
