"""Fault drills: a real fault injected into a small run of the user's job, and a verdict on what
followed (docs/drills.md).

A drill (``checks.drills`` in the job file) names a fault, where and when it strikes (``rank``,
``after_step``, ``duration``) and what must follow:

* ``recover``: trainguard, acting as the job's agent, restarts the whole group from the latest
  checkpoint (at most ``max_restarts`` times); the job completes, its trajectory matches the
  uninterrupted reference on every step (the resume check's rules: exact by default,
  ``rtol``/``atol``), and at most ``max_lost_steps`` steps of progress are lost;
* ``fail_clean``: the job exits non-zero by itself within ``deadline`` seconds of the fault,
  with an error on stderr (or dead of a signal), and its latest checkpoint is intact: a run
  resumed from it with the fault removed starts after step 0 and matches the reference;
* ``continue``: the job runs through the fault and completes; its step rate during the fault is
  at least ``min_rate`` of the rate before, its trajectory matches the reference, and the
  fault's own checks (:meth:`~trainguard.faults.base.Fault.verify_continue`) pass.

:func:`run_drill` drives one :class:`~trainguard.faults.base.Fault` through its contract (setup,
launch_env/preexec, inject once when the watched rank prints step ``after_step`` in the first
attempt, clear after ``duration``, teardown in ``finally``) around :meth:`JobRunner.supervise`.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import signal
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from trainguard.checks.equivalence import TrajectoryDiff, compare_trajectories
from trainguard.config import DrillSpec, JobFile
from trainguard.config.faults import FaultNotInstalled, fault_class
from trainguard.faults.base import Fault, FaultContext, FaultUnavailable
from trainguard.launch import Launcher, MetricPoint, RunResult
from trainguard.launch.metrics import aligned_trajectories
from trainguard.launch.rundir import new_run_dir
from trainguard.report import CheckResult, CheckStatus, Report
from trainguard.run.runner import JobRunner, RunRequest, SupervisedRun
from trainguard.unit.checkpoints import compare_checkpoint_dirs

if TYPE_CHECKING:  # pragma: no cover
    from trainguard.raytrain.workers import RayWorkerTracker, WorkerSighting

__all__ = ["DRILL_CAUSES", "drill", "make_drill", "run_drill", "run_drills"]

#: seconds between a failed attempt and the restart (the agent's backoff; kept short here)
RESTART_BACKOFF_S = 0.5
#: fail_clean: the launcher's stall limit is at least the deadline plus this, so the job gets its
#: whole deadline to exit by itself before trainguard's own hang detection would step in
_DEADLINE_MARGIN_S = 5.0
_WATCH_S = 0.02
#: faults that kill a Ray Train worker process: Ray Train sees the death itself, so for a
#: ray_train job `expect: recover` means its FailureConfig restarts the worker group inside the
#: same fit (trainguard does not restart the driver); a hang it does not see (docs/ray-train.md)
RAY_RECOVERED_FAULTS = ("kill_rank", "oom")
_ERROR_WORDS = re.compile(r"error|exception|traceback|fatal|abort|killed|timed? ?out", re.I)

DRILL_CAUSES = {
    "recover": (
        "no checkpoint before the fault (checkpoints only at exit, or too rarely for the run)",
        "resume_args do not make the job load the latest checkpoint",
        "state missing from the checkpoint (optimizer, scheduler, RNG, data position)",
        "a checkpoint written in place, torn by the kill",
    ),
    "fail_clean": (
        "no timeout on collectives: a rank waits forever for a stuck or dead peer "
        "(init_process_group(timeout=...) / NCCL_ASYNC_ERROR_HANDLING)",
        "the error is caught and swallowed, and the job goes on or exits 0",
        "a checkpoint overwritten in place: the failure leaves it torn",
    ),
    "continue": (
        "blocking I/O in the training loop (tracking or logging calls without a timeout)",
        "retries without a bound or with a long fixed sleep",
    ),
}


@dataclass
class _Injection:
    """What happened around the fault; filled from the launcher's monitor thread and the watch."""

    watch_rank: int
    injected_mono: float | None = None  # time.monotonic() at injection
    injected_step: int | None = None
    target_exited_before: bool = False  # the target rank had already exited at injection
    first_exit: tuple[int, int | None, float] | None = None  # (rank, returncode, elapsed)
    stopped_at_deadline: bool = False
    first_step_after_restart_mono: float | None = None
    stderr_offsets: dict[int, int] = field(default_factory=dict)
    run_dir: Path | None = None
    errors: list[str] = field(default_factory=list)
    inject_failed: str | None = None  # what Fault.inject raised: nothing was tested
    #: a ray_train job: the driver's stderr, read for the workers' pids (attempt 0)
    tracker: RayWorkerTracker | None = None
    ray_workers_at_injection: dict[int, int] = field(default_factory=dict)
    #: launcher elapsed time of the first metric point after Ray Train restarted the workers
    ray_first_step_after_restart_t: float | None = None


