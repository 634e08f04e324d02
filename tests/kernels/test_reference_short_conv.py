"""The short convolution's reference (shifted products) against PyTorch's grouped
``conv1d`` followed by ``SiLU``, forward and both gradients."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from nats.kernels.reference.short_conv import short_conv


def conv1d_silu(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The independent form: a left-padded grouped convolution, channels first."""
    k = weight.shape[-1]
    y = F.conv1d(F.pad(x.transpose(1, 2), (k - 1, 0)), weight[:, None], groups=weight.shape[0])
    return F.silu(y.transpose(1, 2))


@pytest.mark.parametrize(("seq_len", "kernel_size"), [(1, 4), (3, 4), (17, 4), (9, 2), (5, 1)])
def test_shifted_products_match_conv1d_and_its_gradients(seq_len: int, kernel_size: int) -> None:
    gen = torch.Generator().manual_seed(seq_len * 10 + kernel_size)
    x = torch.randn(2, seq_len, 6, dtype=torch.float64, generator=gen, requires_grad=True)
    w = torch.randn(6, kernel_size, dtype=torch.float64, generator=gen, requires_grad=True)
    grad = torch.randn(2, seq_len, 6, dtype=torch.float64, generator=gen)
    got = short_conv(x, w)
    dx, dw = torch.autograd.grad(got, (x, w), grad)
    want = conv1d_silu(x, w)
    dx_ref, dw_ref = torch.autograd.grad(want, (x, w), grad)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(dx, dx_ref)
    torch.testing.assert_close(dw, dw_ref)


def test_low_precision_input_is_computed_in_float32_and_rounded_once() -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, 6, generator=gen).bfloat16()
    w = torch.randn(6, 4, generator=gen)
    got = short_conv(x, w)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, conv1d_silu(x.double(), w.double()).bfloat16(), atol=0,
                               rtol=0)
