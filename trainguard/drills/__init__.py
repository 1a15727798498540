"""Fault drills: a real fault injected into a small run of the job, and the judgement of what
followed (docs/drills.md). :mod:`~trainguard.drills.driver` drives the fault around the run;
:mod:`~trainguard.drills.judges` judges it. ``drill`` and ``run_drills`` run drills as tracked
checks of a session: they live in :mod:`trainguard.session` (``trainguard.session.drill``)."""

from __future__ import annotations

from trainguard.drills.driver import RESTART_BACKOFF_S, make_drill, run_drill
from trainguard.drills.judges import DRILL_CAUSES

__all__ = [
    "DRILL_CAUSES",
    "RESTART_BACKOFF_S",
    "make_drill",
    "run_drill",
]

