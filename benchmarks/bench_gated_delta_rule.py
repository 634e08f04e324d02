"""Time the Triton hybrid gated delta rule against SDPA causal (run by hand on a GPU).

``python benchmarks/bench_gated_delta_rule.py``: bf16, B*T = 65,536 tokens, 16 linear
heads of 128 against SDPA over 32 softmax heads of 64, chunk 64, forward and
forward+backward (ms, triton.testing.do_bench). First prints the relative RMS errors of
one realistic case against the float32 reference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from triton.testing import do_bench

from nats.kernels import num_chunks
from nats.kernels import reference as ref
from nats.kernels.bench import BenchShape
from nats.kernels.triton.gated_delta_rule import hybrid_gated_delta_rule

SHAPE = BenchShape()
"""The registry's shape (``nats bench kernels``): tokens, linear heads and width, chunk."""
TOKENS, HEADS, DIM, CHUNK = SHAPE.tokens, SHAPE.heads, SHAPE.head_dim_linear, SHAPE.chunk_size
NAMES = ("q", "k", "v", "g", "beta", "h0")


def inputs(batch: int, seq_len: int, frac: float, seed: int = 0) -> list[torch.Tensor]:
    """q, k, v (bf16), g, beta, h0 (fp32) and routes with ``frac`` softmax chunks."""
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device="cuda")

    qkv = [F.normalize(randn(batch, seq_len, HEADS, DIM), dim=-1).bfloat16() for _ in range(2)]
    qkv.append(randn(batch, seq_len, HEADS, DIM).bfloat16())
    g = F.logsigmoid(randn(batch, seq_len, HEADS) + 3)
    beta = torch.sigmoid(randn(batch, seq_len, HEADS))
    h0 = randn(batch, HEADS, DIM, DIM)
    n = num_chunks(seq_len, CHUNK)
    linear = (torch.rand(batch, n, HEADS, generator=gen, device="cuda") >= frac).long()
    return [*qkv, g, beta, h0, F.one_hot(linear, 2).float()]


def errors(batch: int, seq_len: int) -> None:
    *x, routes = inputs(batch, seq_len, 0.25)
    tri = [t.detach().clone().requires_grad_() for t in (*x, routes)]
    fp32 = [t.detach().float().requires_grad_() for t in (*x, routes)]
    outs = []
    for fn, args in ((hybrid_gated_delta_rule, tri), (ref.hybrid_gated_delta_rule, fp32)):
        o, s = fn(*args[:5], args[6], CHUNK, None, args[5], True)
        gen = torch.Generator(device="cuda").manual_seed(1)
        do, ds = (torch.randn(t.shape, generator=gen, device="cuda") for t in (o, s))
        outs.append((o, s, *torch.autograd.grad((o, s), args, (do.to(o.dtype), ds))))
    report = []
    for name, a, b in zip(("o", "state", *NAMES, "routes"), *outs, strict=True):
        a, b = a.double(), b.double()
        report.append(f"{name} {((a - b).norm() / b.norm()).item():.2e}")
    print(f"B={batch} T={seq_len} H={HEADS} D={DIM} C={CHUNK} bf16 vs fp32 reference:",
          ", ".join(report))


def time_ms(fn) -> float:
    return do_bench(fn, warmup=25, rep=100)


def sdpa_times(batch: int, seq_len: int) -> tuple[float, float]:
    """SDPA causal over the 32 softmax heads of 64: forward, forward+backward (ms)."""
    q, k, v = (torch.randn(batch, 2 * HEADS, seq_len, DIM // 2, device="cuda",
                           dtype=torch.bfloat16, requires_grad=True) for _ in range(3))

    def fwd() -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    do = torch.randn_like(fwd())
    return time_ms(fwd), time_ms(lambda: torch.autograd.grad(fwd(), (q, k, v), do))


def gdr_times(batch: int, seq_len: int, frac: float) -> tuple[float, float]:
    """The hybrid gated delta rule: forward, forward+backward (ms)."""
    *x, routes = inputs(batch, seq_len, frac)
    x = [t.requires_grad_() for t in x]
    do = torch.randn(batch, seq_len, HEADS, DIM, device="cuda", dtype=torch.bfloat16)

    def fwd() -> torch.Tensor:
        return hybrid_gated_delta_rule(*x[:5], routes, CHUNK, None, x[5])[0]

    return time_ms(fwd), time_ms(lambda: torch.autograd.grad(fwd(), x, do))


def main() -> None:
    errors(2, 8192)
    print(f"{torch.cuda.get_device_name()}: ms, and ratios to SDPA causal")
    print("T      frac  gdr fwd  gdr f+b  sdpa fwd  sdpa f+b  ratio fwd  ratio f+b")
    for seq_len in (8192, 32768):
        batch = TOKENS // seq_len
        sdpa_f, sdpa_fb = sdpa_times(batch, seq_len)
        for frac in (0.0, 0.25):
            f, fb = gdr_times(batch, seq_len, frac)
            print(f"{seq_len:<6} {frac:<5} {f:7.2f}  {fb:7.2f}  {sdpa_f:8.2f}  {sdpa_fb:8.2f}"
                  f"  {f / sdpa_f:9.2f}  {fb / sdpa_fb:9.2f}")


if __name__ == "__main__":
    main()