class _Driver:
    """Injects the fault once, clears it after ``duration``, watches the first attempt's ranks
    (first exit, fail_clean deadline) on a thread of its own, never blocking the monitor."""

    def __init__(self, fault: Fault, spec: DrillSpec, metric: str, watch_rank: int,
                 ray_world_size: int | None = None) -> None:
        self.fault = fault
        self.ray_world_size = ray_world_size  # set for a ray_train job: its ranks are Ray workers
        self.spec = spec
        self.metric = metric
        self.info = _Injection(watch_rank=watch_rank)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def on_metric(self, point: MetricPoint, launcher: Launcher) -> None:
        info = self.info
        if launcher.spec.restart_count > 0:
            if info.first_step_after_restart_mono is None and point.name == self.metric:
                info.first_step_after_restart_mono = time.monotonic()
            return
        if self.ray_world_size is not None:
            self._ray_point(point, launcher)
        if (
            info.injected_mono is not None
            or point.name != self.metric
            or point.rank != info.watch_rank
            or point.step < self.spec.after_step
        ):
            return
        info.run_dir = launcher.spec.run_dir
        for rp in launcher.ranks:
            with contextlib.suppress(OSError):
                info.stderr_offsets[rp.rank] = rp.stderr_log.stat().st_size
        at = launcher.elapsed()
        info.injected_mono = time.monotonic()
        info.injected_step = point.step
        target = launcher
        if info.tracker is not None:  # the fault's ranks are the Ray workers, by their pids
            from trainguard.raytrain.workers import RayWorkerLauncher

            target = cast(Launcher, RayWorkerLauncher(launcher, info.tracker, self.ray_world_size or 1))
            info.ray_workers_at_injection = info.tracker.pids()
        try:
            with contextlib.suppress(OSError):  # a Ray worker elsewhere: the fault says if it cares
                info.target_exited_before = target.ranks[self.fault.rank].popen.poll() is not None
            self.fault.inject(target)
        except Exception as exc:  # the monitor thread must go on; the verdict reports it
            info.errors.append(f"inject() raised {type(exc).__name__}: {exc}")
            info.inject_failed = f"{type(exc).__name__}: {exc}"
        if self.fault.injected_at is None:
            self.fault.injected_at = at
        self._thread = threading.Thread(
            target=self._watch, args=(launcher,), name="trainguard-drill-watch", daemon=True
        )
        self._thread.start()

    def _ray_point(self, point: MetricPoint, launcher: Launcher) -> None:
        """Attempt 0 of a ray_train job: follow its workers; note the first step after Ray
        Train restarted them (a worker line read after the fault)."""
        info = self.info
        if info.tracker is None:
            from trainguard.raytrain.workers import RayWorkerTracker

            info.tracker = RayWorkerTracker(launcher.ranks[0].stderr_log, clock=launcher.elapsed)
        info.tracker.poll()  # stamp the worker lines when they come, not at the injection
        injected = self.fault.injected_at
        if (injected is None or info.ray_first_step_after_restart_t is not None
                or point.name != self.metric):
            return
        if _new_workers(info, injected):
            info.ray_first_step_after_restart_t = point.t
            info.first_step_after_restart_mono = time.monotonic()

    def _watch(self, launcher: Launcher) -> None:
        info, spec = self.info, self.spec
        assert info.injected_mono is not None
        fail_clean = spec.expectation == "fail_clean"
        while not self._stop.wait(_WATCH_S):
            if info.tracker is not None:
                info.tracker.poll()  # stamps worker and controller lines as they come
            since = time.monotonic() - info.injected_mono
            if spec.duration is not None and self.fault.cleared_at is None and since >= spec.duration:
                self.clear(launcher.elapsed())
            codes = [(rp.rank, rp.popen.poll()) for rp in launcher.ranks]
            if info.first_exit is None:
                done = [(rank, code) for rank, code in codes if code is not None]
                if done:
                    # two exits seen in one poll: the launcher's teardown SIGTERMs the others
                    # after the first death, so a rank ended by SIGTERM came second
                    rank, code = min(done, key=lambda rc: (rc[1] == -signal.SIGTERM, rc[0]))
                    info.first_exit = (rank, code, launcher.elapsed())
            if (fail_clean and info.first_exit is None and not info.stopped_at_deadline
                    and since > spec.deadline_s):
                info.stopped_at_deadline = True
                launcher.stop(
                    f"no rank exited within the drill's deadline of {spec.deadline_s:g} s "
                    "after the fault"
                )
            attempt_over = all(code is not None for _, code in codes)
            if attempt_over and info.tracker is not None:
                # a Ray worker is out of the launcher's teardown: a stopped one must go on (and
                # die with its job) before the next attempt wants its CPUs
                self.clear(launcher.elapsed())
            if attempt_over and (spec.duration is None or self.fault.cleared_at is not None):
                return

    def clear(self, at: float | None = None) -> None:
        """Clear the fault once (the duration elapsed, or a verification run comes next)."""
        with self._lock:
            if self.fault.cleared_at is not None:
                return
            try:
                self.fault.clear()
            except Exception as exc:
                self.info.errors.append(f"clear() raised {type(exc).__name__}: {exc}")
            if self.info.injected_mono is not None:
                self.fault.cleared_at = at if at is not None else (
                    (self.fault.injected_at or 0.0) + time.monotonic() - self.info.injected_mono
                )

    def finish(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)


