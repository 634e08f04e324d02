"""The q/k/v short convolution: the Triton operator against PyTorch's grouped ``conv1d``
(run by hand: ``python benchmarks/bench_short_conv.py [OUT.json]``).

``conv1d`` is the form the layers ran before the kernel, so the two columns are the
before and after of that change in one process. Each is timed as a layer uses it: forward
(no gradient) = the convolution and SiLU, then ``q`` split off and viewed as heads (for the
channels-first ``conv1d`` output that view is a transposing copy); forward+backward = the
convolution under bf16 autocast, forward and backward. CUDA events, median of 20.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F
from bench_train_cuda_graph import save

from nats.kernels import short_conv

SHAPES = [(1, 32768, 2304), (4, 4096, 2304), (1, 4096, 2304), (16, 2048, 2304)]
"""``[B, T, C]``: the benchmark model's q/k/v width (3 x 6 heads of 128) at the prefill
and training shapes of ``nats bench model``."""
HEADS, HEAD_DIM = 6, 128


def conv1d_silu(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The grouped-convolution form: channels first, left-padded, SiLU after."""
    k = weight.shape[-1]
    y = F.conv1d(F.pad(x.transpose(1, 2), (k - 1, 0)), weight[:, None], groups=weight.shape[0])
    return F.silu(y).transpose(1, 2)


FORMS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "conv1d": conv1d_silu, "triton": lambda x, w: short_conv(x, w, backend="triton")}


def median_ms(fn: Callable[[], object]) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(20):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def measure(shape: tuple[int, int, int], form: str) -> dict[str, float]:
    conv = FORMS[form]
    x = torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(shape[-1], 4, device="cuda") / 2
    dy = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    q_width = HEADS * HEAD_DIM

    def forward() -> torch.Tensor:
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
            q = conv(x, w)[..., :q_width]
            return q.reshape(*shape[:2], HEADS, HEAD_DIM)

    def forward_backward() -> None:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = conv(x, w)
        y.backward(dy)

    return {"fwd_ms": median_ms(forward), "fwd_bwd_ms": median_ms(forward_backward)}


def main(out: str | None) -> None:
    rows: list[dict[str, object]] = []
    for shape in SHAPES:
        row: dict[str, object] = {"shape": shape}
        for form in FORMS:
            row |= {f"{form}_{k}": v for k, v in measure(shape, form).items()}
        rows.append(row)
        print(json.dumps(row), flush=True)
    save(rows, out)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else None)
