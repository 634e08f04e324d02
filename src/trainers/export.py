"""``nats export``: a trained run's architecture (and weights) as a plain model folder.

The folder holds ``config.json`` (a :class:`NatsConfig`, with the layer-index lists
``softmax_layers`` / ``linear_layers`` / ``hybrid_layers`` that other codebases read),
``model.safetensors`` unless weights are left out, ``training.json`` (the run's
``TrainConfig`` holding the exported model: the task and data it was trained on, so that
retraining and ``nats eval`` do not fall back to another task) and ``README.md``: the layer
mix, chunk size, heads, the softmax fraction each NAtS-L layer measured on the run's
evaluation data, and where it came from. ``NatsForCausalLM.from_pretrained`` loads it.

With ``plain_layers``, a NAtS-L layer whose routes were all softmax (all linear) on that
data is exported as a plain softmax (plain linear: the config's ``linear_op``) layer. Such
a mixer cannot take the supernet's weights exactly (the NAtS-L layer has a branch mix, an
output gate and parameters a plain layer lacks, and an all-linear NAtS-L layer still
attends within its own chunk), so it is freshly initialised; every other tensor is
carried over.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from nats.atomic_write import atomic_write_bytes
from nats.config import LAYER_LISTS, NatsConfig
from nats.eval_mode import eval_mode
from nats.folder_lock import LOCK_FILE, writing_into
from nats.model import CONFIG_FILE, WEIGHTS_FILE, NatsForCausalLM
from nats.plotting import save_png
from nats.softmax_fraction import (
    ALL_LINEAR,
    ALL_SOFTMAX,
    LayerFraction,
    measure_softmax_fraction,
)

from .config import TRAIN_CONFIG_FILE
from .routing_maps import routing_figure
from .sources import TRAINING_FILE, load_model

README_FILE = "README.md"
ROUTING_MAP_FILE = "routing_map.png"
"""The routes of the first evaluation sequence, drawn when a NAtS-L layer was measured."""
EXPORT_FILES = (CONFIG_FILE, WEIGHTS_FILE, TRAINING_FILE, ROUTING_MAP_FILE, README_FILE)
"""Every file an export may write (the config and README always)."""
STAGING_PREFIX = ".nats-export-"
"""The folder an export is written into before it is moved into place."""
PLAIN_KIND = {ALL_SOFTMAX: "softmax", ALL_LINEAR: "linear"}
"""The plain layer type that a NAtS-L layer with these routes is exported as."""
_NAMES = {"nats": "NAtS-L (hybrid)", "softmax": "softmax attention"}

Batch = tuple[torch.Tensor, torch.Tensor]

if TYPE_CHECKING:
    from nats.trainers import TrainConfig


@dataclass(frozen=True)
class ExportResult:
    """What :func:`export_architecture` wrote."""

    out_dir: Path
    config: NatsConfig
    """The exported architecture (``config.json``)."""
    trained_layer_types: tuple[str, ...]
    """The layer types of the trained model (differ from ``config``'s where converted)."""
    fractions: dict[int, LayerFraction]
    """Measured routing of every NAtS-L layer of the trained model (empty: not measured)."""
    converted: dict[int, str]
    """Layers exported as plain layers: index -> new type ("softmax" or "linear")."""
    weights: Path | None
    """``model.safetensors``, or ``None`` with ``weights=False``."""
    training: Path | None
    """``training.json``, or ``None`` when the training run is unknown."""
    training_task: str | None
    readme: Path
    origin: str
    parameters: int
    dtype: str
    """Dtype of the weights, e.g. ``float32``."""
    eval_description: str
    carried: tuple[str, ...] = field(default=())
    """State-dict keys whose tensors are the trained ones."""
    fresh: tuple[str, ...] = field(default=())
    """State-dict keys freshly initialised (the mixers of converted layers)."""
    routing_map: Path | None = None
    """``routing_map.png``, or ``None`` when no NAtS-L layer was measured."""

    @property
    def files(self) -> list[Path]:
        out = [self.out_dir / CONFIG_FILE]
        return out + [p for p in (self.weights, self.training, self.routing_map) if p] + \
            [self.readme]


def _source_folders(path: Path) -> set[Path]:
    """The run folder, its ``model/`` and checkpoint folder, which an export must not
    overwrite: ``path`` is a run or model folder, or a checkpoint file in
    ``run/checkpoints/``."""
    if path.is_dir():
        run = path
    else:
        run = path.parent.parent if path.parent.name == "checkpoints" else path.parent
    return {p.resolve() for p in (run, run / "model", run / "checkpoints")}


# -- exporting -------------------------------------------------------------------------------


def plain_layer_types(layer_types: Sequence[str],
                      fractions: dict[int, LayerFraction]) -> dict[int, str]:
    """NAtS-L layers that routed every token one way: ``{index: "softmax" | "linear"}``."""
    return {i: PLAIN_KIND[f.kind] for i, f in sorted(fractions.items())
            if layer_types[i] == "nats" and f.kind in PLAIN_KIND}


def export_model(model: NatsForCausalLM, out_dir: str | os.PathLike, *,
                 eval_batches: Sequence[Batch | torch.Tensor] = (), weights: bool = True,
                 plain_layers: bool = False, force: bool = False,
                 origin: str = "an in-memory model", eval_description: str = "",
                 init_seed: int = 0, train_config: TrainConfig | None = None) -> ExportResult:
    """Write ``model``'s architecture (and weights) to ``out_dir``; see the module doc.

    ``eval_batches`` are measured as they are (a layer's ``route_override`` counts);
    with none, nothing is measured and ``plain_layers`` is refused. ``out_dir`` must be
    absent or empty unless ``force``, which replaces the files an export writes (and
    removes a stale ``model.safetensors`` when ``weights`` is off). Converted layers'
    mixers are initialised from ``init_seed`` (the global RNG is left untouched).
    ``train_config`` (the run that trained ``model``) is written as ``training.json``.
    """
    out = Path(out_dir)
    check_out_dir(out, force)
    if plain_layers and not eval_batches:
        raise ValueError("plain layers need measured routes: give at least one evaluation batch")
    fractions = measure_softmax_fraction(model, eval_batches) if eval_batches else {}
    trained = model.config
    converted = plain_layer_types(trained.layer_types, fractions) if plain_layers else {}
    config = trained.replace(layer_types=tuple(converted.get(i, t)
                                               for i, t in enumerate(trained.layer_types)))
    exported, carried, fresh = _carry_weights(model, config, converted, init_seed)
    result = ExportResult(
        out_dir=out, config=config, trained_layer_types=trained.layer_types,
        fractions=fractions, converted=converted,
        weights=out / WEIGHTS_FILE if weights else None,
        training=out / TRAINING_FILE if train_config is not None else None,
        training_task=train_config and train_config.task,
        readme=out / README_FILE, origin=origin,
        parameters=sum(p.numel() for p in exported.parameters()),
        dtype=str(exported.embed.weight.dtype).removeprefix("torch."),
        eval_description=eval_description or f"{len(eval_batches)} batch(es)",
        carried=carried, fresh=fresh, routing_map=None)
    with writing_into(out, "export folder"):  # a second export into it is refused
        check_out_dir(out, force)  # again, held: another export may have filled it
        return _write_export(out, exported, train_config, model,
                             eval_batches[0] if eval_batches else None, result, init_seed)


def _write_export(out: Path, exported: NatsForCausalLM, train_config: TrainConfig | None,
                  model: NatsForCausalLM, batch: Batch | torch.Tensor | None,
                  result: ExportResult, init_seed: int) -> ExportResult:
    """The export's files, written into a staging folder inside ``out`` (held) and moved in
    at the end, so an export cut short (Ctrl-C, a full disk) leaves no half model;
    ``result`` with its routing map. What an export killed outright left is cleared first."""
    for stale in out.glob(f"{STAGING_PREFIX}*"):
        shutil.rmtree(stale, ignore_errors=True)
    stage = out / f"{STAGING_PREFIX}{os.getpid()}-{secrets.token_hex(4)}"
    stage.mkdir()
    try:
        if result.weights is not None:
            exported.save_pretrained(stage)
        else:
            atomic_write_bytes(stage / CONFIG_FILE,
                               (json.dumps(result.config.to_dict(), indent=2) + "\n").encode())
        if train_config is not None:
            run = train_config.replace(model=result.config, init_from=None,
                                       out_dir=f"runs/{out.name}")
            atomic_write_bytes(stage / TRAINING_FILE,
                               (json.dumps(run.to_dict(), indent=2) + "\n").encode())
        if _draw_routes(model, batch, stage / ROUTING_MAP_FILE) is not None:
            result = replace(result, routing_map=out / ROUTING_MAP_FILE)
        atomic_write_bytes(stage / README_FILE, render_readme(result, init_seed).encode())
        _move_in(stage, out)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    return result


def _move_in(stage: Path, out: Path) -> None:
    """Put the staged export in place, file by file, removing the export files this one
    does not write (weights of another export, its task, its map). An earlier export's
    config goes first and the new one comes last: a config never sits beside another
    export's weights, so a kill part-way leaves a folder that is not read as a model
    (the next ``--force`` export fills it) rather than a mismatched one."""
    (out / CONFIG_FILE).unlink(missing_ok=True)
    for name in sorted(EXPORT_FILES, key=lambda n: n == CONFIG_FILE):
        if (stage / name).exists():
            os.replace(stage / name, out / name)
        else:
            (out / name).unlink(missing_ok=True)


def _draw_routes(model: NatsForCausalLM, batch: Batch | torch.Tensor | None,
                 path: Path) -> Path | None:
    """Draw the trained model's routes of ``batch``'s first sequence to ``path`` (the
    picture of what it learned to keep in the KV cache); without a NAtS-L layer or a batch,
    nothing (``_move_in`` then removes an earlier export's picture)."""
    if batch is None or "nats" not in model.config.layer_types:
        return None
    ids = (batch[0] if isinstance(batch, (tuple, list)) else batch)[:1]
    with eval_mode(model), torch.no_grad():
        routes = model(ids.to(next(model.parameters()).device)).routes
    figure = routing_figure([r.cpu() if r is not None else None for r in routes],
                            model.config.layer_types, model.config.chunk_size, ids.shape[1],
                            title=f"routes of the first evaluation sequence ({ids.shape[1]} "
                                  "tokens)")
    return save_png(figure, path)


def export_architecture(source: str | os.PathLike, out_dir: str | os.PathLike, *,
                        weights: bool = True, plain_layers: bool = False,
                        eval_batches: int | None = None, device: str = "cpu",
                        force: bool = False, init_seed: int = 0) -> ExportResult:
    """Export a run folder, a checkpoint file or an export (see
    :func:`~nats.trainers.sources.load_model`) to ``out_dir``.

    The softmax fractions are measured on the run's first ``eval_batches`` fixed
    evaluation batches (default: as many as the run evaluated on; 0: no measurement)
    on ``device`` ("cpu", "cuda", "auto", ...); the files are written from the CPU.
    """
    from nats.trainers import build_batches, resolve_device

    if eval_batches is not None and (isinstance(eval_batches, bool)
                                     or not isinstance(eval_batches, int) or eval_batches < 0):
        raise ValueError(f"eval_batches must be an integer >= 0, got {eval_batches!r}")
    if plain_layers and eval_batches == 0:
        raise ValueError("plain layers need measured routes: --eval-batches must be >= 1")
    out = Path(out_dir)
    if Path(source).exists() and out.resolve() in _source_folders(Path(source)):
        raise ValueError(f"--out {out} is the run being exported; choose another folder")
    check_out_dir(out, force)
    loaded = load_model(source, resolve_device(device))
    tc = loaded.train_config
    if tc is None:
        raise ValueError(f"{source} holds no record of its training run ({TRAINING_FILE}, or a "
                         f"run's {TRAIN_CONFIG_FILE}): export its run folder or checkpoint")
    count = tc.eval_batches if eval_batches is None else eval_batches
    batches = build_batches(tc).eval(count) if count else []
    described = (f"the run's first {count} evaluation batch(es) of {tc.batch_size} x "
                 f"{tc.seq_len} tokens (task {tc.task!r})") if count else ""
    return export_model(loaded.model, out, eval_batches=batches, weights=weights,
                        plain_layers=plain_layers, force=force, origin=loaded.origin,
                        eval_description=described, init_seed=init_seed, train_config=tc)


def check_out_dir(out: Path, force: bool) -> None:
    """``out`` may be absent or an empty folder; a non-empty one only with ``force``."""
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"--out {out} is a file, not a folder")
    if (out.is_dir() and any(not (p.name.startswith(STAGING_PREFIX) or p.name == LOCK_FILE)
                             for p in out.iterdir()) and not force):
        raise FileExistsError(f"--out {out} is not empty; choose another folder, or pass "
                              "--force to replace the exported files in it")


