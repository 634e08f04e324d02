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


@pytest.fixture
def segmented_passes(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The segmented state passes that ran, in order (``"starts"``: a forward chained its
    segments, ``"ends"``: a backward did), so a case meant to be cut cannot pass uncut."""
    from nats.kernels.triton import gated_delta_rule_bwd, gated_delta_rule_fwd

    ran: list[str] = []

    def spy(module, name: str, label: str) -> None:
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a: ran.append(label) or real(*a))
    spy(gated_delta_rule_fwd, "chain_starts", "starts")
    spy(gated_delta_rule_bwd, "chain_ends", "ends")
    return ran
