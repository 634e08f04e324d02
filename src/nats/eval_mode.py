"""A stretch of code that reads a model in evaluation mode, the model's own mode restored
after (also when it raises).

Evaluation, measurement, export and generation may read a model in the middle of its
training. In training mode its forward passes would add their chunks to the routing
statistics (:class:`nats.layers.routing.RunningMoments`, folded in at the next optimizer
step) and draw noisy routes where the run explores; what they measure or generate is the
model as evaluation sees it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from torch import nn


@contextlib.contextmanager
def eval_mode(module: nn.Module) -> Iterator[nn.Module]:
    """``module`` in evaluation mode inside the block; after it, every submodule's mode as
    it was (a model training with a frozen part in evaluation mode keeps it so)."""
    was_training = module.training
    modes = [(m, m.training) for m in module.modules()]
    module.eval()
    try:
        yield module
    finally:
        module.train(was_training)  # through an override (the HF wrapper's native model)
        for m, training in modes:
            m.training = training
