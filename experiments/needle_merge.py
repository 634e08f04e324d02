"""Why the NAtS-L layer learns the needle less often than a softmax layer: its merge, row by row.

    python experiments/needle_merge.py --seeds 0 1 2 3 4          # ~1 min a run, one thread
    python experiments/needle_merge.py --rows routed routed-detach-half --jobs 2
    python experiments/needle_merge.py --scale gpu --device cuda --rows forced own-qkv --jobs 6

The needle's CPU scale (``needle.py --scale cpu``: 2 layers of width 64, chunk 16, trained
at 128 bytes on text haystacks with one distractor, 1,200 steps of batch 16, lr 1e-2), or
with ``--scale gpu`` its GPU scale (4 layers of width 128, chunk 64, 1,024 bytes, 1,500 steps
of batch 32, lr 1e-2). Validation is at the training length.
Rows, each a model of that scale's layers:

* ``softmax``: two plain softmax layers (the transformer);
* ``forced``: two NAtS-L layers, every route forced to softmax, the default merge
  ``W_o(gamma (w_LA N(o_LA) + w_SM N(o_SM)))``;
* ``direct``: ``forced`` with the merge replaced by ``W_o(gamma o_SM)`` (given equal
  weights, exactly the softmax layer);
* ``normed``: ``W_o(gamma N(o_SM))``, the softmax branch alone with its RMSNorm;
* ``half``: ``W_o(gamma (N(o_LA) + N(o_SM)) / 2)``, both branches at fixed weights;
* ``detach``: ``forced`` with the linear branch's output detached in the merge: the same
  forward, but no gradient reaches the shared q/k/v projection, the convolution and the
  gates through the linear branch;
* ``routed``: two NAtS-L layers with their routers (the default budget, 0.25);
* ``routed-detach``, ``routed-detach-half``: ``routed`` with the linear branch detached as
  in ``detach``, for the whole run or its first half;
* ``own-qk``, ``routed-own-qk``: ``forced`` and ``routed`` with the softmax branch's q and
  k from a projection of its own (``SiLU(conv(W x))`` like the shared one), so that the
  linear branch's gradient cannot reach them; v stays shared;
* ``own-qkv``, ``routed-own-qkv``: ``own-qk`` and ``routed-own-qk`` with v from that
  projection too;
* ``routed-own-qkv-anneal``: ``routed-own-qkv`` with the budget annealed from 1 over the
  first half (``budget_anneal=0.5``): the softmax branch learns on every chunk first.
* ``routed-plus-qkv``: ``routed`` with the softmax branch's q, k, v the shared ones plus
  its own projection's (its convolution started at zero): the softmax gradient still
  trains the shared projection, and the softmax branch can move away from what the linear
  branch pulls it to.

Prints a JSON line per run (validation loss, digit and whole-answer accuracy, the share
of routable chunks on softmax and how much more often the needle's chunks go there than
filler's) and writes them all to ``--out``/results.json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import common
import needle
import torch
import torch.nn.functional as F

import nats.trainers.loop as loop
from nats.layers import nats_attention
from nats.layers.norms import upcast
from nats.layers.projections import QKVProjection
from nats.trainers import TrainConfig

Merge = Callable[..., torch.Tensor]
DEFAULT_MERGE: Merge = nats_attention.NatsAttention._merge


def _heads(o: torch.Tensor, self: nats_attention.NatsAttention, x: torch.Tensor) -> torch.Tensor:
    return o.reshape(*x.shape[:2], -1, self.cfg.softmax_head_dim_v)


def _rms(o: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(upcast(o), (o.shape[-1],), eps=eps)


def _direct(self, q, o_la, o_sm, x):
    return self.out(_heads(o_sm, self, x).float(), x)


def _normed(self, q, o_la, o_sm, x):
    return self.out(_heads(_rms(o_sm, self.cfg.norm_eps), self, x), x)


def _half(self, q, o_la, o_sm, x):
    eps = self.cfg.norm_eps
    merged = 0.5 * _rms(o_la.reshape(o_sm.shape), eps) + 0.5 * _rms(o_sm, eps)
    return self.out(_heads(merged, self, x), x)


def _detached_until(last_step: int | None) -> tuple[Merge, Callable]:
    """A merge that detaches the linear branch while training up to ``last_step`` (``None``:
    the whole run), and the trainer hook that counts the steps for it."""
    steps = [0]

    def merge(self, q, o_la, o_sm, x):
        if self.training and (last_step is None or steps[0] <= last_step):
            o_la = o_la.detach()
        return DEFAULT_MERGE(self, q, o_la, o_sm, x)

    original = loop.set_exploration

    def set_exploration(model, noise):  # the trainer calls it once before every step
        steps[0] += 1
        original(model, noise)

    return merge, set_exploration


def _own_projection_layer(with_v: bool, added: bool = False) -> dict[str, Callable]:
    """``NatsAttention`` methods whose softmax heads read q, k (and with ``with_v`` v) from
    their own projection; with ``added``, the shared ones plus their own (its convolution
    starting at zero, so the model starts as the shared one)."""
    cls = nats_attention.NatsAttention
    init, forward, heads = cls.__init__, cls.forward, cls._softmax_heads

    def own_init(self, cfg):
        init(self, cfg)
        dim = cfg.n_heads * cfg.head_dim_k
        dims = (dim, dim, cfg.n_heads * cfg.head_dim_v) if with_v else (dim, dim)
        self.softmax_qk = QKVProjection(cfg.d_model, dims, cfg.conv_size)
        if added:  # the convolution: the model's init redraws every Linear weight
            torch.nn.init.zeros_(self.softmax_qk.conv.weight)

    def own_forward(self, x):
        self.own_qk = self.softmax_qk(x)
        return forward(self, x)

    def own_heads(self, qkv, start):
        if added:
            own = zip(qkv[-3:], self.own_qk, strict=True)
            return heads(self, tuple(a + b for a, b in own), start)
        return heads(self, self.own_qk if with_v else (*self.own_qk, qkv[2]), start)

    return {"__init__": own_init, "forward": own_forward, "_softmax_heads": own_heads,
            "_shares_qk_norms": lambda self: False}


ROWS = ("softmax", "forced", "direct", "normed", "half", "detach", "routed", "routed-detach",
        "routed-detach-half", "own-qk", "own-qkv", "routed-own-qk", "routed-own-qkv",
        "routed-own-qkv-anneal", "routed-plus-qkv")
SCALES = ("cpu", "gpu")


def config(seed: int, layer: str, out: Path, scale: str = "cpu",
           device: str = "cpu") -> TrainConfig:
    """The needle at ``scale`` and lr 1e-2, every layer ``layer``; validated on 4 batches
    (the grid's 2 leave its rows too few to tell partial answers apart)."""
    # The needle as these rows' results were measured (docs/RESULTS.md): RoPE on, and the
    # GPU scale at 1,500 steps; needle.py itself now trains without RoPE, 3,000 GPU steps.
    measured = {"steps": 1500} if scale == "gpu" else {}
    base = needle.base_config({**needle.SCALES[scale], **measured})
    model = base.model.replace(layer_types=(layer,) * base.model.n_layers, rope=True)
    # Eager steps: a row's patched Python (one counts steps) must run at every step, which
    # a step replayed from a CUDA graph would not do.
    return base.replace(model=model,
                        eval_batches=4, log_interval=100, lr=1e-2, seed=seed,
                        out_dir=str(out), device=device, cuda_graph=False)


@contextlib.contextmanager
def _row_patches(row: str, steps: int) -> Iterator[None]:
    merge: Merge | None = {"direct": _direct, "normed": _normed, "half": _half}.get(row)
    hook = None
    if row in ("detach", "routed-detach", "routed-detach-half"):
        merge, hook = _detached_until(steps // 2 if row == "routed-detach-half" else None)
    original_hook = loop.set_exploration
    cls = nats_attention.NatsAttention
    original_methods = {name: getattr(cls, name) for name in ("__init__", "forward",
                                                              "_softmax_heads",
                                                              "_shares_qk_norms")}
    if "own-qk" in row or "plus-qkv" in row:
        for name, method in _own_projection_layer("qkv" in row, "plus" in row).items():
            setattr(cls, name, method)
    if merge is not None:
        nats_attention.NatsAttention._merge = merge
    if hook is not None:
        loop.set_exploration = hook
    try:
        with common.routes_forced("none" if row == "softmax" or row.startswith("routed")
                                  else "softmax"):
            yield
    finally:
        nats_attention.NatsAttention._merge = DEFAULT_MERGE
        loop.set_exploration = original_hook
        for name, method in original_methods.items():
            setattr(cls, name, method)


def run(row: str, seed: int, out: Path, scale: str = "cpu",
        device: str = "cpu") -> dict[str, Any]:
    torch.set_num_threads(1)
    folder = out / f"{row}-seed{seed}"
    cfg = config(seed, "softmax" if row == "softmax" else "nats", folder, scale, device)
    if row.endswith("anneal"):
        cfg = cfg.replace(budget_anneal=0.5)
    with common._console_to(folder.with_suffix(".log")), _row_patches(row, cfg.steps):
        metrics = common.train_row(cfg)
    return {"row": row, "seed": seed, "scale": scale, "loss": metrics["eval/loss"],
            "digits": metrics["eval/acc"], "answers": metrics["eval/seq_acc"],
            "route_share": metrics.get("eval/route_frac"),
            "needle_lift": metrics.get("eval/route_lift")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--rows", nargs="+", choices=ROWS, default=list(ROWS))
    parser.add_argument("--jobs", type=int, default=1, help="runs at once, a process each")
    parser.add_argument("--scale", choices=SCALES, default="cpu")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    parser.add_argument("--out", type=Path, default=Path("runs/needle-merge"))
    args = parser.parse_args()
    cells = [(row, seed) for row in args.rows for seed in args.seeds]
    results = []
    with common._executor(args.jobs) as pool:
        futures = [pool.submit(run, row, seed, args.out, args.scale, args.device)
                   for row, seed in cells]
        for future in futures:
            results.append(future.result())
            print(json.dumps(results[-1]), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
