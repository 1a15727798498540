"""Which judge decides a drill: its expectation's entry in
:data:`trainguard.config.faults.EXPECTATIONS` (docs/drills.md), the storage faults' own forms
aside (:func:`trainguard.drills.storage.storage_judge`)."""

from __future__ import annotations

from trainguard.config.faults import EXPECTATIONS
from trainguard.drills.expectations import JudgeEntry
from trainguard.drills.ray_recover import judge_ray_recover

__all__ = ["RAY_RECOVER", "judge_for"]

#: recover as Ray Train does it: the workers restarted inside one fit (FailureConfig)
RAY_RECOVER = JudgeEntry("recover", judge_ray_recover)


def judge_for(expectation: str, *, ray_recover: bool = False) -> JudgeEntry:
    """The judge of ``expectation`` (``ray_recover``: a ray_train job's worker death, which Ray
    Train restarts inside the fit)."""
    if expectation == "recover" and ray_recover:
        return RAY_RECOVER
    entry = EXPECTATIONS.get(expectation)
    if not isinstance(entry, JudgeEntry):  # the registry accepts anything with a judge
        return JudgeEntry(entry.name, entry.judge, entry.finishes_later)
    return entry
