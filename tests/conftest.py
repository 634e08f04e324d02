"""Markers that act by themselves: ``gpu`` tests skip without a CUDA device, so a test
needs the marker alone; ``slow`` tests (training runs, Ray, worker processes) can be left
out with ``-m "not slow"`` for a quick pass."""

from __future__ import annotations

import pytest
import torch


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
