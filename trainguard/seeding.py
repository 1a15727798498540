"""Compatibility path: the public names of :mod:`trainguard.unit.seeding` (docs/architecture.md, re-export modules)."""

from __future__ import annotations

from trainguard.unit.seeding import (
    CUBLAS_WORKSPACE_CONFIG,
    DeterministicState,
    current_seed,
    deterministic_mode,
    make_generator,
    rng_state,
    seed_everything,
    seed_worker,
    set_deterministic,
    set_rng_state,
)

__all__ = [
    "CUBLAS_WORKSPACE_CONFIG",
    "DeterministicState",
    "current_seed",
    "deterministic_mode",
    "make_generator",
    "rng_state",
    "seed_everything",
    "seed_worker",
    "set_deterministic",
    "set_rng_state",
]
