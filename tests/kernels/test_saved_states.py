"""Saving the forward's states for the backward (``SAVE_STATES``) against recomputing them.

The reference tests run the default (saved); here both settings run on the same inputs
and must give the same outputs and gradients, so the recomputing path stays checked.
Interpreted on tiny shapes without a GPU, bf16 at a realistic shape with one.
"""

from __future__ import annotations

import pytest
import torch

from nats.kernels import num_chunks
from nats.kernels.triton import gated_delta_rule
from nats.kernels.triton.gated_delta_rule import hybrid_gated_delta_rule
from nats.kernels.triton.gated_linear_attention import hybrid_gated_linear_attention

from .inputs import CUDA, DEVICE, check, gdr_inputs, routes_with_softmax_fraction

pytestmark = pytest.mark.usefixtures("poison_outputs")

# batch, T, heads, Dk = Dv, chunk, dtype
SHAPE = (2, 4001, 8, 128, 128, torch.bfloat16) if CUDA else (2, 45, 2, 16, 32, torch.float16)


def _run(op: str, leaves: list[torch.Tensor], chunk: int, cot: torch.Tensor,
         ) -> tuple[torch.Tensor, ...]:
    q, k, v, g, beta, h0, routes = leaves
    if op == "gdr":
        o, state = hybrid_gated_delta_rule(q, k, v, g, beta, routes, chunk, None, h0, True,
                                           route_grad="both")
        wrt = leaves
    else:
        o, state = hybrid_gated_linear_attention(q, k, v, g, routes, chunk, None, h0, True,
                                                 route_grad="both")
        wrt = [q, k, v, g, h0, routes]
    return (o, state, *torch.autograd.grad((o, state), wrt, (cot, torch.ones_like(state))))


@pytest.mark.parametrize("op", ["gdr", "gla"])
def test_saved_states_equal_recomputed(monkeypatch: pytest.MonkeyPatch, op: str) -> None:
    batch, seq_len, heads, dim, chunk, dtype = SHAPE
    x = gdr_inputs(batch, seq_len, heads, dim, dim, dtype=torch.float32, seed=11)
    routes = routes_with_softmax_fraction(batch, num_chunks(seq_len, chunk), heads, 0.5)
    inputs = [x[n].to(DEVICE, dtype) for n in ("q", "k", "v")]
    inputs += [x[n].to(DEVICE) for n in ("g", "beta", "initial_state")] + [routes.to(DEVICE)]
    gen = torch.Generator().manual_seed(3)
    cot = torch.randn(batch, seq_len, heads, dim, generator=gen).to(DEVICE, dtype)
    runs = []
    for save in (True, False):
        monkeypatch.setattr(gated_delta_rule, "SAVE_STATES", save)
        runs.append(_run(op, [t.clone().requires_grad_() for t in inputs], chunk, cot))
    for i, (saved, recomputed) in enumerate(zip(*runs, strict=True)):
        # The route gradient sums float32 atomics in no fixed order; the rest repeats exactly.
        check(saved, recomputed, 1e-5, f"{op} result {i}")
