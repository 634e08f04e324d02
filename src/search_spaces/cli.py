"""``nats search``: the options and what they run (the parser lives in :mod:`nats.cli`)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from nats.folder_lock import exclusive

from .builtin import BUILTIN_SPACES, DEFAULT_BASE, DEFAULT_SPACE, SEARCH_BASES, search_base
from .objectives import COSTS, OBJECTIVES, QUALITY
from .search import (
    SAMPLERS,
    FitOutcome,
    SearchSettings,
    make_settings,
    plain_ray_console,
    resume_search,
    run_search,
)
from .spaces import load_space

DEFAULT_OUT = "runs/search"
EXIT_INTERRUPTED = 130


def add_search_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add ``search`` to the ``nats`` sub-commands."""
    from nats.trainers import PRESETS

    p = sub.add_parser(
        "search", help="search chunk sizes and layer mixes (Ray Tune + Optuna)",
        description="Without arguments: 8 trials of a small MQAR search on this machine's "
                    "CPU, 2 at a time, ending with the Pareto front and an exported "
                    "architecture. `nats search show DIR` reprints a search's results.")
    p.add_argument("action", nargs="?", choices=("run", "show"), default="run",
                   help="run (default) a search, or show the results of one in DIR")
    p.add_argument("dir", nargs="?", metavar="DIR", help="the search folder of `show`")
    p.add_argument("--list-spaces", action="store_true", help="list the built-in spaces")
    p.add_argument("--space", default=DEFAULT_SPACE, metavar="NAME_OR_YAML",
                   help=f"a built-in space ({', '.join(BUILTIN_SPACES)}; default "
                        f"{DEFAULT_SPACE}) or a YAML file (docs/SEARCH.md)")
    p.add_argument("--preset", default=DEFAULT_BASE, choices=(*SEARCH_BASES, *PRESETS),
                   help=f"the base run a space changes (default {DEFAULT_BASE})")
    p.add_argument("--config", metavar="JSON",
                   help="base from a model's config.json or a run's train_config.json")
    p.add_argument("--steps", type=int, help="training steps of every trial")
    p.add_argument("--out", metavar="DIR",
                   help=f"search folder, local or shared (default {DEFAULT_OUT}, or the "
                        f"first free {DEFAULT_OUT}-N once that holds a search)")
    p.add_argument("--resume", metavar="DIR", help="continue an interrupted search")
    p.add_argument("--trust-tune-state", action="store_true",
                   help="with --resume: restore Ray Tune's state (pickles) even without this "
                        "user's signature, e.g. after the driver was killed (only for a "
                        "folder you made)")
    p.add_argument("--metric", choices=tuple(QUALITY), default="loss",
                   help="quality objective (default loss: eval cross-entropy)")
    p.add_argument("--cost", choices=tuple(COSTS), default="flops",
                   help="cost objective at --context tokens: flops (mixer FLOPs per token, "
                        "default), kv (KV-cache bytes), cache (KV cache + state) or latency "
                        "(measured ms of a forward pass over --latency-len tokens on the "
                        "trial's device)")
    p.add_argument("--objective", choices=OBJECTIVES, default="pareto",
                   help="pareto (quality and cost, default) or one of them alone")
    p.add_argument("--context", type=int, default=8192,
                   help="context length the cost is computed at (default 8192)")
    p.add_argument("--latency-len", type=int, default=2048,
                   help="tokens of the forward pass that --cost latency times (default 2048)")
    p.add_argument("--num-trials", type=int, default=8)
    p.add_argument("--max-concurrent", type=int, default=2)
    p.add_argument("--cpus-per-trial", type=float, default=1.0)
    p.add_argument("--gpus-per-trial", type=float, default=0.0,
                   help="fractions share a GPU (0.5: two trials a GPU); > 0 trains on CUDA")
    p.add_argument("--time-budget", type=float, metavar="SECONDS",
                   help="stop the search after this long")
    p.add_argument("--seed", type=int, default=0, help="seed of the Optuna sampler")
    p.add_argument("--sampler", choices=SAMPLERS, default="tpe",
                   help="Optuna sampler: tpe (multivariate TPE, default) or nsga2")
    p.add_argument("--no-baselines", dest="baselines", action="store_false",
                   help="do not train the space's pure forms (every layer softmax, every "
                        "layer gdn) as the first trials")
    p.add_argument("--asha", action="store_true",
                   help="stop poor trials early (ASHA on the quality metric)")
    p.add_argument("--max-failures", type=int, default=2,
                   help="retries of a trial whose worker dies (from its last checkpoint)")
    p.add_argument("--address", help="a running Ray cluster (default: $RAY_ADDRESS, else a "
                                     "new Ray of this machine, listening on 127.0.0.1 only)")
    p.add_argument("--optuna-storage", metavar="URL_OR_FILE",
                   help="keep the Optuna study in a database URL or a journal file "
                        "(optuna-dashboard reads either)")
    p.add_argument("--pick", metavar="N_OR_TRIAL",
                   help="export front entry #N (or a trial id) instead of the knee")
    options = {a.dest: (a.option_strings[0], a.default) for a in p._actions
               if a.option_strings and a.dest not in ("help", "list_spaces")}
    p.set_defaults(func=search_command, search_options=options)
    return p


