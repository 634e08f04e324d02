"""The fixtures every kernel test module may ask for (``pytestmark =
pytest.mark.usefixtures(...)``); the root conftest picks Triton's interpreter without a GPU."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from .inputs import single_threaded


@pytest.fixture
def poison_outputs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Triton kernels fill their outputs with NaN before they run, so an element a kernel
    forgets to write fails the comparison instead of passing on leftover memory."""
    from nats.kernels.triton import utils

    monkeypatch.setattr(utils, "POISON_OUTPUTS", True)


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    """The module's tests on one torch thread (:func:`.inputs.single_threaded`)."""
    with single_threaded():
        yield
