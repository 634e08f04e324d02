"""The Triton short convolution against the float32 reference, forward and both gradients.

Under the interpreter on tiny shapes in float32 and float16; on a GPU in bfloat16 at a
model's shapes (the q/k/v widths of the benchmark models, a width that is not a multiple
of the channel block, lengths that are not a multiple of the token block), with float32
weights as autocast leaves them.
"""

from __future__ import annotations

import pytest
import torch

from nats.kernels import short_conv
from nats.kernels.reference.short_conv import short_conv as reference

from .inputs import CUDA, DEVICE, check

pytestmark = pytest.mark.usefixtures("poison_outputs")


def compare(shape: tuple[int, int, int], kernel_size: int, dtype: torch.dtype, out_tol: float,
            grad_tol: float, seed: int = 0) -> None:
    """Triton and the float32 reference on the same values: output, dx and dweight."""
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=gen) * 2).to(dtype).to(DEVICE)
    w = (torch.randn(shape[-1], kernel_size, generator=gen) / kernel_size**0.5).to(DEVICE)
    dy = torch.randn(shape, generator=gen).to(DEVICE)
    xt, wt = x.clone().requires_grad_(), w.clone().requires_grad_()
    xr, wr = x.float().requires_grad_(), w.clone().requires_grad_()
    y = short_conv(xt, wt, backend="triton")
    y_ref = reference(xr, wr)
    assert y.dtype == dtype and y.shape == x.shape and y.is_contiguous()
    check(y, y_ref, out_tol, "y")
    dx, dw = torch.autograd.grad(y, (xt, wt), dy.to(dtype))
    dx_ref, dw_ref = torch.autograd.grad(y_ref, (xr, wr), dy)
    assert dx.dtype == dtype and dw.dtype == torch.float32 and dw.shape == w.shape
    check(dx, dx_ref, grad_tol, "dx")
    check(dw, dw_ref, grad_tol, "dw")


@pytest.mark.skipif(CUDA, reason="interpreter shapes; the GPU runs the bf16 tests")
@pytest.mark.parametrize(("dtype", "out_tol", "grad_tol"),
                         [(torch.float32, 1e-6, 1e-5), (torch.float16, 2e-3, 4e-3)])
@pytest.mark.parametrize(("shape", "kernel_size"),
                         [((2, 1, 6), 4), ((2, 3, 6), 4), ((1, 70, 24), 4), ((3, 130, 200), 4),
                          ((2, 65, 16), 2), ((1, 17, 5), 1)])
def test_matches_reference_interpreted(dtype: torch.dtype, out_tol: float, grad_tol: float,
                                       shape: tuple[int, int, int], kernel_size: int) -> None:
    compare(shape, kernel_size, dtype, out_tol, grad_tol)


@pytest.mark.gpu
@pytest.mark.parametrize(("shape", "kernel_size"),
                         [((2, 4096, 2304), 4), ((1, 5000, 1000), 4), ((8, 333, 3072), 4),
                          ((3, 129, 384), 2)])
def test_matches_reference_on_gpu(shape: tuple[int, int, int], kernel_size: int) -> None:
    compare(shape, kernel_size, torch.bfloat16, 1e-2, 1e-2, seed=shape[1])


def test_a_layer_on_the_triton_backend_matches_its_reference() -> None:
    """The projection's convolution runs the operator the layer's backend names."""
    from nats.layers.short_conv import ShortConvolution

    torch.manual_seed(0)
    conv = ShortConvolution(24, 4, backend="triton").to(DEVICE)
    x = torch.randn(2, 37, 24, device=DEVICE)
    want = reference(x, conv.weight[:, 0].detach())
    check(conv(x).detach(), want, 1e-6, "y")
