"""The short convolution's CPU form (shifted products) against a grouped ``conv1d``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from nats.layers.short_conv import ShortConvolution, causal_depthwise_conv


def _conv1d(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The independent reference: PyTorch's grouped convolution, left-padded."""
    k = weight.shape[-1]
    return F.conv1d(F.pad(x.transpose(1, 2), (k - 1, 0)), weight,
                    groups=weight.shape[0]).transpose(1, 2)


@pytest.mark.parametrize(("seq_len", "kernel_size"), [(1, 4), (3, 4), (17, 4), (9, 2), (5, 1)])
def test_shifted_products_match_conv1d_and_its_gradients(seq_len: int, kernel_size: int) -> None:
    gen = torch.Generator().manual_seed(seq_len * 10 + kernel_size)
    x = torch.randn(2, seq_len, 6, dtype=torch.float64, generator=gen, requires_grad=True)
    w = torch.randn(6, 1, kernel_size, dtype=torch.float64, generator=gen, requires_grad=True)
    grad = torch.randn(2, seq_len, 6, dtype=torch.float64, generator=gen)
    got = causal_depthwise_conv(x, w)
    dx, dw = torch.autograd.grad(got, (x, w), grad)
    want = _conv1d(x, w)
    dx_ref, dw_ref = torch.autograd.grad(want, (x, w), grad)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(dx, dx_ref)
    torch.testing.assert_close(dw, dw_ref)


def test_cpu_autocast_keeps_the_dtype_conv1d_gives() -> None:
    x = torch.randn(2, 5, 6)
    w = torch.randn(6, 1, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got, want = causal_depthwise_conv(x.bfloat16(), w), _conv1d(x.bfloat16(), w)
    assert got.dtype == want.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want.float(), atol=0.05, rtol=0.02)


def test_decode_steps_reproduce_the_parallel_form() -> None:
    torch.manual_seed(0)
    conv = ShortConvolution(5, 4).double()
    x = torch.randn(3, 7, 5, dtype=torch.float64)
    state = torch.zeros(3, 3, 5, dtype=torch.float64)
    steps = []
    for t in range(7):
        y, state = conv.step(x[:, t:t + 1], state)
        steps.append(y)
    torch.testing.assert_close(torch.cat(steps, 1), conv(x))
    torch.testing.assert_close(state, conv.tail(x))
