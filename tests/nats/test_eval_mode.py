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


def test_eval_mode_restores_each_submodules_own_mode():
    """A module training with a part held in evaluation mode (frozen dropout, a frozen
    encoder) gets back that mixture, not one mode for all."""
    module = nn.Sequential(nn.Linear(2, 2), nn.Dropout(), nn.Sequential(nn.Dropout())).train()
    module[1].eval()
    before = [m.training for m in module.modules()]
    assert before == [True, True, False, True, True]
    with eval_mode(module):
        assert not any(m.training for m in module.modules())
    assert [m.training for m in module.modules()] == before