def _progress_metric(job_file: JobFile) -> str:
    metrics = job_file.job.metrics
    return "loss" if "loss" in metrics else next(iter(metrics))


def _request(runner: JobRunner, spec: DrillSpec) -> RunRequest:
    return runner.request_for(spec, world_size=spec.world_size or runner.job_file.job.world_size)


def _points(result: RunResult, metric: str, rank: int | None = None) -> list[MetricPoint]:
    return sorted(
        (p for p in result.points if p.name == metric and (rank is None or p.rank == rank)),
        key=lambda p: p.t,
    )


def _rate(points: list[MetricPoint], start: float | None = None, end: float | None = None) -> float | None:
    """Steps per second: over ``[start, end]`` when given, else between the first and last point."""
    if start is not None and end is not None:
        span = end - start
        inside = [p for p in points if start < p.t <= end]
        return len(inside) / span if span > 0 else None
    if len(points) < 2 or points[-1].t <= points[0].t:
        return None
    return (points[-1].step - points[0].step) / (points[-1].t - points[0].t)


def _round(value: float | None, digits: int = 3) -> float | None:
    return None if value is None else round(value, digits)


def _attempt_evidence(result: RunResult, fault: Fault) -> dict[str, Any]:
    entry: dict[str, Any] = {
        "outcome": result.outcome,
        "reason": result.reason,
        "exits": [
            {"rank": e.rank, "returncode": e.returncode, "signal": e.signal,
             "killed_by_trainguard": e.killed_by_trainguard}
            for e in result.exits
        ],
        "last_step": result.last_step,
        "duration_s": round(result.duration_s, 2),
        "run_dir": str(result.run_dir),
    }
    if not result.ok:
        entry["failed_rank"] = result.failed_rank
        entry["classified"] = fault.classify(result)
        entry["stderr_tail"] = result.stderr_tail[-1500:]
    stacks = result.evidence.get("stacks")
    if stacks:
        entry["stacks_dumped"] = sorted(int(r) for r, text in stacks.items() if not text.startswith("("))
        entry["stacks"] = {r: text[-2000:] for r, text in stacks.items()}
    return entry


def _detected_after(result: RunResult, info: _Injection, fault: Fault, stall_limit: float) -> float | None:
    """Seconds from the injection to trainguard's (or the job's) reaction that ended attempt 0."""
    if fault.injected_at is None:
        return None
    if result.outcome == "hung" and result.detected_after_s is not None:
        last = max((p.t for p in result.points), default=0.0)
        return round(last + stall_limit + result.detected_after_s - fault.injected_at, 3)
    if info.first_exit is not None:
        return round(info.first_exit[2] - fault.injected_at, 3)
    return round(result.duration_s - fault.injected_at, 3)


def _new_stderr(result: RunResult, info: _Injection, rank: int) -> str:
    """What ``rank`` wrote to stderr after the fault was injected."""
    with contextlib.suppress(OSError), open(result.log_path(rank), "rb") as handle:
        handle.seek(info.stderr_offsets.get(rank, 0))
        return handle.read().decode("utf-8", errors="replace")
    return ""


def _recovered_run_problems(c: _Context, spec: DrillSpec, diff: TrajectoryDiff, evidence: dict[str, Any]) -> list[str]:
    """A recovered run must match the uninterrupted one: its trajectory and its final checkpoint."""
    problems = []
    problem = _diff_problem(c.metric, diff, "recovered run")
    if problem:
        problems.append(problem)
    state = compare_checkpoint_dirs(c.checkpoint_dir, Path(c.reference.evidence["checkpoint_dir"]),
                                    rtol=spec.rtol, atol=spec.atol)
    evidence["checkpoint"] = state.as_evidence()
    if state.compared and not state.ok:
        keys = ", ".join(k for k, _ in state.differing[:5])
        problems.append(f"the final checkpoint differs from the uninterrupted run's ({keys})")
    return problems


def _diff_problem(metric: str, diff: TrajectoryDiff, what: str) -> str | None:
    if diff.ok:
        return None
    if diff.first_divergent_step is not None:
        a, b = diff.first_values or (math.nan, math.nan)
        return (
            f"{metric} of the {what} diverges from the uninterrupted run at step "
            f"{diff.first_divergent_step} ({a!r} vs {b!r}; max abs diff {diff.max_abs_diff:.3g})"
        )
    return f"the {what} is missing steps {diff.missing_in_actual[:5]} of the uninterrupted run"


