"""What should a softmax route have to buy? The share split's price, on trained models.

    python experiments/split_price.py RUN [RUN ...] --share 0.125 \
        --prices 0 0.01 0.03 0.1 0.3 1 --out runs/split-price.json

For each trained recall model: ``split_budget`` splits ``--share`` among the heads by the
loss on the calibration batches (as ``nats eval --calibrate-budget S --calibrate-scope
head`` does), then gives share back one finest step at a time, the step that raises the
loss least, down to no share at all, recording the path. A price ``p`` keeps the point of
that path with the least ``loss + p * share`` (``kept_on_path``, what ``split_budget(...,
price=p)`` keeps), so one path gives every price. Each price's split is then evaluated on the
evaluation batches, which the split never reads: accuracy, share, and how often the
informative (pair) and filler chunks go to softmax.

Choose the price on some models and report it on others: the split reads only calibration
batches, but a price picked by its evaluation accuracy is picked on the evaluation set.

Writes one record per model to ``--out`` after each model; a rerun skips the prices done
and reads the path it has.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import torch

from nats.atomic_write import atomic_write_bytes
from nats.evaluation import run_eval
from nats.evaluation.slices import slice_configs
from nats.trainers import build_batches
from nats.trainers.route_control import calibrate_budget, kept_on_path, split_budget
from nats.trainers.sources import load_model

PAIRS, BATCHES, BATCH_SIZE = 32, 2, 32
"""The slice of docs/RESULTS.md's per-head split ("The share split among heads")."""


def run(source: str, share: float, prices: list[float],
        record: dict[str, Any] | None) -> dict[str, Any]:
    """Split (unless ``record`` holds this model's path already) and evaluate each price."""
    device = torch.device("cpu")
    loaded = load_model(source, device)
    base = loaded.train_config
    if base is None or base.task != "mqar":
        raise ValueError(f"{source}: not a run trained on mqar")
    [config] = slice_configs(base, "mqar", [base.seq_len], [PAIRS], BATCH_SIZE)
    batches = [(x.to(device), y.to(device))
               for x, y in build_batches(config).calibration(BATCHES)]
    if record is None:
        path: list[tuple[list[float], float]] = []
        start = time.perf_counter()
        split_budget(loaded.model, batches, share, unit="head", price=1e6, progress=True,
                     on_split=lambda shares, loss: path.append((shares, loss)))
        record = {"source": source, "share": share, "path": path,
                  "split_seconds": time.perf_counter() - start, "prices": {}}
    path = record["path"]
    heads = loaded.model.config.n_heads
    for price in prices:
        if f"{price:g}" in record["prices"]:
            continue
        flat, calibration_loss = path[kept_on_path(path, price)]
        nested = [flat[i:i + heads] for i in range(0, len(flat), heads)]
        calibrate_budget(loaded.model, [x for x, _ in batches], nested)
        result = run_eval(loaded, [config], BATCHES, device, show_progress=False)["slices"][0]
        routing = result["routing"]
        informative, filler = routing["route_informative"], routing["route_filler"]
        record["prices"][f"{price:g}"] = {
            "shares": nested, "calibration_loss": calibration_loss,
            "accuracy": result["accuracy"], "softmax_fraction": result["softmax_fraction"],
            "route_frac": routing["route_frac"], "informative": informative, "filler": filler,
            "lift": informative / filler if filler > 0 else None}
        lift = record["prices"][f"{price:g}"]["lift"]
        print(f"{source} price {price:g}: accuracy {result['accuracy']:.3f} share "
              f"{routing['route_frac']:.3f} lift {'-' if lift is None else f'{lift:.1f}'} "
              f"shares {nested}", flush=True)
    return record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", help="run folders of trained mqar models")
    parser.add_argument("--share", type=float, default=0.125,
                        help="the model-wide share split among the heads (default 0.125)")
    parser.add_argument("--prices", type=float, nargs="+", default=[0, 0.01, 0.03, 0.1, 0.3, 1],
                        help="nats of loss a unit of model-wide share must buy")
    parser.add_argument("--out", type=Path, default=Path("runs/split-price.json"))
    args = parser.parse_args()
    if not 0 < args.share < 1:
        parser.error(f"--share: {args.share:g} is not a fraction in (0, 1)")
    if not all(0 <= p < math.inf for p in args.prices):
        parser.error("--prices must be numbers >= 0")
    done = json.loads(args.out.read_text()) if args.out.exists() else {}
    for source in args.runs:
        key = f"{source}@{args.share:g}"
        if key in done and set(done[key]["prices"]) >= {f"{p:g}" for p in args.prices}:
            continue
        try:
            done[key] = run(source, args.share, args.prices, done.get(key))
        except ValueError as error:
            sys.exit(f"split_price: {error}")
        atomic_write_bytes(args.out, (json.dumps(done, indent=1) + "\n").encode())


if __name__ == "__main__":
    main()
