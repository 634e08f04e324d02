"""``eval_mode``: evaluation inside the block, the module's own mode after, also on error."""

import pytest
from torch import nn

from nats.eval_mode import eval_mode


@pytest.mark.parametrize("training", [True, False])
def test_eval_mode_restores_the_mode_on_exit_and_on_error(training):
    module = nn.Sequential(nn.Linear(2, 2), nn.Dropout()).train(training)
    with eval_mode(module) as inside:
        assert inside is module and not any(m.training for m in module.modules())
    assert all(m.training == training for m in module.modules())
    with pytest.raises(RuntimeError, match="inside"), eval_mode(module):
        raise RuntimeError("inside")
    assert all(m.training == training for m in module.modules())
