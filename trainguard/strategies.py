"""Compatibility path: the public names of :mod:`trainguard.unit.strategies` (docs/architecture.md, re-export modules)."""

from __future__ import annotations

from trainguard.unit.strategies import (
    batch_shapes,
    batches,
    classification_batches,
    tensors,
    token_batches,
)

__all__ = [
    "batch_shapes",
    "batches",
    "classification_batches",
    "tensors",
    "token_batches",
]