def run_drill(runner: JobRunner, spec: DrillSpec) -> CheckResult:
    """Run one drill and judge it; the result is named ``drill:<name>``."""
    started = time.monotonic()
    name = f"drill:{spec.name}"
    job_file = runner.job_file
    reproduce = f"trainguard drill {job_file.path} --only {spec.name}"
    base: dict[str, Any] = {
        "fault": spec.fault, "expect": spec.expectation, "rank": spec.rank,
        "after_step": spec.after_step, "duration": spec.duration, "steps": spec.steps,
    }

    def result(status: CheckStatus, summary: str, evidence: dict[str, Any]) -> CheckResult:
        return CheckResult(name, status, summary, {**base, **evidence},
                           time.monotonic() - started, reproduce)

    try:
        cls = fault_class(spec.fault)
    except FaultNotInstalled as exc:
        return result("error", str(exc), {})
    fault = cls(spec.params, rank=spec.rank, after_step=spec.after_step, duration=spec.duration)
    metric = _progress_metric(job_file)
    request = _request(runner, spec)
    reference = runner.reference(request)
    if not reference.ok:
        return result("error", f"the uninterrupted reference run failed, so there is nothing to "
                      f"drill: {reference.reason}", {"reference": _attempt_evidence(reference, fault)})
    reporting = sorted({p.rank for p in reference.points if p.name == metric})
    if not reporting:
        return result("error", f"the reference run printed no `{metric}` line; check "
                      f"job.metrics.{metric}", {"reference_run_dir": str(reference.run_dir)})
    # a job may print its loss on rank 0 only: then the fault strikes when rank 0 reports the step
    watch_rank = spec.rank if spec.rank in reporting else reporting[0]

    drill_dir = new_run_dir(job_file.state_dir, job_file.job.name, f"drill-{spec.name}",
                            keep=runner.settings.keep_runs)
    values = runner.placeholders(request, drill_dir, drill_dir / "checkpoints")
    ray_job = job_file.job.kind == "ray_train"
    ctx = FaultContext(
        work_dir=drill_dir / "fault",
        checkpoint_dir=drill_dir / "checkpoints",
        world_size=request.world_size,
        env={**{k: v.format_map(values) for k, v in job_file.job.env.items()},
             **{k: v.format_map(values) for k, v in request.env}},
        ray_train=ray_job,
    )
    ctx.work_dir.mkdir(parents=True, exist_ok=True)
    ctx.checkpoint_dir.mkdir(parents=True, exist_ok=True)
    driver = _Driver(fault, spec, metric, watch_rank, request.world_size if ray_job else None)
    # Ray Train recovers a dead worker itself (FailureConfig): trainguard must not restart too
    ray_recover = ray_job and spec.expectation == "recover" and spec.fault in RAY_RECOVERED_FAULTS
    stall = spec.stall_timeout or job_file.job.stall_timeout
    if spec.expectation == "fail_clean":
        stall = max(stall, spec.deadline_s + _DEADLINE_MARGIN_S)
    try:
        try:
            fault.setup(ctx)
        except FaultUnavailable as exc:
            return result("skipped", f"{spec.fault} cannot be injected on this machine: {exc}",
                          {"fault_evidence": fault.evidence()})
        run = runner.supervise(
            request,
            label=f"drill-{spec.name}",
            max_restarts=0 if ray_recover else spec.restart_limit,
            backoff_s=RESTART_BACKOFF_S,
            on_metric=driver.on_metric,
            extra_env=fault.launch_env(ctx),
            preexec=fault.preexec if fault.needs_preexec and not ray_job else None,
            checkpoint_dir=ctx.checkpoint_dir,
            stall_timeout=stall,
            # a short drill stall limit must not cut the job's start-up (imports, rendezvous)
            startup_timeout=max(stall, job_file.job.stall_timeout),
        )
        driver.finish()
        driver.clear()
        judge = {"recover": _judge_ray_recover if ray_recover else _judge_recover,
                 "fail_clean": _judge_fail_clean, "continue": _judge_continue}[spec.expectation]
        status, summary, evidence = judge(
            _Context(runner, spec, fault, driver.info, run, reference, request, metric,
                     ctx.checkpoint_dir, stall * runner.settings.timeout_scale)
        )
        evidence["drill_dir"] = str(drill_dir)
        return result(status, summary, evidence)
    finally:  # Ctrl-C included: nothing is left stopped, mounted or running
        driver.finish()
        with contextlib.suppress(Exception):
            fault.teardown()


@dataclass
class _Context:
    runner: JobRunner
    spec: DrillSpec
    fault: Fault
    info: _Injection
    run: SupervisedRun
    reference: RunResult
    request: RunRequest
    metric: str
    checkpoint_dir: Path
    stall_limit: float


def _common_evidence(c: _Context) -> dict[str, Any]:
    first = c.run.attempts[0]
    watched = _points(first, c.metric, c.info.watch_rank)
    injected, cleared = c.fault.injected_at, c.fault.cleared_at
    before = [p for p in watched if injected is None or p.t <= injected]
    during_end = cleared if cleared is not None else first.duration_s
    rates: dict[str, Any] = {
        "unit": f"steps/s of rank {c.info.watch_rank}",
        "before": _round(_rate(before[1:] if len(before) > 2 else before)),  # step 1 pays start-up
        "during": _round(_rate(watched, injected, during_end)) if injected is not None else None,
    }
    if cleared is not None:
        rates["after_clear"] = _round(_rate([p for p in watched if p.t > cleared]))
    if c.run.restarts:
        rates["after_restart"] = _round(_rate(_points(c.run.final, c.metric, c.info.watch_rank)))
    evidence: dict[str, Any] = {
        "injected_at_s": _round(injected), "injected_after_step": c.info.injected_step,
        "watched_rank": c.info.watch_rank,
        # the watched rank's progress when the fault struck (output read up to then): the
        # monitor reads the job's lines with a lag, which grows on a loaded machine
        "watched_rank_step_at_injection": max((p.step for p in before), default=None),
        "detected_after_s": _detected_after(first, c.info, c.fault, c.stall_limit),
        "attempt_ended_after_s": _round(first.duration_s - injected) if injected is not None else None,
        "restarts": c.run.restarts,
        "attempts": [_attempt_evidence(a, c.fault) for a in c.run.attempts],
        "step_rate": rates,
        "fault_evidence": c.fault.evidence(),
        "reference_run_dir": str(c.reference.run_dir),
    }
    if c.info.first_exit is not None:
        rank, code, _ = c.info.first_exit
        evidence["first_exit"] = {"rank": rank, "returncode": code}
    if c.info.errors:
        evidence["fault_errors"] = c.info.errors
    return evidence


