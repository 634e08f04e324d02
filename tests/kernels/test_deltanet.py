"""DeltaNet is the gated delta rule with ``g = 0``: no operator of its own.

The GDR operators (reference and Triton) at ``g = 0`` are held, forward and backward, to
the delta rule written out here token by token, with NATSL.md's routes:
``S_t = S_{t-1} (I - b_t k_t k_t^T) + b_t v_t k_t^T`` in the ``[Dv, Dk]`` layout of the
DeltaNet paper, i.e. ``S_t = (I - b_t k_t k_t^T) S_{t-1} + b_t k_t v_t^T`` for our
``[Dk, Dv]`` state, ``o_t = scale S_t^T q_t``; every query runs on from its chunk-start
state, and a chunk's writes carry on only where it went to linear.
"""

from __future__ import annotations

import pytest
import torch

from nats.kernels import LINEAR, hybrid_gated_delta_rule
from nats.kernels.triton import utils

from .inputs import F64, check, gdr_inputs, grads, make_routes

NAMES = ("q", "k", "v", "beta", "initial_state", "routes")


def delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor,
               initial_state: torch.Tensor, routes: torch.Tensor, chunk_size: int,
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Routed DeltaNet, one token at a time, in float64."""
    q, k, v, beta, state, routes = (x.double() for x in (q, k, v, beta, initial_state, routes))
    scale = q.shape[-1] ** -0.5
    start, outs = state, []
    for t in range(q.shape[1]):
        k_t, b_t = k[:, t], beta[:, t, :, None, None]
        eye = torch.eye(k.shape[-1], dtype=k.dtype)
        state = (eye - b_t * k_t[..., :, None] * k_t[..., None, :]) @ state \
            + b_t * k_t[..., :, None] * v[:, t, :, None, :]
        outs.append(scale * (state * q[:, t, :, :, None]).sum(-2))
        if t % chunk_size == chunk_size - 1 or t == q.shape[1] - 1:
            w = routes[:, t // chunk_size, :, LINEAR][..., None, None]
            state = start = start + w * (state - start)
    return torch.stack(outs, 1), state


def run_gdr(x: dict[str, torch.Tensor], chunk_size: int, backend: str,
            route_grad: str = "both") -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.zeros(x["q"].shape[:3], device=x["q"].device)
    return hybrid_gated_delta_rule(x["q"], x["k"], x["v"], g, x["beta"], x["routes"],
                                   chunk_size, None, x["initial_state"], True,
                                   route_grad=route_grad, backend=backend)


def inputs(seq_len: int, chunk_size: int, d: int, dtype: torch.dtype,
           ) -> dict[str, torch.Tensor]:
    x = gdr_inputs(2, seq_len, 2, d, d, dtype=torch.float64, seed=seq_len)
    del x["g"]
    x = {n: t.to(dtype if n != "initial_state" else torch.float64) for n, t in x.items()}
    x["routes"] = make_routes(2, seq_len, chunk_size, 2, "random", seed=chunk_size)
    return x


@pytest.mark.parametrize(("seq_len", "chunk_size"), [(37, 16), (70, 32), (130, 64)])
def test_reference_gdr_at_zero_gate_is_deltanet(seq_len: int, chunk_size: int) -> None:
    x = {n: t.requires_grad_() for n, t in inputs(seq_len, chunk_size, 8, torch.float64).items()}
    out = run_gdr(x, chunk_size, "reference")
    expected = delta_rule(**x, chunk_size=chunk_size)
    torch.testing.assert_close(out, expected, **F64)
    wrt = tuple(x[n] for n in NAMES)
    for name, got, want in zip(NAMES, grads(out, wrt), grads(expected, wrt), strict=True):
        torch.testing.assert_close(got, want, **F64, msg=f"gradient of {name}")


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter shapes on the CPU")
@pytest.mark.parametrize(("seq_len", "chunk_size", "dtype"), [
    (37, 16, torch.float32), (70, 32, torch.float16), (150, 128, torch.float32)])
def test_triton_gdr_at_zero_gate_is_deltanet(monkeypatch: pytest.MonkeyPatch, seq_len: int,
                                             chunk_size: int, dtype: torch.dtype) -> None:
    monkeypatch.setattr(utils, "POISON_OUTPUTS", True)
    x = inputs(seq_len, chunk_size, 16, dtype)
    low = {n: t.to(torch.float32 if n in ("initial_state", "routes") else dtype)
           .requires_grad_() for n, t in x.items()}
    exact = {n: t.detach().double().requires_grad_() for n, t in low.items()}
    out = run_gdr(low, chunk_size, "triton")
    expected = delta_rule(**exact, chunk_size=chunk_size)
    check(out[0], expected[0], 5e-3, "o")
    check(out[1], expected[1], 5e-3, "final state")
    got = grads(out, tuple(low[n] for n in NAMES))
    want = grads(expected, tuple(exact[n] for n in NAMES))
    for name, g_got, g_want in zip(NAMES, got, want, strict=True):
        if name == "routes":
            g_got, g_want = g_got[..., LINEAR], g_want[..., LINEAR]
        check(g_got, g_want, 8e-3, f"d{name}")
