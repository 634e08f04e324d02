"""The two branches on two CUDA streams give exactly what they give one after the other.

A stress test: a kernel whose result depends on what else runs on the GPU, or a missing
stream wait, shows only now and then, so every shape runs many times, with each launch
config of the softmax dk/dv kernel in turn (a pipelined config of it gave a key gradient
that changed under the side stream's load), and compares bit for bit. The gate and route
gradients are summed with atomics in the linear branch's backward, so they may differ in
the last bits between runs; they are compared at 1e-6.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from nats.kernels import hybrid_gated_delta_rule, hybrid_softmax_attention
from nats.kernels.bench import BenchShape, make_inputs, random_routes
from nats.kernels.streams import concurrently

pytestmark = pytest.mark.gpu

ITERATIONS = 30
NAMES = ("o_sm", "o_lin", "q_sm", "k_sm", "v_sm", "q_lin", "k_lin", "v_lin", "g", "beta",
         "routes")
ATOMIC = {"g", "routes"}


def _dkdv_configs() -> list[object]:
    from nats.kernels.triton.softmax_attention import _attn_bwd_dkdv
    return list(_attn_bwd_dkdv.configs)


@pytest.fixture
def one_dkdv_config(request: pytest.FixtureRequest) -> Iterator[None]:
    """Pin the dk/dv kernel's autotuner to one config for the test, then restore it."""
    from nats.kernels.triton.softmax_attention import _attn_bwd_dkdv
    saved = _attn_bwd_dkdv.configs
    _attn_bwd_dkdv.configs = [saved[request.param]]
    _attn_bwd_dkdv.cache.clear()
    yield
    _attn_bwd_dkdv.configs = saved
    _attn_bwd_dkdv.cache.clear()


@pytest.mark.parametrize("one_dkdv_config", range(len(_dkdv_configs())), indirect=True)
@pytest.mark.parametrize(("seq_len", "fraction", "chunk"),
                         [(8192, 0.25, 64), (2048, 0.5, 64), (4096, 0.125, 32)])
@pytest.mark.usefixtures("one_dkdv_config")
def test_concurrent_branches_equal_sequential(seq_len: int, fraction: float,
                                              chunk: int) -> None:
    shape = BenchShape(tokens=2 * seq_len, seq_lens=(seq_len,), chunk_size=chunk)
    device = torch.device("cuda")
    sm, lin, g, beta, gen = make_inputs(shape, seq_len, device)
    leaves = [t.requires_grad_() for t in (*sm, *lin, g, beta)]
    routes = random_routes(2, seq_len // chunk, shape.heads, fraction, device, gen)
    routes.requires_grad_()

    def softmax() -> torch.Tensor:
        return hybrid_softmax_attention(*sm, routes, chunk, backend="triton")

    def linear() -> torch.Tensor:
        return hybrid_gated_delta_rule(*lin, g, beta, routes, chunk, backend="triton")[0]

    def run(outputs: tuple[torch.Tensor, torch.Tensor]) -> list[torch.Tensor]:
        torch.autograd.backward(outputs, grads)
        result = [o.detach().clone() for o in outputs]
        for t in (*leaves, routes):
            result.append(t.grad.clone())
            t.grad = None
        return result

    grads = [torch.randn_like(o) for o in (softmax(), linear())]
    expected = run((softmax(), linear()))
    mismatches = []
    for i in range(ITERATIONS):
        got = run(concurrently(softmax, linear, device))
        for name, a, b in zip(NAMES, got, expected, strict=True):
            if name in ATOMIC:
                err = ((a - b).norm() / b.norm()).item()
                if err > 1e-6:
                    mismatches.append(f"run {i}: {name} relative error {err:.1e}")
            elif not torch.equal(a, b):
                rows = (a != b).flatten(2).any(-1).sum().item()
                mismatches.append(f"run {i}: {name} differs in {rows} token rows")
    assert not mismatches, "; ".join(mismatches[:8])