def _not_injected(c: _Context) -> tuple[CheckStatus, str, dict[str, Any]] | None:
    """An error verdict when the fault never struck the running job (so nothing was tested)."""
    first = c.run.attempts[0]
    if c.fault.injected_at is None:
        how = "finished" if first.ok else f"ended ({first.reason or first.outcome})"
        return ("error", f"the fault was never injected: the first attempt {how} before rank "
                f"{c.info.watch_rank} printed step {c.spec.after_step} of `{c.metric}`",
                _common_evidence(c))
    evidence = _common_evidence(c)
    if c.info.inject_failed is not None:
        return ("error", f"the fault could not be injected after step {c.info.injected_step}: "
                f"{c.info.inject_failed}", evidence)
    reached = evidence["watched_rank_step_at_injection"]
    if c.info.target_exited_before or (reached is not None and reached >= c.spec.steps):
        where = (f"rank {c.spec.rank} had already exited" if c.info.target_exited_before
                 else f"rank {c.info.watch_rank} had already printed its last step ({reached})")
        return ("error", f"the fault came too late to test anything: {where} when trainguard read "
                f"step {c.info.injected_step} and injected it (the job's output is read with a "
                "lag that grows on a loaded machine); give the drill more steps after after_step",
                evidence)
    return None


def _trajectory(c: _Context, points: Iterable[MetricPoint], steps: range) -> TrajectoryDiff:
    actual, expected = aligned_trajectories(list(points), c.reference.points, c.metric)
    return compare_trajectories(actual, expected, metric=c.metric, steps=steps,
                                rtol=c.spec.rtol, atol=c.spec.atol)


def _lost_steps(c: _Context) -> tuple[int, list[dict[str, Any]], bool]:
    """Steps of progress lost over all restarts; per restart; whether one restarted from 0."""
    total, per, from_scratch = 0, [], False
    for failed, nxt in zip(c.run.attempts, c.run.attempts[1:]):
        done = max((p.step for p in failed.points if p.name == c.metric), default=0)
        steps = [p.step for p in nxt.points if p.name == c.metric]
        if not steps:
            continue
        resumed_from = min(steps) - 1
        lost = max(0, done - resumed_from)
        total += lost
        from_scratch |= resumed_from == 0 and done > 0
        per.append({"last_step_before": done, "resumed_from_step": resumed_from, "lost": lost})
    return total, per, from_scratch


def _judge_recover(c: _Context) -> tuple[CheckStatus, str, dict[str, Any]]:
    skipped = _not_injected(c)
    if skipped:
        return skipped
    evidence = _common_evidence(c)
    spec, run = c.spec, c.run
    lost, per_restart, from_scratch = _lost_steps(c)
    evidence.update({"lost_steps": lost, "resumes": per_restart})
    diff = _trajectory(c, run.points, range(1, spec.steps + 1))
    evidence["trajectory"] = diff.as_evidence()
    problems: list[str] = []
    if not run.ok:
        final = run.final
        problems.append(
            f"did not recover: after {run.restarts} restart(s) (max_restarts {spec.restart_limit}) "
            f"the last attempt ended: {c.fault.classify(final)}"
        )
    if from_scratch:
        problems.append(
            "the restarted job began again at step 1: no usable checkpoint, all progress lost "
            "(does the job checkpoint during the run, and do resume_args load the latest one?)"
        )
    if spec.max_lost_steps is not None and lost > spec.max_lost_steps:
        problems.append(f"{lost} steps of progress lost (max_lost_steps {spec.max_lost_steps})")
    if run.ok:
        problems += _recovered_run_problems(c, spec, diff, evidence)
    first = run.attempts[0]
    detected = evidence["detected_after_s"]
    what = (f"{spec.fault} on rank {spec.rank} after step {c.info.injected_step}: "
            f"attempt 0 {first.outcome} ({c.fault.classify(first) if not first.ok else 'no failure'}"
            f"{f', detected after {detected:.2f} s' if detected is not None else ''})")
    if problems:
        evidence["likely_causes"] = list(DRILL_CAUSES["recover"])
        return "failed", f"{what}; " + "; ".join(problems), evidence
    recovery = None
    if c.info.injected_mono is not None and c.info.first_step_after_restart_mono is not None:
        recovery = c.info.first_step_after_restart_mono - c.info.injected_mono
        evidence["fault_to_first_step_after_restart_s"] = round(recovery, 3)
    restarts = (f"recovered with {run.restarts} restart(s), {lost} step(s) lost"
                + (f", first step {recovery:.1f} s after the fault" if recovery is not None else ""))
    if not run.restarts:
        restarts = "the job completed without needing a restart"
    state = evidence.get("checkpoint", {})
    same = ", final checkpoints equal" if state.get("compared") else ""
    return ("passed", f"{what}; {restarts}; all {diff.compared_steps} steps match the "
            f"uninterrupted run{same}", evidence)


