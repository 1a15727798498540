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
import dataclasses
import importlib
import signal
import threading
import time
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

from trainguard.config import DrillSpec, JobFile
from trainguard.config.faults import FaultNotInstalled, fault_class
from trainguard.config.registry import Later
from trainguard.drills.dispatch import judge_for
from trainguard.drills.evidence import (
    DrillFinding,
    DrillReport,
    FaultNotSetUp,
    ReferenceFailed,
    ReferenceNotUsable,
)
from trainguard.drills.judges import (
    DrillContext,
    Injection,
    Judgement,
    attempt_evidence,
    fail_clean_start,
    fail_clean_verdict,
    verify_resume,
)
from trainguard.drills.nonfinite import must_stop
from trainguard.drills.ray_recover import new_workers
from trainguard.drills.storage import storage_judge
from trainguard.evidence import UNSET
from trainguard.faults.base import Fault, FaultContext, FaultUnavailable
from trainguard.launch import Launcher, MetricPoint
from trainguard.launch.reach import ChildRanks, RankReach, WorkerNotHere
from trainguard.launch.rundir import new_run_dir
from trainguard.report import CheckId, CheckResult, CheckStatus, SkipReason
from trainguard.run.request import RunRequest
from trainguard.run.runner import JobRunner, LaunchOptions

__all__ = ["RESTART_BACKOFF_S", "Driver", "make_drill", "run_drill"]

#: seconds between a failed attempt and the restart (the agent's backoff; kept short here)
RESTART_BACKOFF_S = 0.5
#: fail_clean: the launcher's stall limit is at least the deadline plus this, so the job gets its
#: whole deadline to exit by itself before trainguard's own hang detection would step in
_DEADLINE_MARGIN_S = 5.0
_WATCH_S = 0.02


class Driver:
    """Injects the fault once, clears it after ``duration``, watches the first attempt's ranks
    (first exit, fail_clean deadline) on a thread of its own, never blocking the monitor. The
    fault reaches the ranks as the job's backend says (``reach``,
    :class:`~trainguard.launch.reach.RankReach`; default: they are the launcher's children)."""

    def __init__(self, fault: Fault, spec: DrillSpec, metric: str, watch_rank: int,
                 reach: RankReach | None = None, *, wait_for: Collection[int] = ()) -> None:
        self.fault = fault
        #: every rank that must have printed after_step before the fault strikes (the watched one
        #: always): :attr:`Fault.strikes_every_rank`
        self.wait_for = frozenset({watch_rank, *wait_for})
        self._reached: dict[int, int] = {}
        self.reach = reach or ChildRanks()
        self.spec = spec
        self.metric = metric
        self.info = Injection(watch_rank=watch_rank)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def on_metric(self, point: MetricPoint, launcher: Launcher) -> None:
        info = self.info
        if launcher.spec.restart_count > 0:
            if info.first_step_after_restart_mono is None and point.name == self.metric:
                info.first_step_after_restart_mono = time.monotonic()
            return
        self._observe(point, launcher)
        if info.injected_mono is not None or point.name != self.metric or point.rank not in self.wait_for:
            return
        self._reached[point.rank] = max(point.step, self._reached.get(point.rank, point.step))
        if any(self._reached.get(rank, -1) < self.spec.after_step for rank in self.wait_for):
            return
        info.run_dir = launcher.spec.run_dir
        for rp in launcher.ranks:
            with contextlib.suppress(OSError):
                info.stderr_offsets[rp.rank] = rp.stderr_log.stat().st_size
        at = launcher.elapsed()
        info.injected_mono = time.monotonic()
        info.injected_step = self._reached[info.watch_rank]
        target = self.reach.target(launcher)  # the launcher, or a view of the ranks behind it
        info.ray_workers_at_injection = self.reach.watch(launcher).pids()
        try:
            with contextlib.suppress(OSError):  # a rank elsewhere: the fault says if it cares
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

    def _observe(self, point: MetricPoint, launcher: Launcher) -> None:
        """Attempt 0: follow the processes that run the ranks; note the first step after the
        backend restarted them inside the launch (a process seen after the fault)."""
        info = self.info
        info.tracker = self.reach.watch(launcher)
        info.tracker.poll()  # stamp the sightings when they come, not at the injection
        if point.name == self.metric:
            self.reach.ready(launcher, self.fault.rank)
        injected = self.fault.injected_at
        if (injected is None or info.ray_first_step_after_restart_t is not None
                or point.name != self.metric):
            return
        if new_workers(info, injected):
            info.ray_first_step_after_restart_t = point.t
            info.first_step_after_restart_mono = time.monotonic()

    def _watch(self, launcher: Launcher) -> None:
        info, spec = self.info, self.spec
        assert info.injected_mono is not None
        fail_clean = spec.expectation == "fail_clean" or must_stop(spec)  # exit by the deadline
        while not self._stop.wait(_WATCH_S):
            if info.tracker is not None:
                info.tracker.poll()  # stamps sightings and restart notices as they come
            since = time.monotonic() - info.injected_mono
            if spec.duration is not None and self.fault.cleared_at is None and since >= spec.duration:
                self.clear(launcher.elapsed())
            codes = [(rp.rank, rp.popen.poll()) for rp in launcher.ranks]
            self._note_first_exit(launcher, codes)
            if (fail_clean and info.first_exit is None and not info.stopped_at_deadline
                    and since > spec.deadline_s):
                info.stopped_at_deadline = True
                launcher.stop(
                    f"no rank exited within the drill's deadline of {spec.deadline_s:g} s "
                    "after the fault"
                )
            attempt_over = all(code is not None for _, code in codes)
            if attempt_over and self.reach.outlives_attempt():
                self.clear(launcher.elapsed())
            if attempt_over and (spec.duration is None or self.fault.cleared_at is not None):
                return
        # stopped (the attempt ended): an exit the loop had no poll left to see is still the
        # first exit (a loaded machine let the launcher return first)
        self._note_first_exit(launcher, [(rp.rank, rp.popen.poll()) for rp in launcher.ranks])

    def _note_first_exit(self, launcher: Launcher, codes: list[tuple[int, int | None]]) -> None:
        """Record the first rank to exit after the fault, once: two exits seen in one poll are
        ordered by when the launcher saw them, and a rank ended by SIGTERM comes second (the
        launcher's teardown SIGTERMs the others after the first death)."""
        if self.info.first_exit is not None:
            return
        done = [(rank, code) for rank, code in codes if code is not None]
        if not done:
            return
        seen = launcher.exit_seen_at
        now = launcher.elapsed()
        rank, code = min(done, key=lambda rc: (rc[1] == -signal.SIGTERM, seen.get(rc[0], now), rc[0]))
        self.info.first_exit = (rank, code, seen.get(rank, now))

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