def _carry_weights(model: NatsForCausalLM, config: NatsConfig, converted: dict[int, str],
                   init_seed: int) -> tuple[NatsForCausalLM, tuple[str, ...], tuple[str, ...]]:
    """A CPU model of ``config`` holding ``model``'s tensors, except the converted layers'
    mixers, which keep their seeded fresh initialisation."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(init_seed)
        exported = NatsForCausalLM(config)
    exported = exported.to(model.embed.weight.dtype)
    source = model.state_dict()
    fresh_prefixes = tuple(f"blocks.{i}.mixer." for i in converted)
    state, carried, fresh = {}, [], []
    for name, tensor in exported.state_dict().items():
        if name.startswith(fresh_prefixes):
            fresh.append(name)
            continue
        if name not in source or source[name].shape != tensor.shape:
            raise ValueError(f"cannot carry {name} over: the trained model's tensor differs")
        state[name] = source[name]
        carried.append(name)
    exported.load_state_dict(state, strict=False)
    return exported.eval(), tuple(carried), tuple(fresh)


# -- README ----------------------------------------------------------------------------------


def retrain_command(result: ExportResult) -> str:
    """``nats train`` of the exported architecture: on the task and data it was trained on
    (``training.json``) where known, else on the preset's (``config.json``)."""
    if result.training is not None:
        return f"nats train --config {result.training} --out runs/{result.out_dir.name}"
    return f"nats train --config {result.out_dir / CONFIG_FILE}"


