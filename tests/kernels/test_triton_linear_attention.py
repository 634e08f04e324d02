"""Triton gated linear attention (and ELU+1 linear attention through it) against the
float32 reference, forward and backward.

Without a GPU the kernels run under ``TRITON_INTERPRET=1`` (see ``conftest.py``) on tiny
shapes in float32 and float16; with one, in bfloat16 at realistic shapes. Every kernel
output and gradient buffer starts as NaN, so an element a kernel fails to write shows.
Linear attention runs the kernels at a value width of ``Dv + 1`` (its normaliser column),
so these tests also cover widths that are not powers of two.
"""

from __future__ import annotations

import pytest
import torch

from nats.kernels import (
    LINEAR,
    SOFTMAX,
    hybrid_gated_linear_attention,
    hybrid_linear_attention,
    num_chunks,
)
from nats.kernels.triton import segments as segments_mod
from nats.kernels.triton.gated_linear_attention import (
    hybrid_gated_linear_attention as triton_gla,
)

from .inputs import CUDA, DEVICE, check, make_routes, routes_with_softmax_fraction
from .linear_inputs import gla_inputs, la_inputs

pytestmark = pytest.mark.usefixtures("poison_outputs")

HALF_INPUTS = ("q", "k", "v")
"""Inputs given to the kernel in the tested dtype; g and the state stay float32."""


def run(op: str, t: dict[str, torch.Tensor], routes: torch.Tensor, chunk: int, final: bool,
        route_grad: str, backend: str, cu_seqlens: torch.Tensor | None):
    common = dict(initial_state=t.get("initial_state"), output_final_state=final,
                  route_grad=route_grad, backend=backend, cu_seqlens=cu_seqlens)
    if op == "gla":
        return hybrid_gated_linear_attention(t["q"], t["k"], t["v"], t["g"], routes, chunk,
                                             **common)
    return hybrid_linear_attention(t["q"], t["k"], t["v"], routes, chunk, **common)


def compare(op: str, x: dict[str, torch.Tensor], routes: torch.Tensor, chunk: int,
            dtype: torch.dtype, route_grad: str, use_h0: bool, final: bool, out_tol: float,
            grad_tol: float, cu_seqlens: torch.Tensor | None = None) -> None:
    """The Triton backend (q, k, v in ``dtype``) and the float32 reference on the same
    values: outputs, final state and every gradient by relative RMS error."""
    names = [n for n in x if n != "initial_state" or use_h0]
    low = {n: (x[n].to(dtype) if n in HALF_INPUTS else x[n].float()).to(DEVICE) for n in names}
    ins = {n: t.detach().clone().requires_grad_() for n, t in low.items()}
    ref_ins = {n: t.detach().float().requires_grad_() for n, t in low.items()}
    routes = routes.float().to(DEVICE)
    r_tri, r_ref = routes.clone().requires_grad_(), routes.clone().requires_grad_()
    cu = None if cu_seqlens is None else cu_seqlens.to(DEVICE)

    o, state = run(op, ins, r_tri, chunk, final, route_grad, "triton", cu)
    o_ref, state_ref = run(op, ref_ins, r_ref, chunk, final, route_grad, "reference", cu)
    assert o.dtype == dtype and o.shape == o_ref.shape
    check(o, o_ref, out_tol, "o")
    outs, outs_ref = (o,), (o_ref,)
    if final:
        assert state.dtype == torch.float32 and state.shape == state_ref.shape
        check(state, state_ref, out_tol, "final state")
        outs, outs_ref = (o, state), (o_ref, state_ref)
    else:
        assert state is None
    gen = torch.Generator().manual_seed(7)
    cot = [torch.randn(t.shape, generator=gen).to(DEVICE) for t in outs_ref]
    grads = torch.autograd.grad(outs, [*ins.values(), r_tri],
                                [c.to(t.dtype) for c, t in zip(cot, outs, strict=True)])
    grads_ref = torch.autograd.grad(outs_ref, [*ref_ins.values(), r_ref], cot)
    for name, got, want in zip((*names, "routes"), grads, grads_ref, strict=True):
        assert got.dtype == low.get(name, routes).dtype, name
        if name == "routes":
            assert not got[..., SOFTMAX].any()
            got, want = got[..., LINEAR], want[..., LINEAR]
        check(got, want, grad_tol, f"d{name}")