def run_drill(runner: JobRunner, spec: DrillSpec) -> CheckResult | Later:
    """Run one drill and judge it; the result is named ``drill:<name>``."""
    started = time.monotonic()
    name = str(CheckId.of_drill(spec.name))
    job_file = runner.job_file
    reproduce = f"trainguard drill {job_file.path} --only {spec.name}"
    base = DrillReport(spec.fault, spec.expectation, spec.rank, spec.after_step, spec.duration, spec.steps)

    def result(status: CheckStatus, summary: str, found: DrillFinding = UNSET,
               skip_reason: SkipReason | None = None) -> CheckResult[DrillReport]:
        return CheckResult(name, status, summary, dataclasses.replace(base, found=found),
                           time.monotonic() - started, reproduce, skip_reason)

    try:
        cls = fault_class(spec.fault)
    except FaultNotInstalled as exc:
        return result("error", str(exc))
    if cls.drill_runner is not None:  # a composite fault (the soak) runs its own drill
        module, _, function = cls.drill_runner.partition(":")
        return getattr(importlib.import_module(module), function)(runner, spec)  # type: ignore[no-any-return]
    fault = cls(spec.fault_params, rank=spec.rank, after_step=spec.after_step, duration=spec.duration)
    metric = _progress_metric(job_file)
    request = _request(runner, spec)
    reference = runner.scheduling.reference(request)
    if not reference.ok:
        return result("error", f"the uninterrupted reference run failed, so there is nothing to "
                      f"drill: {reference.reason}", ReferenceFailed(attempt_evidence(reference, fault)))
    reporting = sorted({p.rank for p in reference.points if p.name == metric})
    if not reporting:
        return result("error", f"the reference run printed no `{metric}` line; check "
                      f"job.metrics.{metric}", ReferenceNotUsable(str(reference.run_dir)))
    # a job may print its loss on rank 0 only: then the fault strikes when rank 0 reports the step
    watch_rank = spec.rank if spec.rank in reporting else reporting[0]

    drill_dir = new_run_dir(job_file.state_dir, job_file.job.name, f"drill-{spec.name}",
                            keep=runner.settings.keep_runs)
    ctx = _fault_context(runner, request, drill_dir)
    try:
        reach = runner.backend.fault_reach(spec.fault, job_name=job_file.job.name,
                                           world_size=request.world_size)
    except ValueError as exc:
        return result("error", str(exc))
    driver = Driver(fault, spec, metric, watch_rank, reach,
                    wait_for=reporting if cls.strikes_every_rank else ())
    restarts = runner.backend.drill_restarts(spec.fault, spec.expectation, spec.restart_limit)
    stall = _stall_limit(spec, job_file, fault)
    startup, shutdown = _startup_and_shutdown(spec, job_file, stall)
    try:
        try:
            client = reach.open()
        except WorkerNotHere as exc:
            return result("error", str(exc))
        if client is not None:
            base.ray_api = client
        try:
            fault.setup(ctx)
        except FaultUnavailable as exc:
            return result("skipped", f"{spec.fault} cannot be injected on this machine: {exc}",
                          FaultNotSetUp(fault.evidence().to_dict()), exc.needs)
        run = runner.supervise(
            request,
            label=f"drill-{spec.name}",
            options=LaunchOptions(
                max_restarts=restarts.relaunches,
                backoff_s=RESTART_BACKOFF_S,
                extra_env={**fault.launch_env(ctx), **reach.launch_env()},
                preexec=reach.preexec(fault.preexec) if fault.needs_preexec else None,
                stall_timeout=stall,
                startup_timeout=startup,
                shutdown_timeout=shutdown,
            ),
            on_metric=driver.on_metric,
            checkpoint_dir=ctx.checkpoint_dir,
        )
        driver.finish()
        driver.clear()
        judge = storage_judge(spec, fault) or judge_for(spec.expectation, ray_recover=restarts.in_launch)
        c = DrillContext(runner, spec, fault, driver.info, run, reference, request, metric,
                         ctx.checkpoint_dir, stall * runner.settings.timeout_scale,
                         job_file.job.metric_line_regexes)

        def judged(judgement: Judgement) -> CheckResult:
            status, summary, found = judgement
            report = dataclasses.replace(base, found=found, drill_dir=str(drill_dir), run_dir=str(run.run_dir))
            return CheckResult(name, status, summary, report, time.monotonic() - started, reproduce)

        if judge.finishes_later and runner.pool.state.untimed_later:
            return _fail_clean_later(c, drill_dir / "checkpoints", judged)
        return judged(judge.judge(c))
    finally:  # Ctrl-C included: nothing is left stopped, mounted or running
        driver.finish()
        with contextlib.suppress(Exception):
            fault.teardown()
        reach.close()  # after the teardown: a stopped process is continued through it