def _new_workers(info: _Injection, injected: float) -> list[WorkerSighting]:
    """Ray workers that started after the fault (not those alive when it struck)."""
    if info.tracker is None:
        return []
    old = set(info.ray_workers_at_injection.values())
    return [s for s in info.tracker.started_after(injected) if s.pid not in old]


def _ray_restart(c: _Context) -> dict[str, Any]:
    """What Ray Train did after the fault, read from the driver's stderr (times in seconds after
    the fault, as trainguard read the lines): the controller's first notice, the restart, the
    new workers' pids, the first step after it, and the steps lost."""
    info, injected = c.info, c.fault.injected_at
    tracker = info.tracker
    out: dict[str, Any] = {"max_failures": c.runner.job_file.job.max_restarts,
                           "workers_at_fault": info.ray_workers_at_injection}
    if tracker is None or injected is None:
        return out
    new = _new_workers(info, injected)
    groups = sorted({s.pid for s in new if s.rank == 0})
    out["restarts"] = len(groups)
    out["workers_after"] = {s.rank: s.pid for s in new}
    notice = tracker.controller_after(injected)
    if notice is not None:
        out["failure_noticed_after_s"] = round(notice[0] - injected, 3)
        out["failure_notice"] = notice[1][:300]
    restart = tracker.restart_notice_after(injected)
    if restart is not None:
        out["restart_started_after_s"] = round(restart[0] - injected, 3)
    if new:
        first_new = min(s.t for s in new)
        out["workers_up_after_s"] = round(first_new - injected, 3)
        points = [p for p in c.run.attempts[0].points if p.name == c.metric]
        before = [p.step for p in points if p.t < first_new]
        after = [p.step for p in points if p.t >= first_new]
        if after:
            done = max(before, default=0)
            resumed_from = min(after) - 1
            out["resume"] = {"last_step_before": done, "resumed_from_step": resumed_from,
                             "lost": max(0, done - resumed_from)}
    if info.ray_first_step_after_restart_t is not None:
        out["first_step_after_s"] = round(info.ray_first_step_after_restart_t - injected, 3)
    return out


def _judge_ray_recover(c: _Context) -> tuple[CheckStatus, str, dict[str, Any]]:
    """recover for a ray_train job whose worker died: Ray Train's FailureConfig must restart the
    worker group from the latest reported checkpoint inside the same fit."""
    skipped = _not_injected(c)
    if skipped:
        return skipped
    evidence = _common_evidence(c)
    spec, run = c.spec, c.run
    ray = _ray_restart(c)
    evidence["ray"] = ray
    if "failure_noticed_after_s" in ray:
        evidence["detected_after_s"] = ray["failure_noticed_after_s"]
    resume = ray.get("resume")
    lost = resume["lost"] if resume else None
    evidence.update({"lost_steps": lost, "resumes": [resume] if resume else [],
                     "restarts": ray.get("restarts", 0)})
    if ray.get("first_step_after_s") is not None:
        evidence["fault_to_first_step_after_restart_s"] = ray["first_step_after_s"]
    diff = _trajectory(c, run.points, range(1, spec.steps + 1))
    evidence["trajectory"] = diff.as_evidence()
    max_failures = ray["max_failures"]
    problems: list[str] = []
    if not run.ok:
        why = ("job.max_restarts is 0, so Ray Train's FailureConfig(max_failures=0) fails the fit "
               "on the first worker failure: set job.max_restarts >= 1" if max_failures == 0 else
               f"FailureConfig(max_failures={max_failures}) did not bring it back")
        problems.append(f"Ray Train did not recover: {c.fault.classify(run.final)}; {why}")
    elif not ray.get("restarts"):
        problems.append("the fit completed but no new worker group started after the fault "
                        "(was the worker really hit? see fault_evidence)")
    if ray.get("restarts", 0) > spec.restart_limit:
        problems.append(f"Ray Train restarted the worker group {ray['restarts']} times "
                        f"(max_restarts {spec.restart_limit})")
    if resume and resume["resumed_from_step"] == 0 and resume["last_step_before"] > 0:
        problems.append(
            "the restarted worker group began again at step 1: all progress lost (does the "
            "function report checkpoints with ray.train.report(..., checkpoint=...) and load "
            "ray.train.get_checkpoint() at start?)"
        )
    if spec.max_lost_steps is not None and lost is not None and lost > spec.max_lost_steps:
        problems.append(f"{lost} steps of progress lost (max_lost_steps {spec.max_lost_steps})")
    if run.ok:
        problems += _recovered_run_problems(c, spec, diff, evidence)
    what = f"{spec.fault} on the Ray worker of rank {spec.rank} after step {c.info.injected_step}"
    if problems:
        evidence["likely_causes"] = [
            "job.max_restarts (Ray Train's FailureConfig(max_failures)) is 0 or too small",
            *DRILL_CAUSES["recover"],
        ]
        return "failed", f"{what}: " + "; ".join(problems), evidence
    timing = ", ".join(f"{label} {ray[key]:.1f} s" for label, key in (
        ("failure seen after", "failure_noticed_after_s"), ("new workers after", "workers_up_after_s"),
        ("first step after", "first_step_after_s")) if ray.get(key) is not None)
    same = ", final checkpoints equal" if evidence.get("checkpoint", {}).get("compared") else ""
    return ("passed", f"{what}: Ray Train's FailureConfig(max_failures={max_failures}) restarted the "
            f"worker group {ray['restarts']} time(s) in the same fit ({timing}), resumed from "
            f"step {resume['resumed_from_step'] if resume else '?'}, {lost} step(s) lost; all "
            f"{diff.compared_steps} steps match the uninterrupted run{same}", evidence)


