"""Single-needle retrieval: baselines trained at 1k bytes on stdlib-text haystacks with one
distractor, tested at 1k and 4k on repeated-filler and real-text haystacks, with and without
distractors.

    python experiments/needle.py --scale cpu                  # reduced: minutes on a CPU
    python experiments/needle.py --scale gpu --device cuda --jobs 10  # full: 10 runs at once
    python experiments/needle.py --scale gpu-quick --device cuda  # 1k only, minutes

The vocabulary is 10 digits, 128 key tokens and 128 filler tokens, so printable ASCII
text is exact (bytes from 128 on fold into the filler range). Testing at 4k is longer than
training and labelled so in the JSON.

The softmax heads get no RoPE (the layer's default and the official models'): with it, the
routed model and the transformer both failed at 4x the training length, and without it both
hold there (docs/RESULTS.md, "The needle without RoPE"). The GPU scale trains 3,000 steps:
at 1,500 the routed model rarely left the plateau. Runs before these choices set
``--set rope=true`` (and ``--steps 1500`` at the GPU scale) to be reproduced. On one H200,
24 runs of the GPU scale trained at once took 9-14 minutes. The GPU scale tests every
slice on 512 rows (16 batches; 128 before 2026-11-29): at 128 one row is 0.8 points, the
size of the gaps the tables compare.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common

from nats import NatsConfig
from nats.trainers import TrainConfig

VOCAB = 10 + 2 * 128
SCALES = {
    "gpu": dict(d_model=128, layers=4, head_dim=64, chunk=64, train=1024, test=(1024, 4096),
                steps=3000, batch=32, lrs=(3e-3, 1e-2), seeds=(0,), eval_batches=16, minutes=55),
    "gpu-quick": dict(d_model=128, layers=2, head_dim=64, chunk=64, train=1024, test=(1024,),
                      steps=700, batch=16, lrs=(1e-2,), seeds=(0,), eval_batches=4,
                      minutes=1.5),
    "cpu": dict(d_model=64, layers=2, head_dim=32, chunk=16, train=128, test=(128, 256),
                steps=1200, batch=16, lrs=(3e-3, 1e-2), seeds=(0,), eval_batches=2,
                minutes=12),
}
HAYSTACKS, DISTRACTORS = ("repeated", "text"), (0, 2)


def base_config(s: dict) -> TrainConfig:
    """Training at scale ``s`` (one of ``SCALES``), every layer NAtS-L; the grid sets the
    rows' mixers, learning rates and seeds."""
    model = NatsConfig(vocab_size=VOCAB, d_model=s["d_model"], n_layers=s["layers"],
                       n_heads=2, softmax_heads_per_head=2, head_dim_k=s["head_dim"],
                       head_dim_v=s["head_dim"], chunk_size=s["chunk"],
                       layer_types=("nats",) * s["layers"])
    return TrainConfig(model=model, task="needle", steps=s["steps"], batch_size=s["batch"],
                       seq_len=s["train"], needle_haystack="text", needle_distractors=1,
                       warmup_steps=s["steps"] // 10, eval_interval=s["steps"],
                       eval_batches=2, log_interval=10, checkpoint_interval=s["steps"],
                       keep_checkpoints=1)


def main() -> None:
    args, s = common.parse_args(__doc__.splitlines()[0], SCALES)
    base = base_config(s)
    settings = [(t, h, d) for t in s["test"] for h in HAYSTACKS for d in DISTRACTORS]
    slices = [base.replace(seq_len=t, needle_haystack=h, needle_distractors=d)
              for t, h, d in settings]
    reports = common.run_grid("needle", args, base, s["lrs"], s["seeds"], slices, s["eval_batches"])
    header = ["arch", "lr", *(f"{t} {h} d={d}" for t, h, d in settings), "softmax frac",
              *common.COST_HEADER]
    rows = []
    for arch, runs in common.best_per_seed(reports).items():
        accs = [f'{common.mean_std([r["slices"][i]["sequence_accuracy"] for r in runs])} '
                f'({common.mean_std([r["slices"][i]["accuracy"] for r in runs])})'
                for i in range(len(settings))]
        frac = common.mean_std([r["slices"][0]["softmax_fraction"] for r in runs])
        rows.append([arch, ", ".join(f"{r['lr']:g}" for r in runs), *accs, frac,
                     *common.cost_cells(runs[0], 0)])
    out = args.out or Path("runs/experiments") / f"needle-{args.scale}"
    title = (f"Needle retrieval ({args.scale} scale, trained at {s['train']} on text "
             "haystacks with 1 distractor)")
    common.write_table(out, title, common.markdown_table(header, rows),
                       ["Cells: share of rows whose 7 answer digits are all right (in "
                        "brackets: share of answer digits right, chance 0.1); columns: length, "
                        "haystack, distractors; lr: per seed, the one of the lowest validation "
                        "loss. Softmax fraction and cost at the first slice."])


if __name__ == "__main__":
    main()
