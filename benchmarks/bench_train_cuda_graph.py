"""``nats train`` step time, eager against ``--cuda-graph``, on presets a user trains
(run by hand: ``python benchmarks/bench_train_cuda_graph.py [OUT.json]``).

Each case trains 20 steps (kernels compile and tune), then 100 and 400 steps from scratch;
a step's time is ``(T(400) - T(100)) / 300``, so what every run pays once (building the
model, the first steps, the final evaluation and save) cancels. The trainer's own loop is
timed, not a stand-in: data, schedule, budget controller and progress bar included.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from typing import Any

import torch

from nats.trainers import preset, train

CASES: list[tuple[str, dict[str, Any]]] = [
    ("bytes-small", {}), ("mqar-small", {}),
    ("bytes-small", {"seq_len": 2048, "batch_size": 4})]


def seconds(name: str, changes: dict[str, Any], steps: int, graph: bool) -> tuple[float, float]:
    """Wall time of a whole ``train`` call of ``steps`` steps, and its last loss."""
    config = preset(name).replace(steps=steps, warmup_steps=10, eval_interval=10**6,
                                  checkpoint_interval=10**6, log_interval=50, eval_batches=1,
                                  device="cuda", cuda_graph=graph,
                                  out_dir=tempfile.mkdtemp() + "/run", **changes)
    torch.cuda.synchronize()
    start = time.perf_counter()
    result = train(config)
    torch.cuda.synchronize()
    return time.perf_counter() - start, result.train_losses[-1]


def main(out: str | None) -> None:
    rows = []
    for name, changes in CASES:
        config = preset(name).replace(**changes)
        for graph in (False, True):
            seconds(name, changes, 20, graph)
            short, _ = seconds(name, changes, 100, graph)
            long, loss = seconds(name, changes, 400, graph)
            ms = (long - short) / 300 * 1e3
            rows.append({"preset": name, **changes, "seq_len": config.seq_len,
                         "batch_size": config.batch_size, "cuda_graph": graph,
                         "ms_per_step": ms,
                         "tokens_per_s": config.batch_size * config.seq_len / ms * 1e3,
                         "loss_at_400": loss})
            print(json.dumps(rows[-1]), flush=True)
    save(rows, out)


def save(rows: list[dict[str, Any]], out: str | None) -> None:
    """``rows`` with the GPU's name and torch's version as JSON at ``out``, if given."""
    if out:
        with open(out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else None)
