"""Equivalence helpers for distributed and resumable training code, run from a unit test.

The import path of two features that live in their own modules:

* :mod:`trainguard.unit.ddp`: ``ddp_gradient_diff`` / ``assert_ddp_gradients_match``, do the
  ranks compute the gradient one process would (inside a ``@pytest.mark.ddp`` process group);
* :mod:`trainguard.unit.roundtrip`: ``assert_state_roundtrip`` and :data:`RNG`, does a
  checkpoint hold the whole training state (save in one fresh process, load in another).

Example::

    @pytest.mark.ddp(world_size=2)
    def test_my_allreduce_averages():
        assert_ddp_gradients_match(make_model, F.mse_loss, (x, y), grad_sync=my_allreduce)

    def test_checkpoint_is_complete():
        assert_state_roundtrip("mytrain.job:build", save="mytrain.job:save",
                               load="mytrain.job:load", pythonpath=[str(SRC)])
"""

from __future__ import annotations

from trainguard.unit.ddp import assert_ddp_gradients_match, ddp_gradient_diff
from trainguard.unit.roundtrip import RNG, assert_state_roundtrip

__all__ = [
    "RNG",
    "assert_ddp_gradients_match",
    "assert_state_roundtrip",
    "ddp_gradient_diff",
]
