"""Which judge decides a drill: one per expectation (docs/drills.md), the storage faults'
own wrappers aside (:func:`trainguard.drills.storage.storage_judge`)."""

from __future__ import annotations

from trainguard.drills.judges import Judge, judge_continue, judge_fail_clean, judge_recover
from trainguard.drills.nonfinite import judge_handle_nonfinite
from trainguard.drills.ray_recover import judge_ray_recover
from trainguard.drills.save_and_exit import judge_save_and_exit

__all__ = ["judge_for"]

_JUDGES: dict[str, Judge] = {
    "recover": judge_recover, "fail_clean": judge_fail_clean, "continue": judge_continue,
    "save_and_exit": judge_save_and_exit, "handle_nonfinite": judge_handle_nonfinite,
}


def judge_for(expectation: str, *, ray_recover: bool = False) -> Judge:
    """The judge of ``expectation`` (``ray_recover``: a ray_train job's worker death, which Ray
    Train restarts inside the fit)."""
    if expectation == "recover" and ray_recover:
        return judge_ray_recover
    return _JUDGES[expectation]
