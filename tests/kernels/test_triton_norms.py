"""The fused Triton row norms and the NAtS-L branch merge against the float32 reference,
forward and every gradient.

Under the interpreter on tiny shapes in float32 and float16; on a GPU in bfloat16 at a
model's shapes, including head slices of a fused projection (a strided view, as the
layers pass q and k) and widths that are not powers of two (the model width).
"""

from __future__ import annotations

import pytest
import torch

from nats.kernels import l2_norm, merge_branches, qk_norms, rms_norm
from nats.kernels.reference import norms as reference

from .inputs import CUDA, DEVICE, check

pytestmark = pytest.mark.usefixtures("poison_outputs")


def heads_of_projection(batch: int, seq_len: int, heads: int, dim: int, dtype: torch.dtype,
                        seed: int) -> torch.Tensor:
    """``[B, T, heads, dim]`` as the middle slice of a wider projection: rows are strided."""
    gen = torch.Generator().manual_seed(seed)
    fused = torch.randn(batch, seq_len, 3 * heads * dim, generator=gen) * 3 + 0.5
    fused = fused.to(dtype).to(DEVICE)
    return fused[..., heads * dim: 2 * heads * dim].view(batch, seq_len, heads, dim)


def compare(kind: str, x: torch.Tensor, with_weight: bool, out_tol: float,
            grad_tol: float) -> None:
    """Triton and the float32 reference on the same values: output, dx and dweight."""
    gen = torch.Generator().manual_seed(3)
    dim = x.shape[-1]
    weight = (torch.rand(dim, generator=gen) + 0.5).to(DEVICE) if with_weight else None
    xt, xr = x.detach().clone().requires_grad_(), x.detach().float().requires_grad_()
    wt = None if weight is None else weight.clone().requires_grad_()
    wr = None if weight is None else weight.clone().requires_grad_()
    if kind == "rms":
        y = rms_norm(xt, wt, 1e-6, backend="triton")
        y_ref = reference.rms_norm(xr, wr, 1e-6)
    else:
        y = l2_norm(xt, 1e-6, backend="triton")
        y_ref = reference.l2_norm(xr, 1e-6)
    assert y.dtype == x.dtype and y.shape == x.shape and y.is_contiguous()
    check(y, y_ref, out_tol, "y")
    dy = torch.randn(x.shape, generator=gen).to(DEVICE)
    inputs = [xt] if wt is None else [xt, wt]
    inputs_ref = [xr] if wr is None else [xr, wr]
    grads = torch.autograd.grad(y, inputs, dy.to(y.dtype))
    grads_ref = torch.autograd.grad(y_ref, inputs_ref, dy)
    for name, got, want, given in zip(("dx", "dweight"), grads, grads_ref, inputs, strict=False):
        assert got.dtype == given.dtype and got.shape == given.shape, name
        check(got, want, grad_tol, name)


@pytest.mark.skipif(CUDA, reason="interpreter shapes; the GPU runs the bf16 tests")
@pytest.mark.parametrize("kind", ["rms", "l2"])
@pytest.mark.parametrize(("dtype", "out_tol", "grad_tol"),
                         [(torch.float32, 1e-6, 1e-5), (torch.float16, 2e-3, 4e-3)])
@pytest.mark.parametrize(("shape", "strided"), [((2, 5, 3, 16), True), ((3, 7, 24), False),
                                                ((1, 3, 2, 96), True), ((65, 32), False)])
def test_matches_reference_interpreted(kind: str, dtype: torch.dtype, out_tol: float,
                                       grad_tol: float, shape: tuple[int, ...],
                                       strided: bool) -> None:
    if strided:
        x = heads_of_projection(*shape, dtype=dtype, seed=1)
        assert not x.is_contiguous()
    else:
        x = (torch.randn(shape, generator=torch.Generator().manual_seed(1)) * 3).to(dtype)
    for with_weight in ((True, False) if kind == "rms" else (False,)):
        compare(kind, x, with_weight, out_tol, grad_tol)