def list_spaces() -> str:
    lines = []
    for name in BUILTIN_SPACES:
        space = load_space(name)
        default = " (default)" if name == DEFAULT_SPACE else ""
        lines.append(f"{name}{default}: {space.description}")
        lines += [f"    {line}" for line in space.describe()]
    return "\n".join(lines)


def _base(args: argparse.Namespace):
    from nats.trainers.config import config_from_file

    base = search_base(args.preset)
    if args.config is not None:
        base = config_from_file(str(Path(args.config).resolve()), base)
    if args.steps is not None:
        base = base.replace(steps=args.steps,
                            eval_interval=min(base.eval_interval, args.steps))
    return base


def default_out() -> Path:
    """:data:`DEFAULT_OUT`, or the first ``DEFAULT_OUT-N`` that is absent or empty (a new
    search needs one): running the README's command again starts a new search instead of
    failing."""
    out, n = Path(DEFAULT_OUT), 2
    while out.exists() and (not out.is_dir() or any(out.iterdir())):
        out, n = Path(f"{DEFAULT_OUT}-{n}"), n + 1
    return out


def chosen_summary(exported: Any, context: int) -> list[str]:
    """What the exported architecture routes and costs, against the pure forms at the
    search's context length (the measured softmax fraction of each NAtS-L layer)."""
    from nats.cost_model import architecture_cost, compare_costs, fractions_from_measurement

    cfg = exported.config
    if "nats" in cfg.layer_types and not exported.fractions:
        return []  # routes not measured: no honest cost
    lines, fractions = [], (None,) * cfg.n_layers
    if exported.fractions:
        shares = ", ".join(f"layer {i} {f.overall:.2f}" for i, f in
                           sorted(exported.fractions.items()))
        lines.append(f"softmax share of the NAtS-L layers' tokens (eval data): {shares}")
        fractions = fractions_from_measurement(cfg, exported.fractions)
    costs = {"this model": architecture_cost(cfg, fractions, context)}
    costs.update({name: curve[0] for name, curve in
                  compare_costs(cfg, fractions, (context,)).items() if name != "model"})
    lines.append(f"attention cost at {context:,} tokens (FLOPs per token, KV cache, state):")
    for name, cost in costs.items():
        lines.append(f"  {name:<11} {cost.flops_per_token / 1e6:8.2f} M  "
                     f"{cost.kv_cache_bytes / 2**20:8.2f} MiB  {cost.state_bytes / 2**10:8.1f} KiB")
    return lines


def _report(out: Path, errors: dict[str, str], pick_choice: str | None,
            export: bool = True, pick_or_knee: bool = False) -> None:
    """Results, the front and (``export``) the export of ``pick_choice`` (``None``: the
    knee). ``pick_or_knee``: a choice that names no entry of the front exports the knee,
    with a warning, rather than failing a search that has just run."""
    from nats.trainers.export import retrain_command

    from .results import EXPORT_DIR, collect, export_pick, pick, save_errors, table, write

    save_errors(out, errors)
    results = collect(out, finished=True)
    files = write(results, out)
    print(f"\nnats: {len(results.rows)} trials:")
    print(table(results))
    for row in results.rows:
        if row["status"] == "error":
            print(f"nats: trial {row['trial_id']} failed: {row.get('error', '')}",
                  file=sys.stderr)
    print(f"\nPareto front ({' vs '.join(results.keys)}, context {results.settings.context}):")
    print(table(results, results.front, numbered=True))
    print(f"nats: wrote {', '.join(str(f) for f in files)}")
    if export and results.front:
        try:
            index = pick(results, pick_choice)
        except ValueError as e:
            if not pick_or_knee:
                raise
            print(f"nats: warning: {e}; exporting the knee instead (another entry: nats "
                  f"search show {out} --pick N)", file=sys.stderr)
            index = pick(results, None)
        row = results.rows[index]
        exported = export_pick(results, out, index)
        print(f"nats: exported trial {row['trial_id']} ({row['layer_types']}, chunk "
              f"{row['chunk_size']}) to {out / EXPORT_DIR}: {exported.config.layer_types}")
        for line in chosen_summary(exported, results.settings.context):
            print(f"      {line}")
        if exported.routing_map is not None:
            print(f"      its routes: {exported.routing_map}")
        print(f"      train it at scale: {retrain_command(exported)} --init-from "
              f"{out / EXPORT_DIR} ...")
    elif export:
        print("nats: no trial finished: nothing exported", file=sys.stderr)
    print(f"      TensorBoard of every trial: tensorboard --logdir {out / 'trials'}")


