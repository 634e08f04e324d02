"""MQAR: 2-layer baselines trained at 256 tokens with up to 64 pairs, tested from 64/4 to 1024/256.

    python experiments/mqar.py --scale cpu                    # reduced: minutes on a CPU
    python experiments/mqar.py --scale gpu --device cuda      # full: < 1 h on one GPU
    python experiments/mqar.py --scale gpu-quick --device cuda  # ~4 min on one GPU

Best of a small learning-rate grid (by validation loss, never the test slices) per seed;
the table shows mean ± std over seeds. The CPU scale is smaller in every direction: see SCALES.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common

from nats.trainers import TrainConfig

SCALES = {
    # Trained at 256 tokens on a mixture of 4..64 pairs per batch (Zoology's "up to 64"):
    # from scratch on 64 pairs alone, vocabulary 8192, lr 5e-4, 1500 steps learned nothing.
    # 4000 steps: Gated DeltaNet (no output gate) reached 0.84 at 256/64 after 3000 at lr
    # 3e-3 and 0.20 at 1e-2 (docs/RESULTS.md, "Recipe sweep"); it needs --steps 14000 and
    # lr 1e-3 to learn 256/64 on every seed ("MQAR: Gated DeltaNet given more steps").
    "gpu": dict(vocab=1024, d_model=128, head_dim=64, chunk=32, train=(256, 64),
                mix=(4, 8, 16, 32, 64), steps=4000, batch=64, lrs=(3e-3,),
                seeds=(0, 1, 2), eval_batches=4,
                test=((64, 4), (128, 16), (256, 64), (512, 128), (1024, 256)), minutes=55),
    # Small enough that the transformer learns it in a minute: on the CPU at width 64 and
    # batch 32, 64/8 reached 98% accuracy in 360 steps at lr 1e-2 (14% in 600 at 3e-3;
    # 128/16 at 3e-3: 2% in 600). Tested up to 8x the training length and pairs.
    "gpu-quick": dict(vocab=256, d_model=128, head_dim=64, chunk=32, train=(64, 8),
                      steps=800, batch=64, lrs=(1e-2,), seeds=(0,), eval_batches=4,
                      test=((64, 8), (128, 16), (256, 32), (512, 64)), minutes=3),
    "cpu": dict(vocab=64, d_model=64, head_dim=32, chunk=16, train=(32, 4), steps=200,
                batch=32, lrs=(3e-3,), seeds=(0,), eval_batches=2,
                test=((32, 4), (64, 8), (128, 16)), minutes=10),
}


def main() -> None:
    args, s = common.parse_args(__doc__.splitlines()[0], SCALES)
    model = common.recall_model(s)
    seq_len, pairs = s["train"]
    base = TrainConfig(model=model, task="mqar", steps=s["steps"], batch_size=s["batch"],
                       seq_len=seq_len, mqar_pairs=pairs, mqar_pairs_mix=s.get("mix", ()),
                       warmup_steps=s["steps"] // 10,
                       eval_interval=s["steps"], eval_batches=2, log_interval=10,
                       checkpoint_interval=s["steps"], keep_checkpoints=1)
    slices = [base.replace(seq_len=t, mqar_pairs=p, mqar_pairs_mix=()) for t, p in s["test"]]
    reports = common.run_grid("mqar", args, base, s["lrs"], s["seeds"], slices, s["eval_batches"])
    header = ["arch", "lr (per seed)", *(f"acc {t}/{p}" for t, p in s["test"]),
              "softmax frac", *common.COST_HEADER]
    rows = []
    train_index = list(s["test"]).index(s["train"])
    for arch, runs in common.best_per_seed(reports).items():
        accs = [common.mean_std([r["slices"][i]["accuracy"] for r in runs])
                for i in range(len(s["test"]))]
        frac = common.mean_std([r["slices"][train_index]["softmax_fraction"] for r in runs])
        rows.append([arch, ", ".join(f"{r['lr']:g}" for r in runs), *accs, frac,
                     *common.cost_cells(runs[0], train_index)])
    out = args.out or Path("runs/experiments") / f"mqar-{args.scale}"
    common.write_table(out, f"MQAR ({args.scale} scale, trained at {seq_len}/{pairs})",
                       common.markdown_table(header, rows),
                       ["Accuracy: share of queries answered exactly, mean ± std over seeds "
                        f"({len(s['seeds'])}), the lr of the lowest validation loss per seed. "
                        "Softmax fraction and cost at the training slice; cost from "
                        "src/nats/cost_model.py at 4k/32k tokens."])


if __name__ == "__main__":
    main()
