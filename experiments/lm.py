"""Language modelling of the Python standard library's sources (bytes) at 1k context,
~10M-parameter baselines; bits per byte on the held-out files.

    python experiments/lm.py --scale cpu                      # reduced: minutes on a CPU
    python experiments/lm.py --scale gpu --device cuda        # full: < 1 h on one GPU
    python experiments/lm.py --scale gpu-quick --device cuda  # 300 steps, minutes

The corpus is read straight from the stdlib's files (no ``datasets`` needed).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common

from nats import NatsConfig
from nats.trainers import TrainConfig

SCALES = {
    "gpu": dict(d_model=256, layers=8, heads=4, head_dim=64, chunk=64, seq_len=1024,
                steps=1500, batch=16, lrs=(1e-3,), seeds=(0,), eval_batches=8, minutes=55),
    "gpu-quick": dict(d_model=256, layers=4, heads=4, head_dim=64, chunk=64, seq_len=1024,
                      steps=300, batch=16, lrs=(2e-3,), seeds=(0,), eval_batches=8,
                      minutes=1),
    "cpu": dict(d_model=64, layers=2, heads=2, head_dim=32, chunk=16, seq_len=128,
                steps=1000, batch=16, lrs=(3e-3,), seeds=(0,), eval_batches=8, minutes=12),
}


def main() -> None:
    args, s = common.parse_args(__doc__.splitlines()[0], SCALES)
    model = NatsConfig(vocab_size=256, d_model=s["d_model"], n_layers=s["layers"],
                       n_heads=s["heads"], softmax_heads_per_head=2, head_dim_k=s["head_dim"],
                       head_dim_v=s["head_dim"], chunk_size=s["chunk"],
                       layer_types=("nats",) * s["layers"], rope=True)
    base = TrainConfig(model=model, task="text", steps=s["steps"], batch_size=s["batch"],
                       seq_len=s["seq_len"], warmup_steps=s["steps"] // 10,
                       eval_interval=s["steps"], eval_batches=2, log_interval=10,
                       checkpoint_interval=s["steps"], keep_checkpoints=1)
    reports = common.run_grid("lm", args, base, s["lrs"], s["seeds"], [base], s["eval_batches"])
    header = ["arch", "params", "bits/byte", "softmax frac", *common.COST_HEADER]
    rows = []
    for arch, runs in common.best_per_seed(reports).items():
        rows.append([arch, f"{runs[0]['parameters']:,}",
                     common.mean_std([r["slices"][0]["bits_per_byte"] for r in runs]),
                     common.mean_std([r["slices"][0]["softmax_fraction"] for r in runs]),
                     *common.cost_cells(runs[0], 0)])
    out = args.out or Path("runs/experiments") / f"lm-{args.scale}"
    common.write_table(out, f"Language modelling, stdlib bytes ({args.scale} scale, context "
                            f"{s['seq_len']})", common.markdown_table(header, rows),
                       ["Bits per byte on the validation files (lower is better)."])


if __name__ == "__main__":
    main()
