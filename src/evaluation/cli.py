"""``nats eval``: the options and what they run (the parser lives in :mod:`nats.cli`)."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

DEFAULT_BATCHES = 4


def add_eval_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add ``eval`` to the ``nats`` sub-commands."""
    from nats.trainers import TASKS, MQARTask, NeedleTask

    p = sub.add_parser(
        "eval", help="evaluate a run, checkpoint or exported model on task slices",
        description="Accuracy (or bits per byte), softmax fraction per layer, tokens/s, peak "
                    "memory and cost per slice; every combination of the knob values given "
                    "is a slice. Lengths other than the training length are labelled so.")
    p.add_argument("source", metavar="CHECKPOINT_OR_EXPORT_DIR",
                   help="a run folder, a checkpoint file or a saved/exported model folder")
    p.add_argument("--task", choices=TASKS, help="default: the run's task (mqar without one)")
    p.add_argument("--seq-len", type=int, nargs="+", metavar="T",
                   help="evaluation lengths (default: the training length)")
    p.add_argument("--pairs", type=int, nargs="+", metavar="P",
                   help="mqar: key-value pairs, one value or one per --seq-len")
    # Each knob also takes the spelling `nats train` gives it (--mqar-placement, ...).
    p.add_argument("--placement", "--mqar-placement", dest="placement", nargs="+",
                   choices=MQARTask.PLACEMENTS)
    p.add_argument("--filler", "--mqar-filler", dest="filler", nargs="+",
                   choices=MQARTask.FILLERS)
    p.add_argument("--queries", "--mqar-queries", dest="queries", nargs="+",
                   choices=MQARTask.QUERIES)
    p.add_argument("--distractors", "--needle-distractors", dest="distractors", type=int,
                   nargs="+", help="needle: distractor needles")
    p.add_argument("--haystack", "--needle-haystack", dest="haystack", nargs="+",
                   choices=NeedleTask.HAYSTACKS)
    p.add_argument("--batches", type=int, default=DEFAULT_BATCHES,
                   help=f"evaluation batches per slice (default {DEFAULT_BATCHES})")
    p.add_argument("--batch-size", type=int, help="default: the run's batch size")
    p.add_argument("--eval-seed", type=int, metavar="SEED",
                   help="the stream of generated rows to evaluate on (and calibrate on, a "
                        "stream apart): default the run's own eval_seed, the rows it was "
                        "validated on; the experiments' test slices use 1001. Text windows "
                        "are the corpus's held-out split whatever the seed")
    p.add_argument("--train-seq-len", type=int,
                   help="training length of an exported model (runs know their own)")
    p.add_argument("--prefill", type=int, nargs="+", default=[], metavar="T",
                   help="also time a batch-1 prefill of T tokens")
    p.add_argument("--calibrate-budget", type=float, nargs="+", metavar="FRACTION",
                   help="first set each budgeted NAtS-L layer's routing bias so that it sends "
                        "FRACTION of the first slice's routable chunks to softmax (one in "
                        "(0, 1) for every layer, or one in [0, 1] per layer: '1 0' keeps "
                        "the first layer's chunks all in softmax, the second's in linear; on "
                        "--batches batches that evaluation does not read, one pass per "
                        "layer); the budget held in training is a share of the training "
                        "data, not of this workload")
    p.add_argument("--calibrate-scope", choices=("layer", "model", "head"),
                   help="with --calibrate-budget: 'layer' (default) gives every layer "
                        "FRACTION; 'model' gives the layers FRACTION on average, split where "
                        "it lowers the loss on the calibration batches (a search of a few "
                        "passes per move between two layers); 'head' splits it the same way "
                        "among every layer's heads")
    p.add_argument("--share-price", type=float, default=0.0, metavar="NATS",
                   help="with --calibrate-scope model or head: what a unit of model-wide "
                        "share must buy in loss (nats per token); the split then gives "
                        "back the share whose routes buy less, down to the least "
                        "loss + NATS * share along the way (default 0: only share whose "
                        "routes do not lower the loss)")
    p.add_argument("--save-model", type=Path, metavar="DIR",
                   help="with --calibrate-budget: also save the calibrated model to DIR (a "
                        "new or empty folder)")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    p.add_argument("--out", type=Path, default=Path("eval.json"),
                   help="JSON file of every result (default eval.json)")
    p.set_defaults(func=eval_command)
    return p


