"""The Triton softmax branch against the float32 reference, forward and backward.

Without a GPU the kernels run under ``TRITON_INTERPRET=1`` (see ``conftest.py``) on tiny
shapes in float32 and float16; with one, in bfloat16 at realistic shapes. Every kernel
output and gradient buffer starts as NaN, so an element a kernel fails to write shows.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
import triton

from nats.kernels import LINEAR, SOFTMAX, hybrid_softmax_attention, num_chunks
from nats.kernels import reference as ref
from nats.kernels.triton import softmax_attention as tsa
from nats.kernels.triton.softmax_attention import hybrid_softmax_attention as triton_attn

from .inputs import (
    CUDA,
    DEVICE,
    check,
    make_routes,
    rel_rms_error,
    routes_with_softmax_fraction,
    softmax_inputs,
)

pytestmark = pytest.mark.usefixtures("poison_outputs")

HEADS, PER_HEAD = 2, 2
"""Routing heads and softmax heads per routing head of the interpreted cases."""


def reference_run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, routes: torch.Tensor,
                  chunk_size: int, route_grad: str, cu_seqlens: torch.Tensor | None,
                  cotangent: torch.Tensor, split_heads: bool,
                  ) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Float32 reference output and gradients (q, k, v, routes).

    With ``split_heads`` it runs one routing head at a time (its ``T^2`` memory is per
    head then), which is exact: routing heads do not interact.
    """
    heads = routes.shape[2]
    per_head = q.shape[2] // heads
    parts = ([(slice(h * per_head, (h + 1) * per_head), slice(h, h + 1)) for h in range(heads)]
             if split_heads else [(slice(None), slice(None))])
    outs, grads = [], []
    for heads_sm, route_heads in parts:
        ins = [x[:, :, heads_sm].float().requires_grad_() for x in (q, k, v)]
        r = routes[:, :, route_heads].float().requires_grad_()
        o = ref.hybrid_softmax_attention(*ins, r, chunk_size, route_grad=route_grad,
                                         cu_seqlens=cu_seqlens)
        grads.append(torch.autograd.grad(o, [*ins, r], cotangent[:, :, heads_sm].float()))
        outs.append(o.detach())
    return torch.cat(outs, 2), [torch.cat(g, 2) for g in zip(*grads, strict=True)]


def compare(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, routes: torch.Tensor,
            chunk_size: int, dtype: torch.dtype, route_grad: str, out_tol: float,
            grad_tol: float, cu_seqlens: torch.Tensor | None = None, backend_op: bool = False,
            split_heads: bool = False) -> None:
    """Run the kernel (inputs in ``dtype``) and the float32 reference on the same values;
    check the output and every gradient, the route's included, by relative RMS error."""
    low = [x.to(dtype=dtype, device=DEVICE) for x in (q, k, v)]
    ins = [x.detach().clone().requires_grad_() for x in low]
    routes = routes.float().to(DEVICE)
    r_tri = routes.clone().requires_grad_()
    kernel = ((lambda *a, **kw: hybrid_softmax_attention(*a, **kw, backend="triton"))
              if backend_op else triton_attn)
    o = kernel(*ins, r_tri, chunk_size, route_grad=route_grad, cu_seqlens=cu_seqlens)
    cot = torch.randn(o.shape, generator=torch.Generator().manual_seed(7)).to(DEVICE)
    o_ref, grads_ref = reference_run(*low, routes, chunk_size, route_grad, cu_seqlens, cot,
                                     split_heads)
    assert o.dtype == dtype and o.shape == o_ref.shape
    err = rel_rms_error(o, o_ref)
    assert err <= out_tol, f"output: relative RMS error {err:.2e}"
    grads = torch.autograd.grad(o, [*ins, r_tri], cot.to(dtype))
    for name, got, want in zip(("q", "k", "v", "routes"), grads, grads_ref, strict=True):
        assert got.dtype == (routes.dtype if name == "routes" else dtype), name
        if name == "routes":
            assert not got[..., LINEAR].any()
            got, want = got[..., SOFTMAX], want[..., SOFTMAX]
        check(got, want, grad_tol, f"d{name}")


