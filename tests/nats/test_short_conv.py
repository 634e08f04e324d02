"""The short convolution layer: its decode steps against its parallel form."""

from __future__ import annotations

import torch

from nats.layers.short_conv import ShortConvolution


def test_decode_steps_reproduce_the_parallel_form() -> None:
    torch.manual_seed(0)
    conv = ShortConvolution(5, 4).double()
    x = torch.randn(3, 7, 5, dtype=torch.float64)
    state = torch.zeros(3, 3, 5, dtype=torch.float64)
    steps = []
    for t in range(7):
        steps.append(conv.step(x[:, t:t + 1], state))
    torch.testing.assert_close(torch.cat(steps, 1), conv(x))
    torch.testing.assert_close(state, conv.tail(x))