def eval_command(args: argparse.Namespace) -> int:
    from nats.config import nonnegative_finite
    from nats.trainers import TrainConfig, build_batches, resolve_device
    from nats.trainers.route_control import (
        calibrate_budget,
        kept_on_path,
        split_budget,
        swaps_end,
    )
    from nats.trainers.sources import load_model

    from .harness import check_eval_arguments, run_eval, summary_lines
    from .slices import slice_configs, slice_name

    check_eval_arguments(args.batches, args.prefill, args.out)

    for name, least in (("batch_size", 1), ("train_seq_len", 1), ("eval_seed", 0)):
        value = getattr(args, name)
        if value is not None and value < least:
            raise ValueError(f"--{name.replace('_', '-')} must be >= {least}, got {value}")
    fractions = args.calibrate_budget
    if fractions is not None and len(fractions) == 1 and not 0 < fractions[0] < 1:
        raise ValueError(f"--calibrate-budget must lie in (0, 1), got {fractions[0]:g}")
    if fractions is not None and any(not 0 <= f <= 1 for f in fractions):
        raise ValueError("--calibrate-budget: one fraction per layer must lie in [0, 1], got "
                         + " ".join(f"{f:g}" for f in fractions))
    if args.calibrate_scope is not None and fractions is None:
        raise ValueError("--calibrate-scope says how to calibrate: give --calibrate-budget")
    if args.calibrate_scope in ("model", "head") and fractions is not None \
            and len(fractions) > 1:
        raise ValueError(f"--calibrate-scope {args.calibrate_scope} splits one fraction: "
                         "give one")
    if not nonnegative_finite(args.share_price):
        raise ValueError(f"--share-price must be a number >= 0, got {args.share_price:g}")
    if args.share_price != 0.0 and args.calibrate_scope not in ("model", "head"):
        raise ValueError("--share-price prices a split: give --calibrate-scope model or head")
    if args.save_model is not None:
        if args.calibrate_budget is None:
            raise ValueError("--save-model saves a calibrated model: give --calibrate-budget")
        if args.save_model.exists() and (not args.save_model.is_dir()
                                         or any(args.save_model.iterdir())):
            raise ValueError(f"--save-model {args.save_model} exists and is not an empty "
                             "folder")
    device = resolve_device(args.device)
    loaded = load_model(args.source, device)
    task = args.task or (loaded.train_config.task if loaded.train_config else "mqar")
    seq_lens = args.seq_len or [args.train_seq_len or (
        loaded.train_config.seq_len if loaded.train_config else TrainConfig.seq_len)]
    base = loaded.train_config or TrainConfig(  # an exported model: the task's defaults
        model=loaded.model.config, task=task, seq_len=seq_lens[0], device=args.device,
        **({"mqar_pairs": args.pairs[0]} if args.pairs else {}))
    if args.eval_seed is not None:
        base = base.replace(eval_seed=args.eval_seed)
    knobs = {"mqar_placement": args.placement, "mqar_filler": args.filler,
             "mqar_queries": args.queries, "needle_distractors": args.distractors,
             "needle_haystack": args.haystack}
    slices = slice_configs(base, task, seq_lens, args.pairs or (), args.batch_size, knobs)
    if loaded.train_config is None and args.task is None:
        print(f"nats: warning: the task {loaded.origin} was trained on is unknown; evaluating "
              "on 'mqar' (choose with --task)", file=sys.stderr)
    if args.calibrate_budget is not None:
        batches = [(ids.to(device), labels.to(device))
                   for ids, labels in build_batches(slices[0]).calibration(args.batches)]
        if args.calibrate_scope in ("model", "head"):
            print(f"nats: splitting {fractions[0]:g} among the "
                  f"{'heads' if args.calibrate_scope == 'head' else 'layers'} by the loss on "
                  f"{len(batches)} batches (a loss pass per split tried)", flush=True)
        path: list[tuple[list[float], float]] = []
        try:
            layers = (split_budget(loaded.model, batches, fractions[0],
                                   unit="head" if args.calibrate_scope == "head" else "layer",
                                   price=args.share_price, progress=True,
                                   on_split=lambda shares, loss: path.append((shares, loss)))
                      if args.calibrate_scope in ("model", "head") else
                      calibrate_budget(loaded.model, [ids for ids, _ in batches],
                                       fractions[0] if len(fractions) == 1 else fractions))
        except ValueError as error:  # what the model or the slice cannot calibrate
            raise ValueError(f"--calibrate-budget: {error}") from None
        if path:  # a split: it may have given share back
            kept, loss = path[kept_on_path(path, args.share_price)]
            mean, whole = sum(kept) / len(kept), path[swaps_end(path)][1]
            print(f"nats: the split of {fractions[0]:g} has loss {whole:.4g} on the "
                  f"calibration batches; it kept {mean:.4g}, loss {loss:.4g} (--share-price "
                  f"{args.share_price:g})")
            where = (f"{mean:.4g} on average over the "
                     f"{'heads' if args.calibrate_scope == 'head' else 'layers'} (a split of "
                     f"{fractions[0]:g} at share price {args.share_price:g})")
        else:
            where = " ".join(f"{f:g}" for f in fractions) + (" per layer" if len(fractions) > 1
                                                           else "")
        where += f" on {slice_name(slices[0])}"
        print(f"nats: calibrated the routing biases to {where}: " + ", ".join(
            f"layer {c.layer}{'' if c.head is None else f' head {c.head}'} bias {c.bias:.3f} "
            f"share {c.share:.3f}" for c in layers))
        if any(abs(c.share - c.target) > 0.05 for c in layers):
            print("nats: warning: tied routing scores (an untrained scorer?) keep a layer's "
                  "share away from the target", file=sys.stderr)
        loaded = dataclasses.replace(
            loaded, origin=f"{loaded.origin}, routing biases calibrated to {where}")
        if args.save_model is not None:
            loaded.model.save_pretrained(args.save_model)
            print(f"nats: saved the calibrated model to {args.save_model}")
    report = run_eval(loaded, slices, args.batches, device, args.train_seq_len, args.prefill,
                      args.out)
    print("\n".join(summary_lines(report)))
    print(f"nats: wrote {args.out}")
    return 0