def cu_seqlens_of(lengths: tuple[int, ...]) -> torch.Tensor:
    return F.pad(torch.tensor(lengths).cumsum(0), (1, 0)).to(torch.int32).to(DEVICE)


CPU_CASES = [
    # batch, T, Dk, Dv, chunk, routes, dtype, route_grad
    (2, 37, 16, 16, 16, "random", torch.float32, "selected"),
    (2, 37, 16, 16, 16, "random", torch.float32, "both"),
    (2, 37, 16, 32, 16, "softmax", torch.float32, "selected"),
    (2, 37, 16, 16, 16, "linear", torch.float32, "selected"),
    (2, 37, 32, 16, 16, "linear", torch.float16, "both"),
    (1, 70, 16, 16, 32, "random", torch.float16, "both"),
    (2, 70, 16, 16, 32, "softmax", torch.float32, "both"),
    (1, 70, 16, 16, 64, "random", torch.float32, "both"),
    (1, 150, 16, 16, 128, "random", torch.float32, "selected"),
    (1, 150, 16, 16, 128, "softmax", torch.float16, "both"),
    (1, 300, 16, 16, 256, "random", torch.float32, "both"),
]


@pytest.mark.skipif(CUDA, reason="interpreter shapes; the GPU runs the bf16 tests")
@pytest.mark.parametrize(("batch", "seq_len", "d_k", "d_v", "chunk", "kind", "dtype",
                          "route_grad"), CPU_CASES)
def test_matches_reference_interpreted(batch: int, seq_len: int, d_k: int, d_v: int, chunk: int,
                                       kind: str, dtype: torch.dtype, route_grad: str) -> None:
    q, k, _ = softmax_inputs(batch, seq_len, HEADS * PER_HEAD, d_k, torch.float32, seed=chunk)
    v = torch.randn(batch, seq_len, HEADS * PER_HEAD, d_v)
    routes = make_routes(batch, seq_len, chunk, HEADS, kind, dtype=torch.float32, seed=seq_len)
    compare(q, k, v, routes, chunk, dtype, route_grad, 5e-3, 8e-3)


@pytest.mark.skipif(CUDA, reason="interpreter shapes; the GPU runs the bf16 tests")
def test_strided_inputs_and_routes_without_grad_interpreted() -> None:
    """Views with a head stride larger than the head width; no route gradient asked for."""
    wide = torch.randn(1, 45, HEADS * PER_HEAD, 3, 16)
    q, k, v = wide.unbind(3)
    routes = make_routes(1, 45, 16, HEADS, "random", dtype=torch.float32, seed=3)
    ins = [x.clone().requires_grad_() for x in (q, k, v)]
    o = triton_attn(q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), routes, 16)
    o_ref = ref.hybrid_softmax_attention(*ins, routes, 16)
    cot = torch.randn_like(o)
    assert rel_rms_error(o, o_ref) <= 5e-3
    for got, want in zip(torch.autograd.grad(o, (q, k, v), cot),
                         torch.autograd.grad(o_ref, ins, cot), strict=True):
        assert rel_rms_error(got, want) <= 8e-3


@pytest.mark.skipif(CUDA, reason="interpreter shapes; the GPU runs the bf16 tests")
@pytest.mark.parametrize(("lengths", "chunk", "dtype", "route_grad", "backend_op"), [
    ((37, 5, 70), 16, torch.float32, "both", True),
    ((37, 5, 70), 32, torch.float32, "selected", False),
    ((100, 49), 64, torch.float16, "both", False),
])
def test_varlen_matches_reference_interpreted(lengths: tuple[int, ...], chunk: int,
                                              dtype: torch.dtype, route_grad: str,
                                              backend_op: bool) -> None:
    total = sum(lengths)
    q, k, v = softmax_inputs(1, total, HEADS * PER_HEAD, 16, torch.float32, seed=chunk)
    n_total = sum(num_chunks(n, chunk) for n in lengths)
    routes = make_routes(1, n_total * chunk, chunk, HEADS, "random", dtype=torch.float32)
    compare(q, k, v, routes, chunk, dtype, route_grad, 5e-3, 8e-3, cu_seqlens_of(lengths),
            backend_op)


