"""What does calibrating the budget cost a trained model? (the search base, per seed)

    python experiments/calibration.py --targets trained 0.125 0.25 0.5 0.75 --seeds 0 1 2
    python experiments/calibration.py --train-budget 0.25 --targets trained  # trained lower

The search base (``mqar-search``: 8 key-value pairs in the first of four 16-token chunks,
noise filler, two NAtS-L layers at a softmax budget of 0.5, 400 steps at lr 1e-2, about 2.5
min on one thread) is trained once per seed; then, for each target, a copy of the model has
its routing biases calibrated on 8 batches that evaluation does not read
(``nats eval --calibrate-budget``) and is evaluated on the run's 8 evaluation batches.
``trained`` evaluates the model as trained. One model then gives a cost-accuracy curve.

Prints one line per (seed, target) and writes them to ``--out``/results.json.
"""

from __future__ import annotations

import argparse
import copy
import functools
from pathlib import Path

import common
import torch

from nats.evaluation import run_eval
from nats.search_spaces.builtin import search_base
from nats.trainers import build_batches, train
from nats.trainers.route_control import calibrate_budget
from nats.trainers.sources import LoadedModel

BATCHES = 8


def run(target: str, seed: int, out: Path, train_budget: float) -> dict[str, float | str | int]:
    base = search_base("mqar-search")
    config = base.replace(model=base.model.replace(softmax_target=train_budget), device="cpu",
                          seed=seed, out_dir=str(out / f"budget{train_budget:g}-seed{seed}"))
    model = copy.deepcopy(train(config, resume=True).model).eval()  # trained once per seed
    if target != "trained":
        calibrate_budget(model, [ids for ids, _ in build_batches(config).calibration(BATCHES)],
                         float(target))
    report = run_eval(LoadedModel(model, config, f"seed {seed}"), [config], BATCHES,
                      torch.device("cpu"), show_progress=False)
    metrics = report["slices"][0]["metrics"]
    return {"train_budget": train_budget, "target": target, "seed": seed,
            "acc": metrics["eval/acc"],
            **{k: metrics[f"eval/{k}"] for k in ("route_frac", "route_frac/layer0",
                                                  "route_frac/layer1", "route_informative",
                                                  "route_filler")}}


def _fraction(text: str) -> bool:
    try:
        return 0 < float(text) < 1
    except ValueError:
        return False


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--targets", nargs="+", default=["trained", "0.125", "0.25", "0.5",
                                                         "0.75"],
                        help="'trained' or budget fractions in (0, 1)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--train-budget", type=float, default=0.5,
                        help="the softmax budget the model is trained under (default: the "
                             "search base's 0.5)")
    parser.add_argument("--out", type=Path, default=Path("runs/calibration"))
    args = parser.parse_args()
    for target in args.targets:
        if target != "trained" and not _fraction(target):
            parser.error(f"--targets: {target} is neither 'trained' nor a fraction in (0, 1)")
    if not 0 < args.train_budget < 1:
        parser.error(f"--train-budget: {args.train_budget:g} is not a fraction in (0, 1)")
    common.run_rows_per_seed(functools.partial(run, train_budget=args.train_budget),
                             args.targets, args.seeds, args.out)


if __name__ == "__main__":
    main()
