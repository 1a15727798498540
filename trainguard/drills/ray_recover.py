"""The ``recover`` judge for a ray_train job whose worker died: Ray Train's FailureConfig
restarts the workers inside one fit, so the recovery is read from the driver's stderr (the
controller's notice, the restart, the new workers, the first step after it), not from a new
attempt (docs/ray-train.md, "Drills")."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from trainguard.drills.evidence import RayRecoverEvidence, RayRestart, Resume
from trainguard.drills.judges import (
    DRILL_CAUSES,
    DrillContext,
    Injection,
    Judgement,
    final_state_words,
    judge_injected,
    recovered_run_problems,
    trajectory_diff,
)
from trainguard.evidence import UNSET, known

if TYPE_CHECKING:  # pragma: no cover
    from trainguard.launch.reach import WorkerSighting

__all__ = ["judge_ray_recover", "new_workers"]


def new_workers(info: Injection, injected: float) -> list[WorkerSighting]:
    """Processes running the ranks that started after the fault (not those alive when it
    struck): the backend restarted them inside the launch (Ray Train's workers)."""
    if info.tracker is None:
        return []
    old = set(info.ray_workers_at_injection.values())
    return [s for s in info.tracker.started_after(injected) if s.pid not in old]


def _ray_restart(c: DrillContext) -> RayRestart:
    """What Ray Train did after the fault, read from the driver's stderr (times in seconds after
    the fault, as trainguard read the lines): the controller's first notice, the restart, the
    new workers' pids, the first step after it, and the steps lost."""
    info, injected = c.info, c.fault.injected_at
    tracker = info.tracker
    out = RayRestart(c.runner.job_file.job.max_restarts, info.ray_workers_at_injection)
    if tracker is None or injected is None:
        return out
    new = new_workers(info, injected)
    groups = sorted({s.pid for s in new if s.rank == 0})
    out.restarts = len(groups)
    out.workers_after = {s.rank: s.pid for s in new}
    notice = tracker.controller_after(injected)
    if notice is not None:
        out.failure_noticed_after_s = round(notice[0] - injected, 3)
        out.failure_notice = notice[1][:300]
    restart = tracker.restart_notice_after(injected)
    if restart is not None:
        out.restart_started_after_s = round(restart[0] - injected, 3)
    if new:
        first_new = min(s.t for s in new)
        out.workers_up_after_s = round(first_new - injected, 3)
        points = [p for p in c.run.attempts[0].points if p.name == c.metric]
        before = [p.step for p in points if p.t < first_new]
        after = [p.step for p in points if p.t >= first_new]
        if after:
            done = max(before, default=0)
            resumed_from = min(after) - 1
            out.resume = Resume(last_step_before=done, resumed_from_step=resumed_from, lost=max(0, done - resumed_from))
    if info.ray_first_step_after_restart_t is not None:
        out.first_step_after_s = round(info.ray_first_step_after_restart_t - injected, 3)
    return out


@judge_injected(RayRecoverEvidence)
def judge_ray_recover(c: DrillContext, evidence: RayRecoverEvidence) -> Judgement:
    """recover for a ray_train job whose worker died: Ray Train's FailureConfig must restart the
    worker group from the latest reported checkpoint inside the same fit."""
    spec, run = c.spec, c.run
    ray = _ray_restart(c)
    evidence.ray = ray
    if ray.failure_noticed_after_s is not UNSET:
        evidence.detected_after_s = ray.failure_noticed_after_s
    resume = known(ray.resume)
    lost = resume.lost if resume else None
    evidence.lost_steps, evidence.resumes = lost, [dataclasses.replace(resume)] if resume else []
    restarts = known(ray.restarts) or 0
    evidence.restarts = restarts
    if ray.first_step_after_s is not UNSET:
        evidence.fault_to_first_step_after_restart_s = ray.first_step_after_s
    steps = list(range(1, spec.steps + 1))
    if spec.fault == "node_loss" and resume:
        # a lost node takes the output its log monitor had not forwarded yet: the step the new
        # group resumed after was done (its checkpoint exists), only its line is gone -- the
        # within-fit form of unprinted_resumed_steps
        seen = {p.step for p in run.points if p.name == c.metric}
        unreported = [s for s in [resume.resumed_from_step] if s >= 1 and s not in seen]
        if unreported:
            ray.unreported_steps = unreported
            steps = [s for s in steps if s not in unreported]
    diff = trajectory_diff(c, run.points, steps)
    evidence.trajectory = diff.as_evidence()
    max_failures = ray.max_failures
    problems: list[str] = []
    if not run.ok:
        why = ("job.max_restarts is 0, so Ray Train's FailureConfig(max_failures=0) fails the fit "
               "on the first worker failure: set job.max_restarts >= 1" if max_failures == 0 else
               f"FailureConfig(max_failures={max_failures}) did not bring it back")
        problems.append(f"Ray Train did not recover: {c.fault.classify(run.final)}; {why}")
    elif not restarts:
        problems.append("the fit completed but no new worker group started after the fault "
                        "(was the worker really hit? see fault_evidence)")
    if restarts > spec.restart_limit:
        problems.append(f"Ray Train restarted the worker group {restarts} times "
                        f"(max_restarts {spec.restart_limit})")
    if resume and resume.resumed_from_step == 0 and resume.last_step_before > 0:
        problems.append(
            "the restarted worker group began again at step 1: all progress lost (does the "
            "function report checkpoints with ray.train.report(..., checkpoint=...) and load "
            "ray.train.get_checkpoint() at start?)"
        )
    if spec.max_lost_steps is not None and lost is not None and lost > spec.max_lost_steps:
        problems.append(f"{lost} steps of progress lost (max_lost_steps {spec.max_lost_steps})")
    if run.ok:
        problems += recovered_run_problems(c, spec, diff, evidence)
    what = f"{spec.fault} on the Ray worker of rank {spec.rank} after step {c.info.injected_step}"
    if problems:
        evidence.likely_causes = [
            "job.max_restarts (Ray Train's FailureConfig(max_failures)) is 0 or too small",
            *DRILL_CAUSES["recover"],
        ]
        return Judgement("failed", f"{what}: " + "; ".join(problems), evidence)
    timing = ", ".join(f"{label} {seconds:.1f} s" for label, seconds in (
        ("failure seen after", ray.failure_noticed_after_s), ("new workers after", ray.workers_up_after_s),
        ("first step after", ray.first_step_after_s)) if seconds is not UNSET)
    same = final_state_words(evidence)
    return Judgement("passed", f"{what}: Ray Train's FailureConfig(max_failures={max_failures}) restarted the "
            f"worker group {restarts} time(s) in the same fit ({timing}), resumed from "
            f"step {resume.resumed_from_step if resume else '?'}, {lost} step(s) lost; all "
            f"{diff.compared_steps} steps match the uninterrupted run{same}", evidence)