def inputs(op: str, batch: int, seq_len: int, heads: int, d_k: int, d_v: int, seed: int,
           ) -> dict[str, torch.Tensor]:
    make = gla_inputs if op == "gla" else la_inputs
    return make(batch, seq_len, heads, d_k, d_v, dtype=torch.float32, seed=seed)


def test_strong_decay_in_a_partial_last_chunk_stays_finite() -> None:
    """See the gated delta rule's test of the same name: the shared decay mask."""
    x = inputs("gla", 1, 40, 2, 16, 16, seed=2)
    x["g"][:, 32:] = -25.0  # the tail's 8 tokens sum to -200
    routes = make_routes(1, 40, 16, 2, "random", dtype=torch.float32, seed=3)
    dtype = torch.bfloat16 if CUDA else torch.float32
    compare("gla", x, routes, 16, dtype, "both", True, True, 1e-2 if CUDA else 5e-3, 1e-2)


CPU_CASES = [
    # op, batch, T, Dk, Dv, chunk, routes, dtype, route_grad, initial state, final state
    ("gla", 2, 37, 16, 16, 16, "random", torch.float32, "selected", True, True),
    ("gla", 1, 70, 32, 16, 32, "linear", torch.float16, "both", True, True),
    ("gla", 2, 45, 16, 32, 64, "softmax", torch.float32, "both", False, True),
    ("gla", 1, 150, 16, 16, 128, "random", torch.float16, "selected", True, True),
    ("gla", 1, 300, 16, 16, 256, "random", torch.float32, "both", True, False),
    ("la", 2, 37, 16, 16, 16, "random", torch.float32, "both", True, True),
    ("la", 1, 150, 16, 32, 128, "random", torch.float16, "selected", True, True),
]


@pytest.mark.skipif(CUDA, reason="interpreter shapes; the GPU runs the bf16 tests")
@pytest.mark.parametrize(("op", "batch", "seq_len", "d_k", "d_v", "chunk", "kind", "dtype",
                          "route_grad", "use_h0", "final"), CPU_CASES)
def test_matches_reference_interpreted(op: str, batch: int, seq_len: int, d_k: int, d_v: int,
                                       chunk: int, kind: str, dtype: torch.dtype,
                                       route_grad: str, use_h0: bool, final: bool) -> None:
    x = inputs(op, batch, seq_len, 2, d_k, d_v, seed=chunk)
    routes = make_routes(batch, seq_len, chunk, 2, kind, dtype=torch.float32, seed=seq_len)
    compare(op, x, routes, chunk, dtype, route_grad, use_h0, final, 5e-3, 8e-3)


@pytest.mark.skipif(CUDA, reason="interpreter shapes; the GPU runs the bf16 tests")
@pytest.mark.parametrize(("op", "seq_len", "d_v", "chunk", "segments"), [
    ("gla", 150, 16, 16, 3),
    ("la", 150, 16, 128, 2),  # Dv + 1 = 17 value columns: a partial block
])
def test_segmented_state_passes_match_reference_interpreted(
        monkeypatch: pytest.MonkeyPatch, segmented_passes: list[str], op: str, seq_len: int,
        d_v: int, chunk: int, segments: int) -> None:
    """The same state kernels cut into segments (:mod:`nats.kernels.triton.segments`)."""
    monkeypatch.setattr(segments_mod, "STATE_SEGMENTS", segments)
    x = inputs(op, 2, seq_len, 2, 16, d_v, seed=segments)
    if "g" in x:  # weak decay, so a segment's start state still matters at its end
        x["g"] = x["g"] / 20
    routes = make_routes(2, seq_len, chunk, 2, "random", dtype=torch.float32, seed=seq_len)
    compare(op, x, routes, chunk, torch.float32, "both", True, True, 5e-3, 8e-3)
    assert segmented_passes == ["starts", "ends"]


