"""Compatibility path: the public names of :mod:`trainguard.run.runner` (docs/architecture.md, re-export modules)."""

from __future__ import annotations

from trainguard.run.runner import (
    AheadRun,
    JobRunner,
    RunRequest,
    SupervisedRun,
)

__all__ = [
    "AheadRun",
    "JobRunner",
    "RunRequest",
    "SupervisedRun",
]
