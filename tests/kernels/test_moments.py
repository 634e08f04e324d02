"""Running moments of the routing's statistics: the reference against numpy's mean and
variance, the Triton kernels against the reference (accumulation over strided views of a
layer's chunks, commits with and without a warm start, a commit of nothing, the sum over
processes given apart from the pending sums).

Under the interpreter on small shapes; on a GPU at a model's (768-wide pooled chunks of a
16k-token batch, a router's six heads).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from nats.kernels import moments_accumulate, moments_commit
from nats.kernels.reference import moments as reference
from nats.kernels.triton import moments as triton_moments

from .inputs import DEVICE


def on_gpu(cases: list[tuple]) -> list:
    """GPU-shape cases, marked so that the GPU gate (``-m gpu``) runs them."""
    return [pytest.param(*case, marks=pytest.mark.gpu) for case in cases]


def chunks(batch: int, n: int, channels: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Pooled chunks ``[B, N, C]`` with an offset per channel, as a layer's inputs have."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, n, channels, generator=gen) + torch.linspace(-3, 3, channels)
    return x.to(dtype).to(DEVICE)


def test_reference_commit_is_the_mean_and_variance() -> None:
    x = chunks(3, 9, 5, torch.float64, 0).cpu()
    pending = torch.zeros(11, dtype=torch.float64)
    reference.moments_accumulate(x[:, :-1], pending)
    mean, var = torch.zeros(5, dtype=torch.float64), torch.ones(5, dtype=torch.float64)
    commits = torch.zeros((), dtype=torch.float64)
    reference.moments_commit(pending, pending, mean, var, commits, 0.1)
    rows = x[:, :-1].reshape(-1, 5).numpy()
    np.testing.assert_allclose(mean.numpy(), rows.mean(0), rtol=1e-12)  # first commit: all of it
    np.testing.assert_allclose(var.numpy(), rows.var(0), rtol=1e-12)
    assert commits.item() == 1 and not pending.any()


ACCUMULATE_CASES = [
    # batch, chunks, channels, dtype, drop the last chunk (a strided view)
    (2, 7, 5, torch.float32, True),
    (1, 40, 130, torch.bfloat16, True),  # two column blocks, two row blocks
    (3, 1, 16, torch.float32, False),
    (2, 4, 6, torch.float16, False),
]
GPU_ACCUMULATE = [(16, 256, 768, torch.bfloat16, True), (1, 256, 1536, torch.float32, True)]


@pytest.mark.parametrize(("batch", "n", "channels", "dtype", "drop_last"),
                         ACCUMULATE_CASES + on_gpu(GPU_ACCUMULATE))
def test_accumulate_matches_reference(batch: int, n: int, channels: int, dtype: torch.dtype,
                                      drop_last: bool) -> None:
    x = chunks(batch, n, channels, dtype, batch + n)
    rows = x[:, :-1] if drop_last else x
    start = torch.rand(1 + 2 * channels, dtype=torch.float64, device=DEVICE) * 10
    want, got = start.clone(), start.clone()
    reference.moments_accumulate(rows, want)
    triton_moments.moments_accumulate(rows, got)
    triton_moments.moments_accumulate(rows, got)  # twice: sums add up
    reference.moments_accumulate(rows, want)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-9)
    assert got[0].item() == pytest.approx(start[0].item() + 2 * rows[..., 0].numel(), abs=1e-9)


COMMIT_CASES = [
    # channels, rows (0: nothing pending), warm start, momentum, sums apart from pending
    (5, 30, True, 0.1, False),
    (5, 30, False, 0.1, True),
    (130, 7, True, 0.05, False),
    (6, 0, True, 0.1, False),
    (6, 0, False, 0.1, True),
]
GPU_COMMIT = [(768, 4080, True, 0.1, False), (6, 4080, False, 0.1, True)]


@pytest.mark.parametrize(("channels", "n_rows", "warm", "momentum", "apart"),
                         COMMIT_CASES + on_gpu(GPU_COMMIT))
def test_commit_matches_reference(channels: int, n_rows: int, warm: bool, momentum: float,
                                  apart: bool) -> None:
    """Three commits in a row (a warm start's weight goes 1, 1/2, 1/3), each after the same
    rows were added; the running values, the commit count and the cleared sums."""
    x = chunks(1, max(n_rows, 1), channels, torch.float32, channels)[0, :n_rows]
    states = {}
    for name, impl in (("reference", reference), ("triton", triton_moments)):
        mean = torch.linspace(-1, 1, channels, device=DEVICE)
        var = torch.linspace(0.5, 2, channels, device=DEVICE)
        commits = torch.full((), 2.0, device=DEVICE) if warm else None
        pending = torch.zeros(1 + 2 * channels, dtype=torch.float64, device=DEVICE)
        for step in range(3):
            impl.moments_accumulate(x * (step + 1), pending)
            sums = pending * 2 if apart else pending  # as a sum over two processes
            impl.moments_commit(sums, pending, mean, var, commits, momentum)
            assert not pending.any(), name
        states[name] = (mean, var, commits)
    for got, want in zip(states["triton"], states["reference"], strict=True):
        if want is not None:
            torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-6)
    if n_rows == 0:  # nothing seen: nothing moved, no commit counted
        torch.testing.assert_close(states["triton"][0],
                                   torch.linspace(-1, 1, channels, device=DEVICE))
        if warm:
            assert states["triton"][2].item() == 2.0


def test_backend_choice_runs_the_reference_on_cpu_and_for_float64(monkeypatch) -> None:
    """``auto`` picks the kernels for CUDA tensors only, and never for float64 ones."""
    called: list[str] = []
    for module, name in ((reference, "reference"), (triton_moments, "triton")):
        monkeypatch.setattr(module, "moments_accumulate",
                            lambda x, p, name=name: called.append(name))
    x = torch.zeros(2, 3, dtype=torch.float64, device=DEVICE)
    moments_accumulate(x, torch.zeros(7, dtype=torch.float64, device=DEVICE))
    moments_accumulate(x.float(), torch.zeros(7, dtype=torch.float64, device=DEVICE))
    assert called == ["reference", "triton" if DEVICE == "cuda" else "reference"]
    mean, var = torch.zeros(3, device=DEVICE), torch.ones(3, device=DEVICE)
    sums = torch.zeros(7, dtype=torch.float64, device=DEVICE)
    moments_commit(sums, sums, mean, var, None, 0.1, backend="reference")
    assert mean.abs().sum().item() == 0 and var.sum().item() == 3
