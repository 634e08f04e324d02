"""Where the mixed operator's time goes, kernel by kernel (run by hand on a GPU; no pytest):
``python benchmarks/profile_mixed_operator.py [T:FRACTION ...]`` (default ``32768:0.25
32768:1``).

For each cell of ``nats bench kernels``' shape it runs the softmax side alone and the
whole operator on its two streams, forward and forward+backward, under the PyTorch
profiler, and prints every CUDA kernel's total time, the sum over kernels and the wall
time of the region, so launch gaps, small helper ops and the streams' overlap show.
"""

from __future__ import annotations

import sys
from collections import defaultdict

import torch

from nats.kernels.bench import BenchShape, make_inputs, random_routes
from nats.kernels.ops import hybrid_gated_delta_rule, hybrid_softmax_attention
from nats.kernels.streams import concurrently

_LEAVES: list[torch.Tensor] = []


def _profile(name: str, fn, grads: list[torch.Tensor] | None) -> None:
    leaves = _LEAVES if grads is not None else []

    def run() -> None:
        for t in leaves:  # as nats bench kernels does: no accumulation into .grad
            t.grad = None
        outs = fn()
        if grads is not None:
            torch.autograd.backward(outs, grads)

    for _ in range(3):
        run()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        start.record()
        run()
        end.record()
        torch.cuda.synchronize()
    per_kernel: dict[str, float] = defaultdict(float)
    for e in prof.events():
        if e.device_type.name == "CUDA":
            per_kernel[e.name[:70]] += e.device_time / 1e3
    print(f"\n== {name}: wall {start.elapsed_time(end):.2f} ms, kernels "
          f"{sum(per_kernel.values()):.2f} ms")
    for kernel, ms in sorted(per_kernel.items(), key=lambda kv: -kv[1])[:14]:
        print(f"  {ms:8.3f}  {kernel}")


def profile_cell(shape: BenchShape, seq_len: int, fraction: float, device: torch.device,
                 ) -> None:
    sm, lin, g, beta, gen = make_inputs(shape, seq_len, device)
    _LEAVES[:] = [t.requires_grad_() for t in (*sm, *lin, g, beta)]
    c = shape.chunk_size
    routes = random_routes(sm[0].shape[0], seq_len // c, shape.heads, fraction, device, gen)

    def softmax() -> tuple[torch.Tensor, ...]:
        return (hybrid_softmax_attention(*sm, routes, c, backend="triton"),)

    def mixed() -> tuple[torch.Tensor, ...]:
        return concurrently(
            lambda: hybrid_softmax_attention(*sm, routes, c, backend="triton"),
            lambda: hybrid_gated_delta_rule(*lin, g, beta, routes, c, backend="triton")[0],
            device)

    for name, fn in (("softmax side", softmax), ("mixed, two streams", mixed)):
        grads = [torch.randn_like(o) for o in fn()]
        label = f"T={seq_len} softmax {fraction:g}: {name}"
        with torch.no_grad():
            _profile(label + ", forward", fn, None)
        _profile(label + ", forward+backward", fn, grads)


def main() -> None:
    cells = [a.split(":") for a in sys.argv[1:]] or [("32768", "0.25"), ("32768", "1")]
    for seq_len, fraction in cells:
        profile_cell(BenchShape(), int(seq_len), float(fraction), torch.device("cuda"))


if __name__ == "__main__":
    main()
