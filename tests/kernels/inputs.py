"""Random inputs for the reference-operator tests, and the error measure they use."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Literal

import torch
import torch.nn.functional as F

from nats.kernels import LINEAR, SOFTMAX, num_chunks

CUDA = torch.cuda.is_available()
"""Kernel tests run at GPU shapes on CUDA and at interpreter shapes otherwise."""
DEVICE = "cuda" if CUDA else "cpu"

RouteKind = Literal["softmax", "linear", "random"]
ROUTE_KINDS: tuple[RouteKind, ...] = ("softmax", "linear", "random")

ORACLE_CASES = [(1, 16), (17, 16), (37, 16), (70, 32), (130, 32), (70, 64), (130, 64),
                (37, 128), (130, 128), (17, 256), (261, 256)]
"""(T, chunk size) against the oracles: every T odd, every chunk size, one chunk or several."""

F64 = {"rtol": 1e-10, "atol": 1e-10}
"""Tolerance of float64 comparisons."""


def make_routes(batch: int, seq_len: int, chunk_size: int, heads: int, kind: RouteKind,
                dtype: torch.dtype = torch.float64, seed: int = 0) -> torch.Tensor:
    """One-hot routes ``[B, N, H, 2]``: every chunk softmax, every chunk linear, or random."""
    shape = (batch, num_chunks(seq_len, chunk_size), heads)
    if kind == "random":
        choice = torch.randint(0, 2, shape, generator=torch.Generator().manual_seed(seed))
    else:
        choice = torch.full(shape, SOFTMAX if kind == "softmax" else LINEAR)
    return F.one_hot(choice, 2).to(dtype)


def softmax_inputs(batch: int, seq_len: int, heads: int, dim: int,
                   dtype: torch.dtype = torch.float64, seed: int = 0,
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``q, k, v`` of shape ``[B, T, heads, dim]``."""
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(batch, seq_len, heads, dim, generator=gen, dtype=dtype)
                 for _ in range(3))


def gdr_inputs(batch: int, seq_len: int, heads: int, d_k: int, d_v: int,
               dtype: torch.dtype = torch.float64, seed: int = 0) -> dict[str, torch.Tensor]:
    """Inputs of the gated delta rule as the layer produces them.

    q and k are L2-normalised, ``g = logsigmoid(.)`` is a log decay (mostly mild, so the
    state carries information across chunks), beta lies in (0, 1), and the initial
    state is random.
    """
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=dtype)

    return {
        "q": F.normalize(randn(batch, seq_len, heads, d_k), dim=-1),
        "k": F.normalize(randn(batch, seq_len, heads, d_k), dim=-1),
        "v": randn(batch, seq_len, heads, d_v),
        "g": F.logsigmoid(randn(batch, seq_len, heads) + 3),
        "beta": torch.sigmoid(randn(batch, seq_len, heads)),
        "initial_state": randn(batch, heads, d_k, d_v),
    }


def rel_rms_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """``rms(actual - expected) / rms(expected)`` in float64 (0 where both are all zero)."""
    actual, expected = actual.double(), expected.double()
    rms = expected.square().mean().sqrt().clamp_min(torch.finfo(torch.float64).tiny)
    return ((actual - expected).square().mean().sqrt() / rms).item()


def check(got: torch.Tensor, want: torch.Tensor, tol: float, name: str) -> None:
    """Relative RMS error within ``tol``; where the expected tensor is all zero (a selected
    route gradient with no chunk of that kind, a zero final state), exactly zero."""
    if not want.any():
        assert not got.any(), name
        return
    err = rel_rms_error(got, want)
    if os.environ.get("NATS_PRINT_ERRORS"):  # for reports: ``pytest -s`` with it set
        print(f"{name}: relative RMS error {err:.2e} (tolerance {tol:.0e})")
    assert err <= tol, f"{name}: relative RMS error {err:.2e}"


def routes_with_softmax_fraction(batch: int, n_chunks: int, heads: int, frac: float,
                                 seed: int = 0) -> torch.Tensor:
    """Each chunk softmax with probability ``frac``, independently."""
    gen = torch.Generator().manual_seed(seed)
    choice = (torch.rand(batch, n_chunks, heads, generator=gen) >= frac).long()
    return F.one_hot(choice, 2).float()  # index 1 (linear) where the draw exceeds frac


def grads(outputs: tuple[torch.Tensor, ...], inputs: tuple[torch.Tensor, ...],
          seed: int = 1) -> tuple[torch.Tensor, ...]:
    """Gradients w.r.t. ``inputs`` of ``sum_i <outputs_i, c_i>``, ``c_i`` seeded random.

    Two computations of the same outputs get the same cotangents, so their gradients
    can be compared entry by entry. An input the outputs do not depend on gets zeros.
    """
    gen = torch.Generator().manual_seed(seed)
    cotangents = tuple(torch.randn(o.shape, generator=gen, dtype=torch.float64).to(o.dtype)
                       for o in outputs)
    return torch.autograd.grad(outputs, inputs, cotangents, allow_unused=True,
                               materialize_grads=True)


@contextmanager
def single_threaded() -> Iterator[None]:
    """Run torch on one thread: these tensors are tiny, and idle intra-op threads
    spinning on a busy machine made the oracle loops several times slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