def test_reference_varlen_equals_dense_batch() -> None:
    """Packed sequences of equal length give what the dense batch of them gives."""
    batch, seq_len, chunk = 3, 21, 16
    q, k, v = softmax_inputs(batch, seq_len, HEADS * PER_HEAD, 8)
    routes = make_routes(batch, seq_len, chunk, HEADS, "random")
    dense = ref.hybrid_softmax_attention(q, k, v, routes, chunk)
    packed = ref.hybrid_softmax_attention(
        *(x.reshape(1, batch * seq_len, *x.shape[2:]) for x in (q, k, v)),
        routes.reshape(1, -1, HEADS, 2), chunk,
        cu_seqlens=torch.arange(batch + 1, dtype=torch.int32) * seq_len)
    torch.testing.assert_close(packed, dense.reshape(packed.shape), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(("change", "message"), [
    ({"d_k": 24}, "Dk must be one of"),
    ({"dtype": torch.float64}, "must share one of"),
    ({"chunk": 48}, "chunk_size must be one of"),
    ({"route_grad": "all"}, "route_grad must be one of"),
    ({"n_chunks": 5}, "routes must have shape"),
    ({"cu_seqlens": torch.tensor([0, 5, 20]), "n_chunks": 4}, "routes has 4 chunks"),
])
def test_bad_input_raises(change: dict, message: str) -> None:
    args = {"d_k": 16, "dtype": torch.float32, "chunk": 16, "route_grad": "selected",
            "n_chunks": 2, "cu_seqlens": None} | change
    q, k, v = softmax_inputs(1, 20, HEADS * PER_HEAD, args["d_k"], dtype=args["dtype"])
    routes = torch.zeros(1, args["n_chunks"], HEADS, 2)
    with pytest.raises(ValueError, match=message):
        triton_attn(q, k, v, routes, args["chunk"], route_grad=args["route_grad"],
                    cu_seqlens=args["cu_seqlens"])


GPU_CASES = [
    # batch, T, routing heads, chunk, softmax fraction, route_grad
    (1, 8192, 4, 64, 0.25, "selected"),
    (1, 8192, 4, 64, 1.0, "selected"),
    (2, 4001, 8, 64, 0.25, "both"),
    (2, 3000, 4, 16, 0.5, "selected"),
    (1, 5000, 4, 256, 0.5, "both"),
]


@pytest.mark.gpu
@pytest.mark.parametrize(("batch", "seq_len", "heads", "chunk", "frac", "route_grad"),
                         GPU_CASES)
def test_bf16_matches_reference_on_gpu(batch: int, seq_len: int, heads: int, chunk: int,
                                       frac: float, route_grad: str) -> None:
    q, k, v = softmax_inputs(batch, seq_len, heads * PER_HEAD, 64, torch.float32, seed=seq_len)
    routes = routes_with_softmax_fraction(batch, num_chunks(seq_len, chunk), heads, frac)
    compare(q, k, v, routes, chunk, torch.bfloat16, route_grad, 1e-2, 1e-2, split_heads=True)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("dim", "chunk"), [(32, 32), (16, 16), (32, 128)])
def test_model_head_widths_match_reference_on_gpu(dtype: torch.dtype, dim: int,
                                                  chunk: int) -> None:
    """Head widths and dtypes that small models train with (mqar-small: 32, chunk 32)."""
    q, k, v = softmax_inputs(4, 300, 4 * PER_HEAD, dim, torch.float32, seed=dim + chunk)
    routes = routes_with_softmax_fraction(4, num_chunks(300, chunk), 4, 0.5)
    compare(q, k, v, routes, chunk, dtype, "both", 1e-2, 1e-2, split_heads=True)