def _judge_fail_clean(c: _Context) -> tuple[CheckStatus, str, dict[str, Any]]:
    skipped = _not_injected(c)
    if skipped:
        return skipped
    evidence = _common_evidence(c)
    spec, info = c.spec, c.info
    first = c.run.attempts[0]
    problems: list[str] = []
    exit_after = None
    if info.first_exit is not None and c.fault.injected_at is not None:
        exit_after = info.first_exit[2] - c.fault.injected_at
        evidence["exit_after_s"] = round(exit_after, 3)
    if first.ok:
        problems.append("the job completed (exit 0) despite the fault; expected it to fail"
                        + (f" (Ray Train's FailureConfig(max_failures={c.runner.job_file.job.max_restarts})"
                           " restarted the worker group: for this job use `expect: recover`, or "
                           "job.max_restarts 0)" if c.runner.job_file.job.kind == "ray_train"
                           and c.runner.job_file.job.max_restarts else ""))
    elif info.stopped_at_deadline:
        problems.append(f"the job hung: no rank exited within {spec.deadline_s:g} s of the fault "
                        "(trainguard stopped it at the deadline)")
    elif first.outcome == "hung":
        problems.append(f"the job hung: trainguard's stall detection ended it ({first.reason}); "
                        "no rank exited by itself")
    elif first.outcome != "failed":
        problems.append(f"the attempt ended as {first.outcome}: {first.reason}")
    elif exit_after is not None and exit_after > spec.deadline_s:
        problems.append(f"the job exited {exit_after:.1f} s after the fault, later than the "
                        f"deadline of {spec.deadline_s:g} s")
    if first.outcome == "failed" and first.failed_rank is not None:
        rank = first.failed_rank
        exit_info = next((e for e in first.exits if e.rank == rank), None)
        text = _new_stderr(first, info, rank)
        evidence["failed_rank_stderr_after_fault"] = text[-1500:]
        if exit_info is not None and exit_info.signal:
            evidence["error_reported"] = f"rank {rank} died of {exit_info.signal} (no chance to write)"
        elif _ERROR_WORDS.search(text):
            evidence["error_reported"] = "yes"
        else:
            problems.append(f"rank {rank} exited with code {exit_info.returncode if exit_info else '?'} "
                            "but wrote no error to stderr after the fault")
    # the latest checkpoint must be intact: resume from it with the fault removed
    verify = c.runner.run(c.request, label=f"drill-{spec.name}-verify", resume=True,
                          checkpoint_dir=c.checkpoint_dir)
    evidence["verification"] = _attempt_evidence(verify, c.fault)
    done = max((p.step for p in first.points if p.name == c.metric), default=0)
    if not verify.ok:
        problems.append(f"the resume run from the latest checkpoint (fault removed) failed: "
                        f"{verify.reason} -- the checkpoint is not usable")
        evidence["checkpoint"] = {"intact": False, "why": verify.reason}
    else:
        steps = [p.step for p in verify.points if p.name == c.metric]
        resumed_from = min(steps) - 1 if steps else None
        lost = max(0, done - resumed_from) if resumed_from is not None else None
        evidence.update({"resumed_from_step": resumed_from, "lost_steps": lost})
        diff = _trajectory(c, verify.points, range((resumed_from or 0) + 1, spec.steps + 1))
        evidence["trajectory"] = diff.as_evidence()
        intact = True
        if resumed_from is None:
            problems.append(f"the resume run printed no `{c.metric}` line")
            intact = False
        elif resumed_from == 0:
            problems.append("the resume run started again from step 1: no usable checkpoint from "
                            f"before the fault (the job had reached step {done})")
            intact = False
        problem = _diff_problem(c.metric, diff, "run resumed from the checkpoint")
        if problem:
            problems.append(problem)
            intact = False
        if spec.max_lost_steps is not None and lost is not None and lost > spec.max_lost_steps:
            problems.append(f"{lost} steps of progress lost (max_lost_steps {spec.max_lost_steps})")
        evidence["checkpoint"] = {"intact": intact, "resumed_from_step": resumed_from}
    how = c.fault.classify(first) if not first.ok else "completed"
    what = (f"{spec.fault} on rank {spec.rank} after step {info.injected_step}: {how}"
            + (f" {exit_after:.2f} s after the fault" if exit_after is not None and not first.ok else ""))
    if problems:
        evidence["likely_causes"] = list(DRILL_CAUSES["fail_clean"])
        return "failed", f"{what}; " + "; ".join(problems), evidence
    return ("passed", f"{what} (deadline {spec.deadline_s:g} s), error reported; resumed from "
            f"checkpoint step {evidence['resumed_from_step']} with the fault removed and matched the "
            "uninterrupted run", evidence)


