"""The two branches on two CUDA streams give what they give one after the other."""

from __future__ import annotations

import pytest
import torch

from nats.kernels import hybrid_gated_delta_rule, hybrid_softmax_attention
from nats.kernels.bench import BenchShape, make_inputs, random_routes
from nats.kernels.streams import concurrently

pytestmark = pytest.mark.gpu


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def test_concurrent_branches_equal_sequential_forward_and_gradients() -> None:
    """Repeated many times with nothing between the calls, so that memory the allocator
    hands back early, or a missing stream wait, would show as changed values."""
    shape = BenchShape(tokens=16384, seq_lens=(8192,))
    device = torch.device("cuda")
    sm, lin, g, beta, gen = make_inputs(shape, 8192, device)
    leaves = [t.requires_grad_() for t in (*sm, *lin, g, beta)]
    routes = random_routes(2, 8192 // shape.chunk_size, shape.heads, 0.25, device, gen)
    routes.requires_grad_()

    def softmax() -> torch.Tensor:
        return hybrid_softmax_attention(*sm, routes, shape.chunk_size, backend="triton")

    def linear() -> torch.Tensor:
        return hybrid_gated_delta_rule(*lin, g, beta, routes, shape.chunk_size,
                                       backend="triton")[0]

    def run(outputs: tuple[torch.Tensor, torch.Tensor]) -> list[torch.Tensor]:
        torch.autograd.backward(outputs, grads)
        result = [o.detach().clone() for o in outputs]
        for t in (*leaves, routes):
            result.append(t.grad.clone())
            t.grad = None
        return result

    grads = [torch.randn_like(o) for o in (softmax(), linear())]
    expected = run((softmax(), linear()))
    for _ in range(20):
        got = run(concurrently(softmax, linear, device))
        for a, b in zip(got, expected, strict=True):
            assert rel_err(a, b) < 1e-5
