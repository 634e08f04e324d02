"""Where a learned router helps or hurts: the CI routing test's setting under four trainings.

    python experiments/router_ablation.py --seeds 0 1 2 3 4        # ~80 s a run, one thread
    python experiments/router_ablation.py --modes detached linear --softmax-qkv own

MQAR at 64 tokens, its 4 pairs in the first of four 16-token chunks, a 2-layer width-64
NAtS-L model, 600 steps (``--steps``) at lr 1e-2 (``tests/trainers/test_routing_learns.py``),
trained as

* ``detached``: the defaults (the scorer's input detached, ``scorer_detach=True``);
* ``attached``: the route gradient flows from the scorer back into the residual stream
  (``scorer_detach=False``, the official layer's way);
* ``linear``: every route forced to linear (the layer's own linear model);
* ``random``: routes drawn at random, 25 % softmax, content-blind, in training and in the
  evaluation (what routing costs the model when nothing is learned about it).

``--softmax-qkv own`` gives the softmax branch q/k/v of its own in every mode,
``--scorer-pool mean`` the scorer a chunk's mean instead of its maximum (the default). Prints one
markdown row per mode: accuracy per seed on 8 held-out batches, mean +- std,
and the share of the pairs' chunk and of other chunks sent to softmax.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile

import torch
import torch.nn.functional as F

import nats.layers.nats_attention as nats_attention
import nats.trainers.loop as loop
from nats import NatsConfig, NatsForCausalLM
from nats.config import SCORER_POOLS, SOFTMAX_QKVS
from nats.trainers import TrainConfig, train

MODES = ("detached", "attached", "linear", "random")


def random_routes(share: float):
    """``forced_routes`` that draws each (sequence, chunk, head) at random."""
    def draw(override, batch, first_chunk, n, heads, device):
        is_sm = torch.rand(batch, n, heads, device=device) < share
        return F.one_hot((~is_sm).long(), 2).float()
    return draw


def run(mode: str, seed: int, softmax_qkv: str = "shared", rope: bool = True,
        steps: int = 600, scorer_pool: str = NatsConfig.scorer_pool) -> dict[str, float]:
    model = NatsConfig(vocab_size=32, d_model=64, n_layers=2, n_heads=2,
                       softmax_heads_per_head=2, head_dim_k=32, head_dim_v=32, chunk_size=16,
                       layer_types=("nats", "nats"), rope=rope,
                       scorer_detach=mode != "attached",
                       softmax_qkv=softmax_qkv, scorer_pool=scorer_pool)
    forced = {"linear": "linear", "random": "random"}.get(mode)
    original_routes, original_set = nats_attention.forced_routes, loop.set_exploration
    if mode == "random":
        nats_attention.forced_routes = random_routes(0.25)
    if forced is not None:
        def set_exploration(model: NatsForCausalLM, noise: float) -> None:
            original_set(model, noise)
            model.set_route_override(forced)  # before every step, so also in evaluation
        loop.set_exploration = set_exploration
    try:
        with tempfile.TemporaryDirectory() as out:
            config = TrainConfig(model=model, task="mqar", steps=steps, batch_size=32,
                                 seq_len=64, mqar_pairs=4, lr=1e-2, warmup_steps=60,
                                 eval_interval=steps, eval_batches=8, log_interval=100,
                                 checkpoint_interval=100_000, device="cpu",
                                 out_dir=f"{out}/run", seed=seed)
            return train(config).eval_metrics
    finally:
        nats_attention.forced_routes, loop.set_exploration = original_routes, original_set


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--softmax-qkv", choices=SOFTMAX_QKVS, default="shared")
    parser.add_argument("--scorer-pool", choices=SCORER_POOLS, default=NatsConfig.scorer_pool)
    parser.add_argument("--no-rope", action="store_true",
                        help="no rotary embedding on the softmax heads (the CI routing "
                        "test has one)")
    parser.add_argument("--steps", type=int, default=600,
                        help="training steps (the CI routing test's: 600)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print("| training | " + " | ".join(f"seed {s}" for s in args.seeds)
          + " | mean +- std | pairs' chunk / others to softmax |")
    print("|---" * (len(args.seeds) + 3) + "|")
    for mode in args.modes:
        got = [run(mode, seed, args.softmax_qkv, not args.no_rope, args.steps, args.scorer_pool)
               for seed in args.seeds]
        for seed, m in zip(args.seeds, got, strict=True):
            print(json.dumps({"mode": mode, "seed": seed, **m}), flush=True)
        acc = [m["eval/acc"] for m in got]
        spread = f"{statistics.mean(acc):.3f} +- {statistics.stdev(acc):.3f}" \
            if len(acc) > 1 else f"{acc[0]:.3f}"
        routed = [(m.get("eval/route_informative", 0.0), m.get("eval/route_filler", 0.0))
                  for m in got]
        print(f"| {mode} | " + " | ".join(f"{a:.3f}" for a in acc) + f" | {spread} | "
              + ", ".join(f"{i:.2f} / {f:.2f}" for i, f in routed) + " |", flush=True)


if __name__ == "__main__":
    main()
