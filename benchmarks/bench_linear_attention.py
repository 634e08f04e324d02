"""Time the Triton linear operators side by side (run by hand on a GPU).

``python benchmarks/bench_linear_attention.py``: bf16, B*T = 65,536 tokens, 16 heads of
128, chunk 64, 25 % softmax routes; forward and forward+backward (ms, do_bench medians) of
the gated delta rule, DeltaNet (the same op at g = 0), gated linear attention and ELU+1
linear attention (gated linear attention at a value width of 129).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from triton.testing import do_bench

from nats.kernels import (
    hybrid_gated_delta_rule,
    hybrid_gated_linear_attention,
    hybrid_linear_attention,
    num_chunks,
)
from nats.kernels.bench import BenchShape

SHAPE = BenchShape()
"""The registry's shape (``nats bench kernels``): tokens, linear heads and width, chunk."""
TOKENS, HEADS, DIM, CHUNK = SHAPE.tokens, SHAPE.heads, SHAPE.head_dim_linear, SHAPE.chunk_size
FRAC = 0.25


def operators(routes: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              g: torch.Tensor, beta: torch.Tensor) -> dict[str, tuple]:
    """Each operator as (function of its differentiable inputs, those inputs)."""
    no_decay = torch.zeros_like(g)
    return {
        "gated_deltanet": (lambda x: hybrid_gated_delta_rule(*x, routes, CHUNK)[0],
                           [q, k, v, g, beta]),
        "deltanet": (lambda x: hybrid_gated_delta_rule(*x[:3], no_decay, x[3], routes,
                                                       CHUNK)[0], [q, k, v, beta]),
        "gated_linear_attention": (lambda x: hybrid_gated_linear_attention(
            *x, routes, CHUNK)[0], [q, k, v, g]),
        "linear_attention": (lambda x: hybrid_linear_attention(*x, routes, CHUNK)[0],
                             [q, k, v]),
    }


def main() -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device="cuda")

    print(f"{torch.cuda.get_device_name()}: bf16, {TOKENS} tokens, H={HEADS}, D={DIM}, "
          f"chunk {CHUNK}, {FRAC:.0%} softmax chunks; ms (fwd, fwd+bwd)")
    for seq_len in (8192, 32768):
        batch = TOKENS // seq_len
        q, k = (F.normalize(randn(batch, seq_len, HEADS, DIM), dim=-1).bfloat16()
                for _ in range(2))
        v = randn(batch, seq_len, HEADS, DIM).bfloat16()
        g = F.logsigmoid(randn(batch, seq_len, HEADS) + 3)
        beta = torch.sigmoid(randn(batch, seq_len, HEADS))
        linear = torch.rand(batch, num_chunks(seq_len, CHUNK), HEADS, generator=gen,
                            device="cuda") >= FRAC
        routes = F.one_hot(linear.long(), 2).float()
        for name, (fn, args) in operators(routes, q, k, v, g, beta).items():
            leaves = [t.detach().clone().requires_grad_() for t in args]
            do = torch.randn_like(v)
            fwd = do_bench(lambda fn=fn, leaves=leaves: fn(leaves), warmup=25, rep=100)
            fb = do_bench(lambda fn=fn, leaves=leaves, do=do: torch.autograd.grad(
                fn(leaves), leaves, do), warmup=25, rep=100)
            print(f"T={seq_len:<6} {name:<24} {fwd:6.2f} {fb:7.2f}")


if __name__ == "__main__":
    main()
