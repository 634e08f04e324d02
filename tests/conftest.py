"""Markers that act by themselves: ``gpu`` tests skip without a CUDA device, so a test
needs the marker alone; ``slow`` tests (training runs, Ray, worker processes) can be left
out with ``-m "not slow"`` for a quick pass.

Without a GPU, Triton kernels run through its interpreter: chosen here, before any test
module can import Triton.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
