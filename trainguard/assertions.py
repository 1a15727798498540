"""Compatibility path: the public names of :mod:`trainguard.unit.assertions` (docs/architecture.md, re-export modules)."""

from __future__ import annotations

from trainguard.unit.assertions import (
    assert_batch_independent,
    assert_can_overfit,
    assert_close_tree,
    assert_equivalent,
    assert_finite,
    assert_grads_flow,
    assert_loss_connected,
    assert_step_updates,
    assert_tensor_meta,
)

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
