"""Which branch norm does the README's recall task need? (the search base, per seed)

    python experiments/branch_norm.py --norms both linear scaled --seeds 0 1 2   # ~2.5 min a run

The search base (``mqar-search``: 8 key-value pairs in the first of four 16-token chunks,
noise filler, two NAtS-L layers at a softmax budget of 0.5, 400 steps at lr 1e-2), trained
as a search trial trains it (one thread), with the model's ``branch_norm`` set to each of
``--norms``: ``both`` normalises both branch outputs before the merge, ``linear`` lets the
softmax output keep its magnitude (better for language and the needle, docs/RESULTS.md),
``scaled`` divides it by its running RMS per head (the base's own setting);
``--softmax-gain-init G`` gives every run a learned per-head gain on the softmax output,
started at G.

Prints one line per run (eval accuracy, loss, the routed share and, per layer, how often
the pairs' chunk and the other chunks went to softmax) and writes them to
``--out``/results.json.
"""

from __future__ import annotations

import argparse
import functools
from pathlib import Path

import common

from nats.config import BRANCH_NORMS
from nats.search_spaces.builtin import search_base

KEYS = ("eval/acc", "eval/loss", "eval/route_frac", "eval/route_informative/layer0",
        "eval/route_filler/layer0", "eval/route_informative/layer1", "eval/route_filler/layer1")


def run(norm: str, seed: int, out: Path, gain: float | None) -> dict[str, float | str | int]:
    base = search_base("mqar-search")
    model = base.model.replace(branch_norm=norm, softmax_gain_init=gain)
    name = norm if gain is None else f"{norm}-gain{gain:g}"
    config = base.replace(model=model, device="cpu", seed=seed,
                          out_dir=str(out / f"{name}-seed{seed}"))
    metrics = common.train_row(config)
    return {"branch_norm": norm, "softmax_gain_init": gain, "seed": seed,
            **{k: metrics[k] for k in KEYS}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--norms", nargs="+", choices=BRANCH_NORMS,
                        default=["both", "linear", "scaled"])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--softmax-gain-init", type=float, default=None,
                        help="NatsConfig.softmax_gain_init of every run (default: none)")
    parser.add_argument("--out", type=Path, default=Path("runs/branch-norm"))
    args = parser.parse_args()
    common.run_rows_per_seed(functools.partial(run, gain=args.softmax_gain_init), args.norms,
                             args.seeds, args.out)


if __name__ == "__main__":
    main()
