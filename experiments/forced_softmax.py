"""Does a NAtS-L layer with every chunk on softmax learn what a softmax layer learns?

    python experiments/forced_softmax.py --seeds 0 1 2      # ~2.5 min a run, one thread

The search base's task (``mqar-search``: 8 key-value pairs in the first of four 16-token
chunks) with random filler and a vocabulary of 64, where the transformer learned in 400
steps and the all-NAtS-L model forced to softmax did not (one seed each). Three rows per
seed, each a 2-layer model trained 400 steps at lr 1e-2:

* ``softmax``: two plain softmax layers;
* ``natsl-forced``: two NAtS-L layers, every route forced to softmax;
* ``natsl-forced-direct``: the same, with the merge replaced by the softmax branch alone
  (``W_o(gamma * o_SM)``): given equal weights its loss and every gradient equal the
  softmax layer's, so any gap between it and ``softmax`` is the initial draw's.

Prints one line per run (eval accuracy and loss) and writes them to ``--out``/results.json.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import common
import torch

from nats.layers import nats_attention
from nats.search_spaces.builtin import search_base

ROWS = ("softmax", "natsl-forced", "natsl-forced-direct")


def _softmax_branch_only(self: nats_attention.NatsAttention, q: torch.Tensor,
                         o_la: torch.Tensor, o_sm: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """A ``NatsAttention._merge`` that drops the linear branch and the mixing weights."""
    heads = o_sm.reshape(*x.shape[:2], -1, self.cfg.softmax_head_dim_v)
    return self.out(heads.float(), x)


def run(row: str, seed: int, out: Path) -> dict[str, float]:
    base = search_base("mqar-search")
    layer = "softmax" if row == "softmax" else "nats"
    model = base.model.replace(vocab_size=64, layer_types=(layer, layer))
    config = base.replace(model=model, mqar_filler="random", seed=seed,
                          out_dir=str(out / f"{row}-seed{seed}"))
    merge = nats_attention.NatsAttention._merge
    if row == "natsl-forced-direct":
        nats_attention.NatsAttention._merge = _softmax_branch_only
    try:
        with common.routes_forced("softmax" if layer == "nats" else "none"):
            metrics = common.train_row(config)
    finally:
        nats_attention.NatsAttention._merge = merge
    return {"row": row, "seed": seed, "acc": metrics["eval/acc"], "loss": metrics["eval/loss"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--rows", nargs="+", choices=ROWS, default=list(ROWS))
    parser.add_argument("--out", type=Path, default=Path("runs/forced-softmax"))
    args = parser.parse_args()
    common.run_rows_per_seed(run, args.rows, args.seeds, args.out)


if __name__ == "__main__":
    main()
