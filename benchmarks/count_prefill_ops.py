"""What one prefill dispatches on the host, per model form (no pytest):
``TRITON_INTERPRET=1 python benchmarks/count_prefill_ops.py [--length T] [--layers N]``
on a CPU, or ``python benchmarks/count_prefill_ops.py`` on a GPU.

The model of ``nats bench model`` (width 768, heads of 128, chunks of 64) with ``N`` layers
(default 2) as the transformer, the all-linear model and NAtS-L at forced softmax fractions
0 and 0.25, prefilled with ``T`` tokens (default 128) after one warm-up prefill: the PyTorch
operators dispatched (``TorchDispatchMode``, views included) and the Triton launches, in
total and the most frequent of each; then the operators that finish the cache after a
CUDA graph's replay (``prompt_cache(..., own=True)`` on the layers' pending caches, as
:class:`nats.cuda_graph.GraphedPrefill` runs it after each replay), and how many of them
read a tensor's value to the host (on a GPU, each a wait for it). An eager prefill at
batch 1 is host-bound (docs/BENCHMARKS.md, "Prefill replayed from a CUDA graph"), a
graphed one's finish all host work, and these counts, not the CPU's speed, are what
carries over from a CPU to a GPU's host.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

FORMS = ("transformer", "all-linear", "nats@0", "nats@0.25")


class _Operators(TorchDispatchMode):
    """Counts every operator dispatched while it is active."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def _count_launches(launches: Counter[str]) -> None:
    """Count each Triton launch by kernel name; the interpreter's own tensor work (it runs
    a kernel with PyTorch on the CPU) is kept out of the operator count."""
    import triton.runtime.interpreter as interpreter
    import triton.runtime.jit as jit

    for cls in (jit.JITFunction, interpreter.InterpretedFunction):
        run = cls.run

        def counted(self, *args, _run=run, **kwargs):
            launches[getattr(self.fn, "__name__", None) or self.__name__] += 1
            with _disable_current_modes():
                return _run(self, *args, **kwargs)

        cls.run = counted


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    args = parser.parse_args()
    from nats.evaluation.model_bench import default_config, variants
    from nats.model import NatsForCausalLM

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    config = default_config("cuda", n_layers=args.layers, fractions=(0.0, 0.25),
                            layer_hybrid_shares=(1.0,), vocab_size=256)
    launches: Counter[str] = Counter()
    _count_launches(launches)
    for variant in (v for v in variants(config) if v.name in FORMS):
        cfg = dataclasses.replace(config.model_config(variant.layer_types), backend="triton")
        torch.manual_seed(0)
        # bf16 as the benchmark on a GPU; the interpreter has no bf16 products.
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        model = NatsForCausalLM(cfg).to(device, dtype).eval()
        model.set_route_override(variant.fraction)
        ids = torch.randint(0, cfg.vocab_size, (1, args.length), device=device)
        model.prefill(ids)  # compiles and tunes
        launches.clear()
        with _Operators() as operators:
            model.prefill(ids)
        ops = sum(operators.counts.values())
        print(f"{variant.name}: {ops} operators and {sum(launches.values())} Triton launches "
              f"({ops / args.layers:.0f} and {sum(launches.values()) / args.layers:.1f} a "
              f"layer, the embedding and head included)")
        print("  operators:", ", ".join(f"{k} {n}" for k, n in operators.counts.most_common(12)))
        print("  launches:", ", ".join(f"{k} {n}" for k, n in launches.most_common()))
        # What a graphed prefill's replay leaves to the host: the cache finished and copied
        # out of the graph's memory (nats.cuda_graph.GraphedPrefill).
        _, pending = model.prefill_compute(ids, finish=False)
        with _Operators() as finish:
            model.prompt_cache(pending, ids, own=True)
        ops = sum(finish.counts.values())
        print(f"  finish after a replay: {ops} operators ({ops / args.layers:.1f} a layer), "
              f"{finish.counts['aten._local_scalar_dense']} reads of a tensor's value:",
              ", ".join(f"{k} {n}" for k, n in finish.counts.most_common(8)))


if __name__ == "__main__":
    main()