@pytest.mark.skipif(CUDA, reason="interpreter shapes; the GPU runs the bf16 tests")
@pytest.mark.parametrize(("op", "lengths", "chunk", "dtype", "route_grad"), [
    ("gla", (20, 37, 13), 16, torch.float32, "both"),
    ("la", (100, 70), 64, torch.float16, "selected"),
])
def test_varlen_matches_reference_interpreted(op: str, lengths: tuple[int, ...], chunk: int,
                                              dtype: torch.dtype, route_grad: str) -> None:
    x = inputs(op, len(lengths), sum(lengths), 2, 16, 16, seed=len(lengths))
    x = {n: t[:1] for n, t in x.items() if n != "initial_state"} | {
        "initial_state": x["initial_state"]}  # one packed row, one state per sequence
    n_total = sum(num_chunks(n, chunk) for n in lengths)
    routes = make_routes(1, n_total * chunk, chunk, 2, "random", dtype=torch.float32)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    compare(op, x, routes, chunk, dtype, route_grad, True, True, 5e-3, 8e-3, cu)


@pytest.mark.parametrize(("change", "message"), [
    ({"d_k": 24}, "Dk must be one of"),
    ({"d_v": 300}, "Dv must be 1 to 257"),
    ({"dtype": torch.float64}, "must share one dtype"),
    ({"chunk": 48}, "chunk_size must be one of"),
    ({"route_grad": "all"}, "route_grad must be one of"),
    ({"n_chunks": 5}, "routes must have shape"),
])
def test_bad_input_raises(change: dict, message: str) -> None:
    args = {"d_k": 16, "d_v": 16, "dtype": torch.float32, "chunk": 16,
            "route_grad": "selected", "n_chunks": 2} | change
    x = gla_inputs(1, 20, 2, args["d_k"], args["d_v"], dtype=args["dtype"])
    routes = torch.zeros(1, args["n_chunks"], 2, 2)
    with pytest.raises(ValueError, match=message):
        triton_gla(x["q"], x["k"], x["v"], x["g"], routes, args["chunk"],
                   route_grad=args["route_grad"])


GPU_CASES = [
    # op, batch, T, heads, chunk, route_grad
    ("gla", 1, 8192, 4, 64, "selected"),
    ("gla", 2, 4001, 16, 256, "both"),
    ("gla", 4, 2048, 8, 32, "both"),
    ("la", 1, 8192, 4, 64, "selected"),
    ("la", 2, 4001, 8, 128, "both"),
]


@pytest.mark.gpu
@pytest.mark.parametrize(("op", "batch", "seq_len", "heads", "chunk", "route_grad"), GPU_CASES)
def test_bf16_matches_reference_on_gpu(op: str, batch: int, seq_len: int, heads: int,
                                       chunk: int, route_grad: str) -> None:
    x = inputs(op, batch, seq_len, heads, 128, 128, seed=seq_len)
    routes = routes_with_softmax_fraction(batch, num_chunks(seq_len, chunk), heads, 0.25)
    compare(op, x, routes, chunk, torch.bfloat16, route_grad, True, True, 1e-2, 1e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("op", ["gla", "la"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("d_k", "chunk"), [(64, 32), (32, 16), (64, 128)])
def test_model_head_widths_match_reference_on_gpu(op: str, dtype: torch.dtype, d_k: int,
                                                  chunk: int) -> None:
    """Head widths and dtypes that small models train with."""
    x = inputs(op, 4, 300, 4, d_k, d_k, seed=d_k + chunk)
    routes = routes_with_softmax_fraction(4, num_chunks(300, chunk), 4, 0.5)
    compare(op, x, routes, chunk, dtype, "selected", True, True, 1e-2, 1e-2)


@pytest.mark.gpu
@pytest.mark.parametrize(("op", "chunk"), [("gla", 64), ("gla", 256), ("la", 64)])
def test_bf16_varlen_matches_reference_on_gpu(op: str, chunk: int) -> None:
    lengths, heads = (1000, 3000, 77, 4096), 8
    x = inputs(op, len(lengths), sum(lengths), heads, 128, 128, seed=chunk)
    x = {n: t[:1] for n, t in x.items() if n != "initial_state"} | {
        "initial_state": x["initial_state"]}
    n_total = sum(num_chunks(n, chunk) for n in lengths)
    routes = routes_with_softmax_fraction(1, n_total, heads, 0.25)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    compare(op, x, routes, chunk, torch.bfloat16, "selected", True, True, 1e-2, 1e-2, cu)
