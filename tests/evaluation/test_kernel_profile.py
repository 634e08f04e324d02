"""``kernel_profile`` counts what a call runs, per call and by name (on the CPU, operators
stand in for kernels), and ``kernel_difference`` subtracts two profiles name by name."""

from __future__ import annotations

import pytest
import torch

from nats.evaluation.kernel_profile import kernel_difference, kernel_profile

CPU = torch.device("cpu")


def _by_name(profile: dict) -> dict[str, dict]:
    return {k["name"]: k for k in profile["kernels"]}


def test_launches_are_counted_per_call_and_by_name() -> None:
    a, b = torch.randn(8, 8), torch.randn(8, 8)

    def run() -> None:
        for _ in range(3):
            torch.mm(a, b)
        torch.exp(a)

    profile = kernel_profile(run, calls=4, device=CPU)
    kernels = _by_name(profile)
    assert profile["calls"] == 4
    assert kernels["aten::mm"]["launches_per_call"] == 3
    assert kernels["aten::exp"]["launches_per_call"] == 1
    assert profile["launches_per_call"] == sum(k["launches_per_call"]
                                               for k in profile["kernels"])
    assert profile["us_per_call"] == pytest.approx(sum(k["us_per_call"]
                                                       for k in profile["kernels"]))
    times = [k["us_per_call"] for k in profile["kernels"]]
    assert times == sorted(times, reverse=True)


def test_difference_subtracts_name_by_name() -> None:
    x = torch.randn(16, 16)
    more = kernel_profile(lambda: [torch.mm(x, x) for _ in range(5)], calls=2, device=CPU)
    fewer = kernel_profile(lambda: (torch.mm(x, x), torch.exp(x)), calls=2, device=CPU)
    rows = {r["name"]: r for r in kernel_difference(more, fewer)}
    assert rows["aten::mm"]["launches_per_call"] == 4
    assert rows["aten::exp"]["launches_per_call"] == -1
    assert rows["aten::mm"]["us_per_call"] == pytest.approx(
        _by_name(more)["aten::mm"]["us_per_call"] - _by_name(fewer)["aten::mm"]["us_per_call"])