def _judge_continue(c: _Context) -> tuple[CheckStatus, str, dict[str, Any]]:
    skipped = _not_injected(c)
    if skipped:
        return skipped
    evidence = _common_evidence(c)
    spec, run = c.spec, c.run
    problems: list[str] = []
    final = run.final
    if not final.ok:
        problems.append(f"the job did not run through the fault: {c.fault.classify(final)}")
    diff = _trajectory(c, run.points, range(1, spec.steps + 1))
    evidence["trajectory"] = diff.as_evidence()
    if final.ok:
        problem = _diff_problem(c.metric, diff, "run under the fault")
        if problem:
            problems.append(problem)
    rates = evidence["step_rate"]
    before, during = rates.get("before"), rates.get("during")
    ratio = during / before if before and during is not None else None
    rates["during_over_before"] = _round(ratio)
    if ratio is None:
        evidence["rate_note"] = "too few steps before the fault to measure the rate"
    elif ratio < spec.rate_floor:
        problems.append(f"the step rate during the fault fell to {ratio:.0%} of the rate before "
                        f"({during:.2f} vs {before:.2f} steps/s; min_rate {spec.rate_floor:g})")
    try:
        problems += c.fault.verify_continue(final)
    except Exception as exc:
        problems.append(f"the fault's own check raised {type(exc).__name__}: {exc}")
    evidence["fault_evidence"] = c.fault.evidence()  # with what its own check found
    what = f"{spec.fault} on rank {spec.rank} after step {c.info.injected_step} for {spec.duration:g} s"
    if problems:
        evidence["likely_causes"] = list(DRILL_CAUSES["continue"])
        return "failed", f"{what}: " + "; ".join(problems), evidence
    shown = f"{ratio:.0%} of the rate before" if ratio is not None else "rate not measured"
    return ("passed", f"{what}: the job ran through it ({shown}) and matches the uninterrupted "
            f"run on all {diff.compared_steps} steps", evidence)


def run_drills(
    runner: JobRunner,
    specs: Iterable[DrillSpec] | None = None,
    *,
    on_result: Callable[[CheckResult], None] | None = None,
) -> list[CheckResult]:
    """Run ``specs`` (default: every drill of the runner's job file), each through
    :func:`trainguard.session.run_check` (tracked like any check)."""
    from trainguard.session import run_check

    results = []
    for spec in runner.job_file.checks.drills if specs is None else specs:
        outcome = run_check(runner, f"drill:{spec.name}", spec)
        results.append(outcome)
        if on_result is not None:
            on_result(outcome)
    return results


def drill(
    config: str | os.PathLike[str],
    *,
    only: Iterable[str] | None = None,
    report_json: str | None = None,
    seed: int | None = None,
    echo: Callable[[int, str, str], None] | None = None,
    on_result: Callable[[CheckResult], None] | None = None,
) -> Report:
    """Run a job file's drills (or ``only`` those names) and write the report (default
    ``.trainguard/drills-report.json``); the library form of ``trainguard drill``."""
    from trainguard.config import load_config
    from trainguard.session import check

    job_file = load_config(config)
    names = [n if n.startswith("drill:") else f"drill:{n}" for n in only] if only else ["drills"]
    target = report_json or str(job_file.state_dir / "drills-report.json")
    return check(job_file.path, only=names, seed=seed, report_json=target, echo=echo,
                 on_result=on_result)


def make_drill(job_file: JobFile, fields: dict[str, Any]) -> DrillSpec:
    """A drill spec for ``job_file`` from ``fields`` (the keys of a ``checks.drills`` entry; keys
    that are not drill fields are the fault's ``params``), validated like the job file's own
    drills: a :class:`~trainguard.errors.ConfigError` names every problem."""
    from pydantic import ValidationError

    from trainguard.config import config_error, drill_problems, format_validation_error

    known = set(DrillSpec.model_fields)
    spec_fields = {k: v for k, v in fields.items() if k in known}
    params = {**spec_fields.pop("params", {}), **{k: v for k, v in fields.items() if k not in known}}
    where = str(job_file.path)
    try:
        spec = DrillSpec.model_validate({**spec_fields, "params": params})
    except ValidationError as exc:
        problems = [(f"drill.{key}" if key != "<top level>" else "drill", msg)
                    for key, msg in format_validation_error(exc)]
        raise config_error(where, problems) from None
    probe = JobFile(job_file.path, job_file.job, job_file.checks.model_copy(update={"drills": [spec]}))
    command_text = " ".join(job_file.job.command) + " " + " ".join(job_file.job.resume_args)
    env_text = " ".join(job_file.job.env.values())
    problems = drill_problems(probe, command_text, env_text)
    if problems:
        raise config_error(where, [(k.replace("checks.drills[0]", "drill"), m) for k, m in problems])
    return spec
