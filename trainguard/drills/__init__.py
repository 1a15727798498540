"""Fault drills: a real fault injected into a small run of the job, and the judgement of what followed (docs/drills.md)."""

from __future__ import annotations

from trainguard.drills.driver import (
    DRILL_CAUSES,
    drill,
    make_drill,
    run_drill,
    run_drills,
)

__all__ = [
    "DRILL_CAUSES",
    "drill",
    "make_drill",
    "run_drill",
    "run_drills",
]
