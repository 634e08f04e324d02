"""Kernel time and launches a call, by kernel: what the profiling scripts in
``benchmarks/`` read from ``torch.profiler`` (a decode step, a training step)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch


def kernel_profile(run: Callable[[], object], calls: int, device: torch.device,
                   ) -> dict[str, Any]:
    """Kernel time (µs) and launches a call of ``run`` over ``calls`` profiled calls, in
    total and by kernel (most time first). On a CPU each operator's self time stands in
    for a kernel's (a check that a script runs, not a measurement)."""
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
    activity = torch.profiler.ProfilerActivity.CUDA if cuda \
        else torch.profiler.ProfilerActivity.CPU
    with torch.profiler.profile(activities=[activity]) as prof:
        for _ in range(calls):
            run()
        if cuda:
            torch.cuda.synchronize(device)
    kind = torch.autograd.DeviceType.CUDA if cuda else torch.autograd.DeviceType.CPU
    by_name: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for event in prof.events():
        if event.device_type == kind:
            # Self time on the CPU, where operators nest; a kernel's own on the GPU.
            by_name[event.name][0] += event.device_time if cuda else event.self_cpu_time_total
            by_name[event.name][1] += 1
    kernels = sorted(({"name": name, "us_per_call": t / calls, "launches_per_call": n / calls}
                      for name, (t, n) in by_name.items()), key=lambda k: -k["us_per_call"])
    return {"calls": calls, "us_per_call": sum(k["us_per_call"] for k in kernels),
            "launches_per_call": sum(k["launches_per_call"] for k in kernels),
            "kernels": kernels}


def kernel_difference(a: dict[str, Any], b: dict[str, Any]) -> list[dict[str, Any]]:
    """Per kernel name, ``a``'s time and launches a call minus ``b``'s (two
    :func:`kernel_profile` results), the largest differences in time first."""
    figures: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for sign, profile in ((1, a), (-1, b)):
        for k in profile["kernels"]:
            figures[k["name"]][0] += sign * k["us_per_call"]
            figures[k["name"]][1] += sign * k["launches_per_call"]
    rows = [{"name": n, "us_per_call": t, "launches_per_call": c}
            for n, (t, c) in figures.items()]
    return sorted(rows, key=lambda r: -abs(r["us_per_call"]))


def print_kernels(kernels: list[dict[str, Any]]) -> None:
    """One line per kernel: µs and launches a call, then its name (cut at 90 characters)."""
    for k in kernels:
        print(f"  {k['us_per_call']:9.1f} us {k['launches_per_call']:7.1f} x  {k['name'][:90]}",
              flush=True)