def _fault_context(runner: JobRunner, request: RunRequest, drill_dir: Path) -> FaultContext:
    """The drill's fault context: its own work and checkpoint directories (made), its world
    size and the job's environment with the placeholders filled."""
    job = runner.job_file.job
    values = runner.placeholders(request, drill_dir, drill_dir / "checkpoints")
    ctx = FaultContext(
        work_dir=drill_dir / "fault",
        checkpoint_dir=drill_dir / "checkpoints",
        world_size=request.world_size,
        env={**{k: v.format_map(values) for k, v in job.env.items()},
             **{k: v.format_map(values) for k, v in request.env}},
        backend=runner.backend,
    )
    ctx.work_dir.mkdir(parents=True, exist_ok=True)
    ctx.checkpoint_dir.mkdir(parents=True, exist_ok=True)
    return ctx


def _stall_limit(spec: DrillSpec, job_file: JobFile, fault: Fault) -> float:
    """The drill run's stall limit: the drill's or the job's, and at least the deadline of a
    drill that expects the job to stop, and the grace of a save_and_exit one."""
    stall = spec.stall_timeout or job_file.job.stall_timeout
    if spec.expectation == "fail_clean" or must_stop(spec):
        stall = max(stall, spec.deadline_s + _DEADLINE_MARGIN_S)
    if spec.expectation == "save_and_exit":  # the job saves in silence for up to the grace
        grace = float(fault.params.number("grace")) if "grace" in fault.params else 0.0
        stall = max(stall, grace + _DEADLINE_MARGIN_S)
    return stall


def _startup_and_shutdown(spec: DrillSpec, job_file: JobFile, stall: float) -> tuple[float, float | None]:
    """The drill run's start-up and shutdown limits."""
    # a short drill stall limit must not cut the job's start-up (imports, rendezvous)
    startup = max(stall, job_file.job.stall_timeout)
    # continue: a job that did its steps may take up to the deadline to exit (a bounded flush of
    # what the fault held back) without being called hung
    shutdown = spec.deadline_s + _DEADLINE_MARGIN_S if spec.expectation == "continue" else None
    return startup, shutdown


def _fail_clean_later(c: DrillContext, checkpoints: Path,
                      judged: Callable[[Judgement], CheckResult]) -> CheckResult | Later:
    """A fail_clean drill's verdict, its verification run left for later (:class:`Later`): that
    run is untimed, so it runs once the session's timed checks are done, beside the others'.
    What the judgement reads of the fault is read now, before the teardown; the verification
    then resumes from ``checkpoints``, the directory the job wrote (under the fault's layer,
    if it had one), with the fault gone."""
    start = fail_clean_start(c)
    if isinstance(start, Judgement):
        return judged(start)
    if not start.verify:
        return judged(fail_clean_verdict(c, start, None))
    c.checkpoint_dir = checkpoints
    left = time.monotonic()

    def finish() -> CheckResult:
        began = time.monotonic()
        out = judged(fail_clean_verdict(c, start, verify_resume(c)))
        out.duration_s -= began - left  # its own time: not the checks' it waited behind
        return out

    return Later(finish)


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

