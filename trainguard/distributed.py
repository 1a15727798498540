"""Compatibility path: the public names of :mod:`trainguard.unit.distributed` (docs/architecture.md, re-export modules)."""

from __future__ import annotations

from trainguard.unit.distributed import (
    RNG,
    assert_ddp_gradients_match,
    assert_state_roundtrip,
    ddp_gradient_diff,
)

__all__ = [
    "RNG",
    "assert_ddp_gradients_match",
    "assert_state_roundtrip",
    "ddp_gradient_diff",
]