def search_command(args: argparse.Namespace) -> int:
    plain_ray_console()
    if args.list_spaces:
        print(list_spaces())
        return 0
    if args.action == "show":
        if args.dir is None:
            raise ValueError("nats search show needs the search folder: nats search show DIR")
        out = Path(args.dir).resolve()
        from .results import collect, table

        done = (out / "results.csv").exists()
        if args.pick is not None or done:
            SearchSettings.load(out)  # a search folder, before the lock would make one
            # Writes the results and may export: not while a search runs in the folder.
            with exclusive(out, "search folder"):
                _report(out, {}, args.pick, export=args.pick is not None)
        else:
            results = collect(out)
            print(table(results))
            print(f"\nPareto front so far ({' vs '.join(results.keys)}):")
            print(table(results, results.front, numbered=True))
        return 0
    if args.dir is not None:
        raise ValueError(f"unexpected argument {args.dir!r}: the search folder is --out DIR "
                         "(or `nats search show DIR`)")
    if args.resume is not None:
        _check_resume_options(args)
        out = Path(args.resume).resolve()
        return _finish(out, resume_search(out, address=args.address,
                                          trust_tune_state=args.trust_tune_state), args.pick)
    space = load_space(args.space)
    storage = args.optuna_storage
    if storage is not None and "://" not in storage:
        storage = str(Path(storage).resolve())
    elif storage is not None and storage.startswith("sqlite:///") \
            and not storage.startswith("sqlite:////"):
        # A relative sqlite path would follow the working directory of each later
        # command (--resume, analyze) and open a new, empty study there.
        storage = "sqlite:///" + str(Path(storage.removeprefix("sqlite:///")).resolve())
    settings = make_settings(
        space, _base(args), quality=args.metric, cost=args.cost, objective=args.objective,
        context=args.context, latency_len=args.latency_len, num_trials=args.num_trials,
        max_concurrent=args.max_concurrent,
        cpus_per_trial=args.cpus_per_trial, gpus_per_trial=args.gpus_per_trial,
        time_budget_s=args.time_budget, seed=args.seed, sampler=args.sampler, asha=args.asha,
        max_failures=args.max_failures, optuna_storage=storage, baselines=args.baselines)
    out = (Path(args.out) if args.out is not None else default_out()).resolve()
    print(f"nats: searching space {space.name!r} ({settings.num_trials} trials, "
          f"{settings.max_concurrent} at a time) into {out}")
    for line in space.describe():
        print(f"    {line}")
    return _finish(out, run_search(settings, out, address=args.address), args.pick)


RESUME_OPTIONS = ("resume", "address", "trust_tune_state", "pick")
"""What ``--resume`` takes: the search folder keeps every other setting."""


def _check_resume_options(args: argparse.Namespace) -> None:
    """``--resume`` with options that would set up another search (more trials, other
    steps, another --out) is refused: it continues the search as it was set up."""
    given = [flag for dest, (flag, default) in args.search_options.items()
             if dest not in RESUME_OPTIONS and getattr(args, dest) != default]
    if given:
        raise ValueError(f"--resume continues a search as it was set up and does not take "
                         f"{', '.join(given)}; start a new search (--out) to change them")


def _finish(out: Path, outcome: FitOutcome, pick_choice: str | None) -> int:
    if outcome.complete:
        _report(out, outcome.errors, pick_choice, pick_or_knee=True)
        return 0
    from .results import collect, table

    print(table(collect(out, outcome.errors)))
    print(f"nats: search interrupted; continue it with: nats search --resume {out}",
          file=sys.stderr)
    return EXIT_INTERRUPTED
