"""Concentrated recall: key-value pairs packed into a few chunks among filler, asked at the end.

    python experiments/recall.py --scale cpu                          # minutes on a CPU
    python experiments/recall.py --scale cpu-mix --archs natsl-all --jobs 2  # ~8 min
    python experiments/recall.py --scale gpu --device cuda --jobs 11  # one GPU, ~9 min

MQAR (Zoology's task) with the pairs in one block at a random even offset, noise filler
that is never a key or value everywhere else, and every key asked once at the end
(``mqar_placement="block"``, ``mqar_filler="noise"``, ``mqar_queries="end"``). A few chunks
hold everything the queries need; a fixed-size state has to keep them across hundreds of
filler tokens, while softmax attention only needs those chunks in its cache. So this is
where a token-level hybrid should win: near the transformer's accuracy at a quarter of
its KV cache, far above the linear model, with the informative chunks the ones routed to
softmax (``eval/route_informative`` against ``eval/route_filler``; the chunks of the
questions, ``eval/route_query``, are neither).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common

from nats.trainers import TrainConfig

SCALES = {
    # Trained on a mixture of 8, 16 and 32 pairs (the easy batches teach the lookup);
    # tested at the training length and at twice it, 32 pairs each.
    "gpu": dict(vocab=512, d_model=128, head_dim=64, chunk=32, train=(512, 32),
                mix=(8, 16, 32), steps=2500, batch=64, lrs=(3e-3,), seeds=(0, 1, 2),
                eval_batches=8, test=((512, 32), (1024, 32)), minutes=55),
    # Twice as long, the same tokens per step: NAtS-L had not learned it after 2500 steps
    # (docs/RESULTS.md).
    "gpu-1k": dict(vocab=512, d_model=128, head_dim=64, chunk=32, train=(1024, 32),
                   mix=(8, 16, 32), steps=2500, batch=32, lrs=(3e-3,), seeds=(0, 1, 2),
                   eval_batches=8, test=((1024, 32), (2048, 32)), minutes=55),
    "cpu": dict(vocab=32, d_model=64, head_dim=32, chunk=16, train=(128, 8), mix=(),
                steps=600, batch=32, lrs=(1e-2,), seeds=(0,), eval_batches=4,
                test=((128, 8),), minutes=20),
    # A budget is held on the training batches, a mixture: what does each pair count cost?
    "cpu-mix": dict(vocab=64, d_model=64, head_dim=32, chunk=16, train=(128, 16),
                    mix=(4, 8, 16), steps=600, batch=32, lrs=(1e-2,), seeds=(0, 1, 2),
                    eval_batches=8, test=((128, 16), (128, 8), (128, 4)), minutes=30),
}


def main() -> None:
    args, s = common.parse_args(__doc__.splitlines()[0], SCALES)
    model = common.recall_model(s)
    seq_len, pairs = s["train"]
    base = TrainConfig(model=model, task="mqar", steps=s["steps"], batch_size=s["batch"],
                       seq_len=seq_len, mqar_pairs=pairs, mqar_pairs_mix=s["mix"],
                       mqar_placement="block", mqar_filler="noise", mqar_queries="end",
                       warmup_steps=s["steps"] // 10, eval_interval=s["steps"],
                       eval_batches=2, log_interval=10, checkpoint_interval=s["steps"],
                       keep_checkpoints=1)
    slices = [base.replace(seq_len=t, mqar_pairs=p, mqar_pairs_mix=()) for t, p in s["test"]]
    reports = common.run_grid("recall", args, base, s["lrs"], s["seeds"], slices, s["eval_batches"])
    header = ["arch", *(f"acc {t}/{p}" for t, p in s["test"]), "seq acc",
              *(f"softmax share {t}/{p}" for t, p in s["test"]),
              "informative -> softmax", "query -> softmax", "filler -> softmax",
              *common.COST_HEADER]
    rows = []
    for arch, runs in common.best_per_seed(reports).items():
        accs = [common.mean_std([r["slices"][i]["accuracy"] for r in runs])
                for i in range(len(s["test"]))]
        first = [r["slices"][0] for r in runs]
        routing = [x.get("routing") for x in first]
        shares = [common.mean_std([_share(r["slices"][i]) for r in runs])
                  for i in range(len(s["test"]))]
        informative, query, filler = (_rate(routing, key) for key in
                                      ("route_informative", "route_query", "route_filler"))
        rows.append([arch, *accs, common.mean_std([x["sequence_accuracy"] for x in first]),
                     *shares, informative, query, filler, *common.cost_cells(runs[0], 0)])
    out = args.out or Path("runs/experiments") / f"recall-{args.scale}"
    title = (f"Concentrated recall ({args.scale} scale, trained at {seq_len} tokens, "
             f"{pairs} pairs)")
    common.write_table(out, title, common.markdown_table(header, rows),
                       ["Accuracy: share of queries answered exactly; seq acc: every query of "
                        f"a sequence right ({s['test'][0][0]}/{s['test'][0][1]}). Softmax "
                        "share: of the routable chunks (all but each sequence's last) sent to "
                        "softmax, NAtS-L rows; the softmax fraction of tokens otherwise. "
                        "Informative chunks hold a queried key-value pair, query chunks a "
                        "question and no pair, filler chunks neither. Mean ± std over "
                        f"seeds ({len(s['seeds'])}); cost from src/nats/cost_model.py."])


def _rate(routing: list[dict | None], key: str) -> str:
    """A routing rate's mean ± std over the seeds, or "-" where a run lacks it: a model
    without routes, or no query rate where every question is in a sequence's last chunk,
    which has no route."""
    rates = [x[key] for x in routing if x and key in x]
    return common.mean_std(rates) if len(rates) == len(routing) else "-"


def _share(report_slice: dict) -> float:
    """NAtS-L rows: the routable chunks sent to softmax; others: the softmax fraction."""
    routing = report_slice.get("routing")
    return routing["route_frac"] if routing else report_slice["softmax_fraction"]


if __name__ == "__main__":
    main()
