"""Compatibility path: the public names of :mod:`trainguard.unit.distributed` (docs/architecture.md, re-export modules)."""

from __future__ import annotations

from trainguard.unit.ddp import assert_ddp_gradients_match, ddp_gradient_diff
from trainguard.unit.roundtrip import RNG, assert_state_roundtrip

__all__ = [
    "RNG",
    "assert_ddp_gradients_match",
    "assert_state_roundtrip",
    "ddp_gradient_diff",
]