def _fmt(x: float) -> str:
    return f"{x:.3f}"


def render_readme(result: ExportResult, init_seed: int = 0) -> str:
    """The README of an export: architecture, layer table, provenance, how to use it."""
    cfg = result.config
    routed = "nats" in result.trained_layer_types
    title = "NAtS-L architecture export" if "nats" in cfg.layer_types else "Architecture export"
    lines = [f"# {title}: {cfg.n_layers} layers", "",
             f"Exported by `nats export` from {result.origin}.", ""]
    names = {**_NAMES, "linear": f"{cfg.linear_op_name} (linear)"}
    mix = "; ".join(f"{names[kind]} {list(cfg.layers_of(kind))}"
                    for kind in ("nats", "softmax", "linear") if cfg.layers_of(kind))
    r = cfg.softmax_heads_per_head
    weights = (f"`{WEIGHTS_FILE}` ({result.dtype}), the trained tensors"
               + (" except the freshly initialised mixers below" if result.converted else "")
               if result.weights else "not exported (`--no-weights`): train from scratch")
    lines += ["## Architecture", "", "| | |", "|---|---|",
              f"| layers | {cfg.n_layers}: {mix} |",
              f"| d_model | {cfg.d_model} |",
              f"| vocabulary | {cfg.vocab_size} tokens |",
              f"| heads | {cfg.n_heads} routing heads per layer; each owns 1 linear head "
              f"(d_k {cfg.head_dim_k}, d_v {cfg.head_dim_v}) and {r} softmax heads "
              f"(d_k {cfg.softmax_head_dim_k}, d_v {cfg.softmax_head_dim_v}); a softmax layer "
              f"has {cfg.n_heads * r} heads of that width |",
              f"| chunk size | {cfg.chunk_size} tokens (one route per chunk and routing head) |",
              f"| MLP | SwiGLU, hidden {cfg.mlp_hidden} |",
              f"| positions | {f'RoPE (theta {cfg.rope_theta:g})' if cfg.rope else 'none'} "
              "in the softmax heads |",
              f"| embeddings | {'tied to' if cfg.tie_embeddings else 'separate from'} "
              "the output layer |",
              f"| parameters | {result.parameters:,} |",
              f"| weights | {weights} |", ""]
    lines += ["## Layers", ""]
    if not routed:
        lines += ["No layer routes: every layer is a plain softmax or linear layer.", ""]
    elif result.fractions:
        lines += ["Softmax fraction: the share of tokens in chunks routed to softmax attention "
                  "(kept in the KV cache), per routing head and over all heads, measured in "
                  f"eval mode on {result.eval_description}. Routes: whether every chunk went "
                  "one way on that data.", ""]
    else:
        lines += ["Softmax fractions were not measured (no evaluation batches).", ""]
    if result.routing_map is not None:
        lines += [f"`{ROUTING_MAP_FILE}`: the routes of the first of those sequences, chunk by "
                  "chunk and head by head.", ""]
    lines += ["| layer | trained as | exported as | softmax fraction per head | mean | routes |",
              "|---|---|---|---|---|---|"]
    for i, trained in enumerate(result.trained_layer_types):
        f = result.fractions.get(i)
        if f is not None:
            heads, mean, kind = ", ".join(_fmt(x) for x in f.per_head), _fmt(f.overall), f.kind
        elif trained == "nats":
            heads, mean, kind = "not measured", "", ""
        else:
            fixed = 1.0 if trained == "softmax" else 0.0
            heads, mean, kind = "(no routes)", _fmt(fixed), "fixed"
        lines.append(f"| {i} | {trained} | {cfg.layer_types[i]} | {heads} | {mean} | {kind} |")
    lines.append("")
    if result.converted:
        plain = {"softmax": ("softmax attention", "softmax"),
                 "linear": ("linear attention", cfg.linear_op_name)}
        listed = "; ".join(f"layer {i} routed every chunk to {plain[t][0]} and is exported as "
                           f"a plain {plain[t][1]} layer" for i, t in result.converted.items())
        lines += ["## Plain layers", "",
                  f"On the evaluation data, {listed}. **Their mixers are freshly initialised** "
                  f"(seed {init_seed}), not trained: a NAtS-L layer's short convolutions, "
                  "branch mix and output gate have no counterpart in a plain layer, and an "
                  "all-linear NAtS-L layer still attends within its own chunk, so its weights "
                  "cannot be carried over exactly. Every other tensor (embeddings, norms, "
                  "MLPs and the other layers) is the trained one. Train or fine-tune this "
                  "model before using it.", ""]
    lists = ", ".join(f'`"{key}": {list(cfg.layers_of(kind))}`'
                      for key, kind in LAYER_LISTS.items())
    lines += ["## Use", "",
              f"`{CONFIG_FILE}` is a `NatsConfig`. Beside `layer_types` it lists the layers "
              f"plainly for other codebases: {lists} (softmax attention, {cfg.linear_op_name}, "
              "NAtS-L).", "",
              "```python", "from nats import NatsForCausalLM", "",
              f'model = NatsForCausalLM.from_pretrained("{result.out_dir}")', "```", "",
              "```bash"]
    train = retrain_command(result)
    commands = [(train, "this architecture, from scratch")]
    if result.weights:
        commands.append((f"{train} --init-from {result.out_dir}", "from these weights"))
    width = max(len(c) for c, _ in commands)
    lines += [f"{c:<{width}}  # {why}" for c, why in commands] + ["```", ""]
    if result.training is None:
        lines += ["The training run is unknown: the commands above train on the preset's "
                  "task (`--preset`, `--task` and the data options choose another).", ""]
    else:
        lines += [f"`{TRAINING_FILE}` is the run this model was trained in: task "
                  f"{result.training_task!r}, its data and optimiser settings, with this "
                  f"architecture. To train the architecture on another task, give "
                  f"`--config {result.out_dir / CONFIG_FILE}` (the model alone) with a "
                  "`--preset` or `--task`.", ""]
    return "\n".join(lines)

