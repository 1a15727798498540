"""Compatibility path: the public names of :mod:`trainguard.unit.assertions` (docs/architecture.md, re-export modules)."""

from __future__ import annotations

from trainguard.unit.batches import assert_batch_independent
from trainguard.unit.equivalence import assert_close_tree, assert_equivalent, tree_differences
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
    "tree_differences",
]