@pytest.mark.gpu
@pytest.mark.parametrize("chunk", [64, 256])
def test_bf16_varlen_matches_reference_on_gpu(chunk: int) -> None:
    lengths, heads = (1000, 3000, 1, 77, 4096), 4
    q, k, v = softmax_inputs(1, sum(lengths), heads * PER_HEAD, 64, torch.float32, seed=chunk)
    n_total = sum(num_chunks(n, chunk) for n in lengths)
    routes = routes_with_softmax_fraction(1, n_total, heads, 0.25)
    compare(q, k, v, routes, chunk, torch.bfloat16, "both", 1e-2, 1e-2,
            cu_seqlens_of(lengths), backend_op=True, split_heads=True)


AUTOTUNED = (tsa._attn_fwd, tsa._attn_bwd_dkdv, tsa._attn_bwd_dq)
"""The autotuned kernels of one forward and backward pass."""


def _winner_bench(winner: int) -> Callable[..., list[float]]:
    """A stand-in for the autotuner's benchmark: it runs each config once, as tuning does,
    and makes config ``winner`` (in tuning order) the fastest."""
    calls = itertools.count()

    def bench(kernel_call: Callable[[], None], quantiles: tuple[float, ...]) -> list[float]:
        kernel_call()
        return [0.0 if next(calls) == winner else 1.0] * len(quantiles)
    return bench


def check_autotuning_leaves_no_trace(monkeypatch: pytest.MonkeyPatch, winner: int, dim: int,
                                     chunk: int, dtype: torch.dtype, batch: int,
                                     seq_len: int) -> None:
    """The result is the winning config's, whatever ran while tuning: a config that writes
    fewer route-gradient slots of a chunk must not keep a slot that a config tried before
    it wrote (the failed gate passes of RELIABILITY.md, when 128-key tiles won at chunk
    128). Each autotuner tunes afresh and is made to pick config ``winner`` (its last one
    where it has fewer)."""
    for kernel in AUTOTUNED:
        monkeypatch.setattr(kernel, "cache", {})
        monkeypatch.setitem(kernel.__dict__, "do_bench",
                            _winner_bench(min(winner, len(kernel.configs) - 1)))
    q, k, v = softmax_inputs(batch, seq_len, 4 * PER_HEAD, dim, torch.float32, seed=winner)
    routes = routes_with_softmax_fraction(batch, num_chunks(seq_len, chunk), 4, 0.5)
    compare(q, k, v, routes, chunk, dtype, "both", 1e-2, 1e-2, split_heads=True)
    for kernel in AUTOTUNED:
        assert kernel.best_config is kernel.configs[min(winner, len(kernel.configs) - 1)], \
            kernel.fn.__name__


@pytest.mark.skipif(CUDA, reason="interpreter configs; the GPU tunes its own")
@pytest.mark.parametrize("winner", [0, 1])
def test_autotuning_leaves_no_trace_interpreted(monkeypatch: pytest.MonkeyPatch,
                                                winner: int) -> None:
    chunk = 32
    for kernel in AUTOTUNED:
        # Key tiles of half a chunk (two route-gradient slots), then a whole chunk (one).
        monkeypatch.setattr(kernel, "configs", [
            triton.Config({"BLOCK_M": 32, "BLOCK_N": n}, pre_hook=tsa._set_block_rows)
            for n in (chunk // 2, chunk)])
    check_autotuning_leaves_no_trace(monkeypatch, winner, 16, chunk, torch.float32, 2, 70)


@pytest.mark.gpu
@pytest.mark.parametrize("winner", range(max(len(k.configs) for k in AUTOTUNED)))
@pytest.mark.parametrize(("dim", "chunk"), [(32, 128), (64, 64)])
def test_autotuning_leaves_no_trace_on_gpu(monkeypatch: pytest.MonkeyPatch, winner: int,
                                           dim: int, chunk: int) -> None:
    check_autotuning_leaves_no_trace(monkeypatch, winner, dim, chunk, torch.bfloat16, 4, 300)