def test_a_zero_row_stays_finite() -> None:
    x = torch.zeros(4, 32, device=DEVICE, requires_grad=True)
    y = rms_norm(x, None, 1e-6, backend="triton")
    y.sum().backward()
    assert not y.any() and torch.isfinite(x.grad).all()


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["rms", "l2"])
@pytest.mark.parametrize(("heads", "dim"), [(12, 64), (6, 128), (4, 16)])
def test_bf16_heads_match_reference_on_gpu(kind: str, heads: int, dim: int) -> None:
    x = heads_of_projection(4, 1000, heads, dim, torch.bfloat16, seed=2)
    for with_weight in ((True, False) if kind == "rms" else (False,)):
        compare(kind, x, with_weight, 1e-2, 1e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("dim", [768, 2048, 100])
def test_bf16_model_width_matches_reference_on_gpu(dim: int) -> None:
    x = (torch.randn(3, 999, dim, generator=torch.Generator().manual_seed(4)) * 2).to(
        torch.bfloat16).to(DEVICE)
    compare("rms", x, True, 1e-2, 1e-2)


def compare_qk(q: torch.Tensor, k: torch.Tensor, parts: int, out_tol: float,
               grad_tol: float, q_weight_dtype: torch.dtype = torch.float32) -> None:
    """``qk_norms`` on Triton against the float32 reference's four norms: every output,
    and dq, dk and both weights' gradients from output gradients on all four (as a layer's
    q and k each feed both branches). The two weights and eps differ, so a kernel that
    mixed up q's and k's parts fails."""
    gen = torch.Generator().manual_seed(6)
    sub = q.shape[-1] // parts
    weights = [(torch.rand(sub, generator=gen) + 0.5).to(DEVICE) for _ in range(2)]
    weights[0] = weights[0].to(q_weight_dtype)
    eps = (1e-5, 0.5)  # k's large enough to move every output
    inputs_t = [t.detach().clone().requires_grad_() for t in (q, k, *weights)]
    inputs_r = [t.detach().float().requires_grad_() for t in (q, k, *weights)]
    outs = qk_norms(*inputs_t, parts, *eps, 1e-6, backend="triton")
    refs = reference.qk_norms(*inputs_r, parts, *eps, 1e-6)
    for name, got, want in zip(("q rms", "q l2", "k rms", "k l2"), outs, refs, strict=True):
        assert got.dtype == q.dtype and got.shape == want.shape and got.is_contiguous(), name
        check(got, want, out_tol, name)
    dys = [torch.randn(r.shape, generator=gen).to(DEVICE) for r in refs]
    grads = torch.autograd.grad(outs, inputs_t, [d.to(q.dtype) for d in dys])
    grads_ref = torch.autograd.grad(refs, inputs_r, dys)
    for name, got, want, given in zip(("dq", "dk", "dq_weight", "dk_weight"), grads,
                                      grads_ref, inputs_t, strict=True):
        assert got.dtype == given.dtype and got.shape == given.shape, name
        check(got, want, grad_tol, name)


def q_and_k(batch: int, seq_len: int, heads: int, dim: int, dtype: torch.dtype, seed: int,
            strided: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's q and k ``[B, T, heads, dim]``: the first two slices of one projection
    (strided rows of one layout), or two contiguous tensors."""
    if not strided:
        gen = torch.Generator().manual_seed(seed)
        return tuple((torch.randn(batch, seq_len, heads, dim, generator=gen) * 3)
                     .to(dtype).to(DEVICE) for _ in range(2))
    fused = heads_of_projection(batch, seq_len, 2 * heads, dim, dtype, seed)
    return fused[:, :, :heads], fused[:, :, heads:]


@pytest.mark.skipif(CUDA, reason="interpreter shapes; the GPU runs the bf16 tests")
@pytest.mark.parametrize(("dtype", "out_tol", "grad_tol"),
                         [(torch.float32, 1e-6, 1e-5), (torch.float16, 2e-3, 4e-3)])
@pytest.mark.parametrize(("shape", "parts", "strided"), [
    ((2, 5, 3, 16), 2, True), ((3, 7, 2, 32), 4, False), ((1, 40, 2, 16), 1, True),
    ((2, 3, 2, 24), 2, False),  # sub-heads of 12: the row norms instead
])
def test_qk_norms_match_reference_interpreted(
        dtype: torch.dtype, out_tol: float, grad_tol: float, shape: tuple[int, ...],
        parts: int, strided: bool) -> None:
    q, k = q_and_k(*shape, dtype=dtype, seed=7, strided=strided)
    assert q.is_contiguous() != strided
    compare_qk(q, k, parts, out_tol, grad_tol)


def test_qk_norms_of_q_and_k_in_different_layouts_interpreted() -> None:
    """q a strided slice, k a contiguous tensor: the rows of the two no longer share one
    layout, and each is read as its own."""
    q = heads_of_projection(2, 5, 3, 16, torch.float32, seed=9)
    k = (torch.randn(2, 5, 3, 16, generator=torch.Generator().manual_seed(10)) * 3).to(DEVICE)
    compare_qk(q, k, 2, 1e-6, 1e-5)


def test_qk_norms_with_weights_of_two_dtypes_interpreted() -> None:
    """q's weight in float16, k's in float32 (a model cast in part): neither is rounded to
    the other's dtype, and each gradient comes back in its weight's dtype."""
    q, k = q_and_k(2, 5, 3, 16, torch.float32, seed=12, strided=True)
    # Outputs to float32's tolerance (k's weight rounded to float16 would miss it by far);
    # the gradients to float16's, which q's weight gradient is returned in.
    compare_qk(q, k, 2, 1e-6, 1e-3, q_weight_dtype=torch.float16)


@pytest.mark.gpu
@pytest.mark.parametrize(("heads", "dim", "parts"), [(6, 128, 2), (16, 128, 2), (4, 64, 2),
                                                     (4, 32, 1)])
def test_bf16_qk_norms_match_reference_on_gpu(heads: int, dim: int, parts: int) -> None:
    compare_qk(*q_and_k(4, 1000, heads, dim, torch.bfloat16, seed=8, strided=True), parts,
               1e-2, 1e-2)


@pytest.mark.gpu
def test_bf16_qk_norms_of_one_decode_token_match_reference_on_gpu() -> None:
    """A decode step's shapes: one token of one sequence, six heads of 128."""
    compare_qk(*q_and_k(1, 1, 6, 128, torch.bfloat16, seed=11, strided=True), 2, 1e-2, 1e-2)


def test_qk_norms_reject_weights_of_the_wrong_width_and_unequal_q_and_k() -> None:
    x = torch.zeros(2, 3, 2, 16, device=DEVICE)
    w = torch.ones(8, device=DEVICE)
    with pytest.raises(ValueError, match="D / parts"):
        qk_norms(x, x, w, torch.ones(16, device=DEVICE), 2, 1e-5, 1e-5, 1e-6)
    with pytest.raises(ValueError, match="one shape and dtype"):
        qk_norms(x, x[:, :2], w, w, 2, 1e-5, 1e-5, 1e-6)


def compare_merge(a: torch.Tensor, b: torch.Tensor, norm_a: bool, norm_b: bool,
                  out_dtype: torch.dtype, out_tol: float, grad_tol: float,
                  logits: bool = False) -> None:
    """Triton and the float32 reference merge: output, da, db, dweights and dgamma; with
    ``logits``, weights given as the logits of a projection in ``a``'s dtype."""
    gen = torch.Generator().manual_seed(5)
    dim = a.shape[-1]
    weights = torch.randn(*a.shape[:-1], 2, generator=gen) * 3
    weights = (weights.to(a.dtype) if logits else torch.softmax(weights, -1)).to(DEVICE)
    gamma = (torch.rand(dim, generator=gen) + 0.5).to(DEVICE)
    given = [a, b, weights, gamma]
    ins = [t.detach().clone().requires_grad_() for t in given]
    refs = [t.detach().float().requires_grad_() for t in given]
    y = merge_branches(*ins, 1e-6, norm_a, norm_b, out_dtype, logits=logits, backend="triton")
    y_ref = merge_branches(*refs, 1e-6, norm_a, norm_b, torch.float32, logits=logits,
                           backend="reference")
    assert y.dtype == out_dtype and y.shape == a.shape
    check(y, y_ref, out_tol, "y")
    dy = torch.randn(a.shape, generator=gen).to(DEVICE)
    grads = torch.autograd.grad(y, ins, dy.to(out_dtype))
    grads_ref = torch.autograd.grad(y_ref, refs, dy)
    for name, got, want, t in zip(("da", "db", "dweights", "dgamma"), grads, grads_ref, given,
                                  strict=True):
        assert got.dtype == t.dtype and got.shape == t.shape, name
        check(got, want, grad_tol, name)


@pytest.mark.skipif(CUDA, reason="interpreter shapes; the GPU runs the bf16 tests")
@pytest.mark.parametrize(("norm_a", "norm_b"), [(True, True), (True, False), (False, False)])
@pytest.mark.parametrize(("dtype", "out_tol", "grad_tol"),
                         [(torch.float32, 1e-6, 1e-5), (torch.float16, 2e-3, 4e-3)])
@pytest.mark.parametrize("shape", [(2, 5, 3, 16), (37, 24)])
@pytest.mark.parametrize("logits", [False, True])
def test_merge_matches_reference_interpreted(norm_a: bool, norm_b: bool, dtype: torch.dtype,
                                             out_tol: float, grad_tol: float,
                                             shape: tuple[int, ...], logits: bool) -> None:
    gen = torch.Generator().manual_seed(6)
    a, b = ((torch.randn(shape, generator=gen) * 3).to(dtype) for _ in range(2))
    compare_merge(a, b, norm_a, norm_b, torch.float32, out_tol, grad_tol, logits)


def test_merge_rejects_mismatched_shapes() -> None:
    a = torch.zeros(2, 3, 16, device=DEVICE)
    with pytest.raises(ValueError, match="weights"):
        merge_branches(a, a, torch.zeros(2, 3, 3, device=DEVICE), torch.ones(16, device=DEVICE),
                       1e-6, True, True, torch.float32, backend="triton")


@pytest.mark.gpu
@pytest.mark.parametrize(("norm_a", "norm_b"), [(True, True), (True, False), (False, False)])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("logits", [False, True])
def test_bf16_merge_matches_reference_on_gpu(norm_a: bool, norm_b: bool,
                                             out_dtype: torch.dtype, logits: bool) -> None:
    gen = torch.Generator().manual_seed(8)
    a, b = ((torch.randn(4, 1000, 12, 64, generator=gen) * 2).to(torch.bfloat16).to(DEVICE)
            for _ in range(2))
    compare_merge(a, b, norm_a, norm_b, out_dtype, 1e-2, 1e-2, logits)
