"""The linear operators' gates: the reference against the formula element by element, the
Triton kernels against the reference, forward and every gradient.

Under the interpreter on tiny shapes in float32 and float16; on a GPU in bfloat16 at a
model's shapes (decode's single token included). Pre-activations span softplus's linear
tail, its threshold and the far negative side, where a naive ``log(1 + exp(x))`` loses
all precision.
"""

from __future__ import annotations

import math

import pytest
import torch

from nats.kernels import linear_gates
from nats.kernels.reference.gates import linear_gates as reference

from .inputs import CUDA, DEVICE, check

pytestmark = pytest.mark.usefixtures("poison_outputs")


def inputs(shape: tuple[int, ...], dtype: torch.dtype, param_dtype: torch.dtype, seed: int):
    """Projections ``a``, ``b`` and parameters ``A_log``, ``dt_bias`` as a layer has them
    (``dt_bias`` near softplus^-1 of 1e-3 .. 1e-1), ``a`` wide enough to reach both tails."""
    gen = torch.Generator().manual_seed(seed)
    heads = shape[-1]
    a = (torch.randn(shape, generator=gen) * 8).to(dtype).to(DEVICE)
    b = (torch.randn(shape, generator=gen) * 3).to(dtype).to(DEVICE)
    a_log = torch.log(torch.linspace(1.0, 16.0, heads)).to(param_dtype).to(DEVICE)
    dt_bias = (torch.linspace(-7.0, -2.0, heads)).to(param_dtype).to(DEVICE)
    return a, a_log, dt_bias, b


def test_reference_is_the_formula() -> None:
    a, a_log, dt_bias, b = (t.double().cpu() for t in inputs((3, 5), torch.float64,
                                                             torch.float64, 0))
    a[0, 0] = 40.0  # past softplus's threshold
    g, beta = reference(a, a_log, dt_bias, b)
    for i in range(3):
        for h in range(5):
            pre = float(a[i, h] + dt_bias[h])
            softplus = pre if pre > 20 else math.log1p(math.exp(pre))
            assert g[i, h].item() == pytest.approx(-math.exp(a_log[h]) * softplus, rel=1e-12)
            assert beta[i, h].item() == pytest.approx(1 / (1 + math.exp(-b[i, h])), rel=1e-12)
    assert reference(None, None, None, b)[0] is None and reference(a, a_log, dt_bias, None)[1] \
        is None


def compare(shape: tuple[int, ...], dtype: torch.dtype, param_dtype: torch.dtype, decay: bool,
            write: bool, out_tol: float, grad_tol: float, param_tol: float,
            seed: int = 0) -> None:
    """Triton and the float32 reference on the same values: g, beta and every gradient
    (``grad_tol`` for the projections', in their dtype; ``param_tol`` for the parameters',
    sums over every row)."""
    a, a_log, dt_bias, b = inputs(shape, dtype, param_dtype, seed)
    given = [a, a_log, dt_bias] if decay else []
    given += [b] if write else []
    tri = [t.clone().requires_grad_() for t in given]
    ref = [t.float().requires_grad_() for t in given]

    def call(fn, ts: list[torch.Tensor]):
        return fn(*(ts[:3] if decay else [None] * 3), ts[-1] if write else None)

    out = call(lambda *x: linear_gates(*x, backend="triton"), tri)
    out_ref = call(reference, ref)
    gen = torch.Generator().manual_seed(seed + 1)
    cotangents = []
    for name, got, want in zip(("g", "beta"), out, out_ref, strict=True):
        assert (got is None) == (want is None), name
        if got is not None:
            assert got.dtype == torch.float32 and got.shape == a.shape, name
            check(got, want, out_tol, name)
            # Element by element too: the smallest decays matter as much as the largest.
            worst = ((got - want).abs() / want.abs().clamp_min(1e-30)).max().item()
            assert worst <= 100 * out_tol, f"{name}: worst relative error {worst:.1e}"
            cotangents.append(torch.randn(shape, generator=gen).to(DEVICE))
    present = [o for o in out if o is not None]
    present_ref = [o for o in out_ref if o is not None]
    grads = torch.autograd.grad(present, tri, cotangents)
    grads_ref = torch.autograd.grad(present_ref, ref, cotangents)
    names = (["da", "dA_log", "ddt_bias"] if decay else []) + (["db"] if write else [])
    for name, got, want, t in zip(names, grads, grads_ref, given, strict=True):
        assert got.dtype == t.dtype and got.shape == t.shape, name
        check(got, want, grad_tol if name in ("da", "db") else param_tol, name)


GATES = [(True, True), (True, False), (False, True)]
"""(decay, write): Gated DeltaNet, gated linear attention, DeltaNet."""


@pytest.mark.skipif(CUDA, reason="interpreter shapes; the GPU runs the bf16 tests")
@pytest.mark.parametrize(("decay", "write"), GATES)
@pytest.mark.parametrize(("dtype", "out_tol", "grad_tol"),
                         [(torch.float32, 1e-6, 1e-6), (torch.float16, 1e-6, 2e-3)])
@pytest.mark.parametrize("shape", [(2, 37, 6), (1, 1, 3), (300, 4)])
def test_matches_reference_interpreted(decay: bool, write: bool, dtype: torch.dtype,
                                       out_tol: float, grad_tol: float,
                                       shape: tuple[int, ...]) -> None:
    compare(shape, dtype, torch.float32, decay, write, out_tol, grad_tol, 1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize(("decay", "write"), GATES)
@pytest.mark.parametrize(("shape", "param_dtype"),
                         [((4, 4096, 6), torch.float32), ((1, 1, 16), torch.bfloat16),
                          ((8, 2048, 16), torch.float32), ((3, 333, 5), torch.bfloat16)])
def test_matches_reference_on_gpu(decay: bool, write: bool, shape: tuple[int, ...],
                                  param_dtype: torch.dtype) -> None:
    # The projections' gradients are rounded to bf16, and so are bf16 parameters'; both
    # sides read the same rounded inputs, so the outputs agree to float32.
    param_tol = 1e-2 if param_dtype == torch.bfloat16 else 1e-4
    compare(shape, torch.bfloat16, param_dtype, decay, write, 1e-6, 1e-2, param_tol,
            seed=shape[1])


def test_one_line_errors_for_mismatched_inputs() -> None:
    a, a_log, dt_bias, b = inputs((2, 3, 4), torch.float32, torch.float32, 0)
    with pytest.raises(ValueError, match="one shape"):
        linear_gates(a, a_log, dt_bias, b[..., :3])
    with pytest.raises(ValueError, match=r"shape \[4\]"):
        linear_gates(a, a_log[:3], dt_bias, b)
    assert linear_gates(None, None, None, None) == (None, None)
