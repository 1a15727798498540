"""Unit-test assertions for training code: finiteness, gradient flow, batch independence, ...

Each assertion raises ``TrainguardAssertionError`` (an ``AssertionError``, so pytest reports a test
failure) whose message names the offending parameter, tensor or output, says what the usual causes
are, and ends with how to reproduce (the seed of the last ``seed_everything`` call). Calls that can
never succeed (bad arguments) raise ``UsageError`` instead.

This module is the one import path for all of them; each is defined in the module of its topic:
:mod:`trainguard.unit.outputs` (finite values, tensor shape/dtype/device),
:mod:`trainguard.unit.gradients` (gradient flow, loss connected to the outputs),
:mod:`trainguard.unit.batches` (batch independence), :mod:`trainguard.unit.training` (can
overfit, one step updates the right parameters) and :mod:`trainguard.unit.equivalence` (close
nested structures, equivalent implementations).

Example::

    seed_everything(0)
    model = Net()
    loss = F.cross_entropy(model(x), y)
    assert_finite(loss, name="loss")
    assert_grads_flow(model, loss)
"""

from __future__ import annotations

from trainguard.unit.batches import assert_batch_independent
from trainguard.unit.equivalence import assert_close_tree, assert_equivalent
from trainguard.unit.equivalence import tree_differences as tree_differences
from trainguard.unit.gradients import assert_grads_flow, assert_loss_connected
from trainguard.unit.outputs import assert_finite, assert_tensor_meta
from trainguard.unit.training import assert_can_overfit, assert_step_updates

__all__ = [
    "assert_batch_independent",
    "assert_can_overfit",
    "assert_close_tree",
    "assert_equivalent",
    "assert_finite",
    "assert_grads_flow",
    "assert_loss_connected",
    "assert_step_updates",
    "assert_tensor_meta",
]
