"""Running a job file's command: placeholders, run directories, restarts.

:class:`JobRunner` turns "run the job for 20 steps with seed 0 on 2 ranks" into a
:class:`~trainguard.launch.LaunchSpec` and launches it in a fresh run directory
(:meth:`JobRunner.run`), or runs it under the restart policy (:meth:`JobRunner.supervise`). Checks
that need the same uninterrupted run share it through ``runner.scheduling``, its
:class:`~trainguard.run.scheduling.RunScheduler` (``reference``, ``run_for``, the lane). How the
ranks run is the job kind's backend's (``runner.backend``, :mod:`trainguard.launch.backend`).
Every launch is reported to the runner's :class:`~trainguard.run.observer.RunObserver` (MLflow
tracking, when on).
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
import shlex
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from trainguard._internal.logsafe import safe_logger_registry
from trainguard._internal.quiet import SETTLE_S, busy, measured, wait_while_measured
from trainguard._internal.readers import use_limits
from trainguard.config import CheckSpec, JobFile, MetricFile, MetricRegex
from trainguard.config.backends import backend_for
from trainguard.config.schema import PlaceholderValues
from trainguard.config.settings import Settings, read_limits
from trainguard.launch import Launcher, LaunchSpec, LineMetric, MetricPoint, RunResult, trajectory
from trainguard.launch.backend import JobBackend
from trainguard.launch.hook import (
    METRICS_DIR,
    PACE_DIR,
    SAMPLES_DIR,
    STALL_DIR,
    STEPS_CAP,
    STEPS_DIR,
    run_hook_env,
    worker_run_hook_env,
)
from trainguard.launch.pace import PaceReport
from trainguard.launch.rundir import new_run_dir
from trainguard.report import CappedLogs, FullDisk
from trainguard.run.keep import Keepers
from trainguard.run.observer import MetricCallback, NullObserver, ObserverSource, RunObserver
from trainguard.run.pool import RunPool
from trainguard.run.request import RunRequest
from trainguard.run.restarts import Backoff, Waited, restart_policy
from trainguard.run.scheduling import AheadRun, RunScheduler
from trainguard.unit.checkpoints import describe_candidates, latest_complete_checkpoint

__all__ = [
    "DEFAULT_OPTIONS",
    "JobRunner",
    "LaunchOptions",
    "LaunchRecord",
    "LogNote",
    "RunCurve",
    "SupervisedRun",
    "repro_dir",
]


@dataclass(frozen=True)
class LaunchOptions:
    """How a supervised run is launched and restarted besides its request
    (:meth:`JobRunner.supervise`): the restart policy, and what a drill, a soak or the headroom
    search sets for every attempt."""

    #: restarts allowed (None: ``job.max_restarts``)
    max_restarts: int | None = None
    #: the first wait between attempts (None: ``job.restart.backoff_s``; the rest of the policy,
    #: :mod:`trainguard.run.restarts`, is the job's)
    backoff_s: float | None = None
    #: the outcomes that restart an attempt
    restart_on: tuple[str, ...] = ("failed", "hung")
    #: restarts an attempt whose outcome is not in ``restart_on`` too, when it returns True
    restart_if: Callable[[RunResult], bool] | None = None
    #: environment for every rank of every attempt (the job's own wins)
    extra_env: Mapping[str, str] | None = None
    #: called in every rank's process before it starts (its rank)
    preexec: Callable[[int], None] | None = None
    #: the stall limit (None: ``job.stall_timeout``)
    stall_timeout: float | None = None
    #: the stall limit before the first metric line
    startup_timeout: float | None = None
    #: the stall limit after the last step
    shutdown_timeout: float | None = None


#: a supervised run's default options
DEFAULT_OPTIONS = LaunchOptions()


@dataclass(frozen=True)
class _Attempt:
    """One launch of a run: its label, whether it resumes, its metric callback, its number
    among the attempts of a supervised run, the observer's token, whether its lines are timed,
    whether the run agent records its steps (``job.record_steps`` permitting)."""

    label: str
    resume: bool
    on_metric: Callable[[MetricPoint, Launcher], None] | None
    restart_count: int = 0
    tracked: object = None
    timed: bool = False
    step_records: bool = True


@dataclass
class SupervisedRun:
    """All attempts of one logical run under the restart policy."""

    attempts: list[RunResult]
    run_dir: Path
    checkpoint_dir: Path
    #: the wait before each restart, chosen and measured
    waits: list[Waited] = field(default_factory=list)
    #: why the policy stopped before ``max_restarts`` ran out (empty: it did not)
    gave_up: str = ""

    @property
    def final(self) -> RunResult:
        """The last attempt."""
        return self.attempts[-1]

    @property
    def ok(self) -> bool:
        """Whether the last attempt completed."""
        return self.final.ok

    @property
    def restarts(self) -> int:
        """How many times the run was restarted."""
        return len(self.attempts) - 1

    @property
    def points(self) -> list[MetricPoint]:
        """Metric points of every attempt in order (a re-run step's latest value wins)."""
        return [p for attempt in self.attempts for p in attempt.points]

    def trajectory(self, name: str = "loss") -> dict[int, float]:
        """Step -> value of metric ``name`` over every attempt."""
        return trajectory(self.points, name)


def _both(first: MetricCallback, second: MetricCallback) -> MetricCallback:
    def both(point: MetricPoint, launcher: Launcher) -> None:
        first(point, launcher)
        second(point, launcher)

    return both


def repro_dir(job_name: str) -> Path:
    """The run directory a reproduce line uses when it has no run of its own to point at:
    ``trainguard-repro-<job>`` in the system temp directory."""
    safe = re.sub(r"[^A-Za-z0-9._-]+", "-", job_name).strip("-") or "job"
    return Path(tempfile.gettempdir()) / f"trainguard-repro-{safe}"


@dataclass
class _WarmImport:
    """The background torch import (:func:`_warm_torch_import`): started once, and given up
    when a runner closes before it began (the next runner starts it again)."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    #: the thread that imports (None: none, or the last one was given up)
    thread: threading.Thread | None = None
    started: bool = False  # the import itself is under way or done


_warm = _WarmImport()
#: how long closing a runner waits for a torch import under way to end
_WARM_JOIN_S = 120.0


def _warm_torch_import() -> None:
    """Import torch in a background thread while the first run starts: the checks load its
    checkpoints in this process later, and the import (2-3 s of one core) then overlaps the
    ranks' own start-up instead of following it. A run whose lines are timed waits for it to end
    (:mod:`trainguard._internal.quiet`), and it waits for such a run."""
    def work() -> None:
        wait_while_measured(SETTLE_S)
        with _warm.lock:
            if _warm.thread is not threading.current_thread():
                return  # given up by a runner that closed first
            _warm.started = True
        with busy("importing torch"):
            with contextlib.suppress(Exception):
                import torch
            with contextlib.suppress(Exception):
                # torch.testing.assert_close imports it on first use (2-3 s of one core): the
                # checks compare checkpoints with it
                import torch.distributed.tensor  # noqa: F401

    with _warm.lock:
        if _warm.thread is not None:
            return
        safe_logger_registry()  # the import adds loggers while the caller (pytest) may walk them
        _warm.thread = threading.Thread(target=work, name="trainguard-import-torch", daemon=True)
        _warm.thread.start()


def _end_warm_import() -> None:
    """Nothing of the background torch import runs on after a runner closes: one not begun is
    given up (a later runner starts it again), one under way is waited for (bounded). An import
    left running when pytest ended its session overlapped pytest's own parsing of a module it
    rewrites on import, and CPython 3.11.7's ``ast.parse`` there failed with "AST constructor
    recursion depth mismatch" (CPython gh-106905, seen in threaded programs)."""
    with _warm.lock:
        thread = _warm.thread
        if thread is None or thread is threading.current_thread():
            return
        if not _warm.started:
            _warm.thread = None
            return
    thread.join(_WARM_JOIN_S)


@dataclass(frozen=True)
class LaunchRecord:
    """One launch (one attempt of a run) as the runner made it: what the gate's cost is counted
    from (:mod:`trainguard.session.cost`), and its ranks' pace (the gate's per-rank table)."""

    label: str
    #: ranks (a ray_train job: its workers)
    world_size: int
    seconds: float
    #: launch to its first metric line (None: it printed none)
    first_step_s: float | None
    #: metric lines' distinct steps it printed
    steps: int
    #: each rank's pace (:attr:`RunResult.pace`; None: one rank or no step clocks)
    pace: PaceReport | None = None

    def to_dict(self) -> dict[str, object]:
        return {"label": self.label, "world_size": self.world_size, "seconds": round(self.seconds, 3),
                "first_step_s": None if self.first_step_s is None else round(self.first_step_s, 3),
                "steps": self.steps}


@dataclass(frozen=True)
class RunCurve:
    """The progress metric of one run launched through :meth:`JobRunner.run`: the profile's
    report plots the checks' curves next to its own."""

    label: str
    world_size: int
    metric: str
    outcome: str
    #: step -> value (the mean over the ranks that printed it)
    values: dict[int, float]
    #: when it was launched and when it ended (``time.monotonic``)
    span: tuple[float, float]


@dataclass(frozen=True)
class LogNote:
    """What the launcher said about one run's logs: capped by the log cap, or written to a full
    or failing disk (its evidence's ``logs_truncated`` / ``run_dir_disk``)."""

    run_dir: str
    capped: CappedLogs | None
    full_disk: FullDisk | None


@dataclass
class JobRunner:
    """Launches runs of one job file."""

    job_file: JobFile
    settings: Settings = field(default_factory=Settings)
    echo: Callable[[int, str, str], None] | None = None
    #: what records the runs (a :class:`trainguard.tracking.Tracker`): the runner reports to
    #: ``tracker.run_observer()``; None: tracking off
    tracker: ObserverSource | None = None
    #: what the runner reports its launches to; left as the default :class:`NullObserver`, it is
    #: the tracker's observer when a tracker is given
    observer: RunObserver = field(default_factory=NullObserver)
    #: how the job's ranks run (its ``kind``'s backend, :mod:`trainguard.launch.backend`); a
    #: sibling of the same kind shares its parent's (one embedded Ray head for both)
    backend: JobBackend = field(init=False, repr=False)
    #: the loss curve of every run launched through :meth:`run` (label, world size, step -> loss),
    #: in launch order: the profile's report plots the checks' curves next to its own
    curves: list[RunCurve] = field(default_factory=list, repr=False)
    #: what the launcher said about the logs of each run: capped (``logs_truncated``) or on a
    #: full disk (``run_dir_disk``); see :meth:`take_log_notes`
    log_notes: list[LogNote] = field(default_factory=list, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    #: launchers of the runs started off the main thread (stopped by stop_background/close_lane)
    _inflight: set[Launcher] = field(default_factory=set, repr=False)
    _parent: JobRunner | None = field(default=None, repr=False)
    #: launching, sharing and keeping this runner's runs, and the session's state
    #: (:mod:`trainguard.run.pool`)
    pool: RunPool = field(init=False, repr=False)
    #: every launch made through this runner and its siblings, in order (the root runner's)
    launches: list[LaunchRecord] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        # every file of the job's runs that trainguard reads (checkpoints, logs) within the
        # settings' stated limits, whichever layer reads it (docs/security.md)
        use_limits(read_limits(self.settings))
        if self.tracker is not None and isinstance(self.observer, NullObserver):
            self.observer = self.tracker.run_observer()
        self.backend = backend_for(self.job_file.job.kind)
        self.pool = RunPool(self, lock=self._lock, inflight=self._inflight)

    @property
    def scheduling(self) -> RunScheduler:
        """The reference cache, background prefetch and lane of this runner's runs (its pool's)."""
        return self.pool.scheduling

    @property
    def keepers(self) -> Keepers:
        """Checkpoints kept from uninterrupted runs after a step (:mod:`trainguard.run.keep`)."""
        return self.pool.keepers

    def take_log_notes(self) -> list[LogNote]:
        """The log notes recorded since the last call (:func:`trainguard.session.run_check`
        moves them into the evidence of the check that ran those runs)."""
        with self._lock:
            notes, self.log_notes = self.log_notes, []
        return notes

    def sibling(self, job_file: JobFile) -> JobRunner:
        """A runner of a variant of this job file (another batch size, say) with the same
        settings, echo, tracker and observer that shares this runner's embedded Ray head."""
        other = JobRunner(job_file, self.settings, echo=self.echo, tracker=self.tracker, observer=self.observer)
        other._parent = self
        if job_file.job.kind == self.job_file.job.kind:
            other.backend = self.backend
        return other

    def close(self) -> None:
        """Stop what this runner started for its runs (background reference runs, what its
        backend started: the embedded Ray head). Idempotent."""
        self.scheduling.close_lane()
        self.scheduling.stop_and_wait("the runner was closed")
        self.keepers.join(lambda: self.scheduling.stop_background("the runner was closed"))
        if self._parent is None or self.backend is not self._parent.backend:
            self.backend.close()
        _end_warm_import()

    def placeholders(self, request: RunRequest, run_dir: Path, checkpoint_dir: Path | None) -> dict[str, str | int]:
        """The values of the job's placeholders (``{steps}``, ``{seed}``, ``{world_size}``,
        ``{run_dir}``, ``{batch_size}``, ``{checkpoint_dir}``) for one run."""
        job = self.job_file.job
        values: dict[str, str | int] = {
            "steps": request.steps,
            "seed": request.seed,
            "world_size": request.world_size,
            "run_dir": str(run_dir),
            "batch_size": job.batch_size if job.batch_size is not None else "",
        }
        if checkpoint_dir is None:
            checkpoint_dir = Path(job.checkpoint_dir.format_map(values))
            if not checkpoint_dir.is_absolute():
                checkpoint_dir = self.job_file.cwd / checkpoint_dir
        values["checkpoint_dir"] = str(checkpoint_dir)
        return values

    def run(  # noqa: PLR0913
        self,
        request: RunRequest,
        *,
        label: str,
        resume: bool = False,
        checkpoint_dir: Path | None = None,
        on_metric: Callable[[MetricPoint, Launcher], None] | None = None,
        ahead: AheadRun | None = None,
        keep: bool = True,
        step_records: bool = True,
    ) -> RunResult:
        """Launch one run in a new run directory (``checkpoint_dir`` given: reuse that one). An
        uninterrupted run (not resumed, its own checkpoint directory, ``keep``) keeps the
        checkpoints checks asked for (:meth:`RunPool.keep`). ``step_records=False``: the run
        agent records no steps (a profile's timed run measures the job as it runs without us)."""
        self.pool.admit(request, label, ahead)
        run_dir = new_run_dir(
            self.job_file.state_dir, self.job_file.job.name, label, keep=self.settings.keep_runs
        )
        values = self.placeholders(request, run_dir, checkpoint_dir)
        keeper, kept_done = (self.keepers.attach(request, label=label, run_dir=run_dir,
                                                 checkpoint_dir=Path(str(values["checkpoint_dir"])))
                             if keep and not resume and checkpoint_dir is None else (None, lambda result: None))
        if keeper is not None:
            on_metric = keeper if on_metric is None else _both(keeper, on_metric)
        timing = self.pool.state.timing
        if not timing:  # a timed run gets the cores to itself
            _warm_torch_import()
        tracked = self._track_start(request, label, resume, ahead_of=ahead.check if ahead else None)
        if ahead is not None:
            ahead.tracked = tracked
        launched = time.monotonic()
        try:
            result = self._launch(request, values, run_dir,
                                  _Attempt(label, resume, on_metric, tracked=tracked, timed=timing,
                                           step_records=step_records))
        except BaseException:
            kept_done(None)
            self._track_abort(tracked)
            raise
        kept_done(result)
        self._track_attempt(tracked, result, 0, final=True)
        self._record_curve(label, request, result, (launched, time.monotonic()))
        return result

    def _record_curve(self, label: str, request: RunRequest, result: RunResult, span: tuple[float, float]) -> None:
        name = self.job_file.job.progress_metric
        if len(self.curves) >= 32:
            return
        curve = trajectory(result.points, name)
        if curve:
            self.curves.append(RunCurve(label, request.world_size, name, result.outcome, curve, span))

    def supervise(
        self,
        request: RunRequest,
        *,
        label: str,
        options: LaunchOptions = DEFAULT_OPTIONS,
        on_metric: Callable[[MetricPoint, Launcher], None] | None = None,
        checkpoint_dir: Path | None = None,
    ) -> SupervisedRun:
        """Run with the restart policy: when an attempt fails (a rank died or hung), restart the
        whole group from the latest checkpoint with ``resume_args``, in new processes on a fresh
        rendezvous port, up to ``options.max_restarts`` times (default ``job.max_restarts``), waiting
        as ``job.restart`` says (:mod:`trainguard.run.restarts`: a backoff doubling while attempts
        make no progress, jitter, a stop without progress). Every attempt is recorded; all
        attempts of one logical run share its ``{run_dir}`` and checkpoint directory, each with
        its own ``attempt-N/`` log directory. ``on_metric`` callbacks see the attempt number as
        ``launcher.spec.restart_count``. Fault drills pass their :class:`LaunchOptions`
        (``extra_env`` and ``preexec`` for every rank of every attempt, the stall limits) and
        their own ``checkpoint_dir``. ``options.restart_if`` restarts an attempt whose outcome is
        not in ``restart_on`` too, when it returns True (a soak: a job that saved and exited 0 on
        a pre-emption notice, steps short of the end)."""
        self.pool.admit(request, label)
        limit = self.job_file.job.max_restarts if options.max_restarts is None else options.max_restarts
        policy = restart_policy(self.job_file.job.restart, options.backoff_s)
        options = dataclasses.replace(options, max_restarts=limit)
        run_dir = new_run_dir(
            self.job_file.state_dir, self.job_file.job.name, label, keep=self.settings.keep_runs
        )
        values = self.placeholders(request, run_dir, checkpoint_dir)
        attempts: list[RunResult] = []
        backoff, waits, ended, wait = Backoff(policy), list[Waited](), 0.0, None
        tracked = self._track_start(request, label, False)  # all attempts share one tracked run
        for attempt in range(limit + 1):
            if wait is not None:
                time.sleep(wait.wait_s)
                waits.append(dataclasses.replace(wait, measured_s=time.monotonic() - ended))
            try:
                result = self._launch(
                    request, values, run_dir / f"attempt-{attempt}",
                    _Attempt(f"{label}-{attempt}", attempt > 0, on_metric, attempt, tracked, timed=True), options,
                )
            except BaseException:
                self._track_abort(tracked)
                raise
            ended = time.monotonic()
            attempts.append(result)
            again = result.outcome in options.restart_on or (options.restart_if is not None and options.restart_if(result))
            wait = backoff.after(attempt, result.last_step) if again and attempt < limit else None  # None: no more
            last = wait is None
            self._track_attempt(tracked, result, attempt, final=last)
            if last:
                break
        return SupervisedRun(attempts, run_dir, Path(str(values["checkpoint_dir"])), waits, backoff.gave_up)

    def _track_start(self, request: RunRequest, label: str, resume: bool, ahead_of: str | None = None) -> object:
        return self.observer.launch_started(
            self.job_file, request, label=label, command=self.command_line(request, resume=resume), ahead_of=ahead_of
        )

    def _track_attempt(self, tracked: object, result: RunResult, attempt: int, *, final: bool) -> None:
        self.observer.attempt_finished(self.job_file, tracked, result, attempt, final=final)

    def _track_abort(self, tracked: object) -> None:
        """End the observed run of a launch that raised (e.g. KeyboardInterrupt)."""
        self.observer.launch_aborted(tracked)

    def _track_hooks(
        self, tracked: object, world_size: int, log_dir: Path
    ) -> tuple[dict[str, str], MetricCallback | None]:
        """The observer's environment for the ranks (the launch run's id for
        ``trainguard.tracking.track``) and its live metric callback."""
        return self.observer.attempt_env(self.job_file, tracked, world_size, log_dir)

    def _launch(
        self,
        request: RunRequest,
        values: PlaceholderValues,
        log_dir: Path,
        attempt: _Attempt,
        options: LaunchOptions = DEFAULT_OPTIONS,
    ) -> RunResult:
        """One launch. ``attempt.timed``: the times its lines arrive are measured (a drill's step
        rates, a timed run's step times), so this process's background work waits while it runs
        (:func:`trainguard._internal.quiet.measured`)."""
        job = self.job_file.job
        Path(str(values["checkpoint_dir"])).mkdir(parents=True, exist_ok=True)
        values, resume, resumed_from = self._resume_values(values, attempt.resume)
        argv = self.job_file.argv(values, extra_args=request.args, resume=resume)
        env = self.backend.launch_env()
        env.update({k: v.format_map(values) for k, v in job.env.items()})
        env.update({k: v.format_map(values) for k, v in request.env})
        env.update(options.extra_env or {})
        track_env, live_metrics = self._track_hooks(attempt.tracked, request.world_size, log_dir)
        env = {**track_env, **env}  # the job's own environment wins
        scale = self.settings.timeout_scale
        timeout = (request.timeout or job.timeout) * scale
        regexes, files, hook_env = self._metric_sources(values, log_dir, env, step_records=attempt.step_records,
                                                        ranks=request.world_size)
        env.update(hook_env)
        spec = LaunchSpec(
            argv=argv,
            run_dir=log_dir,
            world_size=request.world_size,
            cwd=self.job_file.cwd,
            env=env,
            metric_regexes=regexes,
            metric_files=files,
            timeout=timeout,
            stall_timeout=(options.stall_timeout or job.stall_timeout) * scale,
            startup_timeout=options.startup_timeout * scale if options.startup_timeout else None,
            shutdown_timeout=options.shutdown_timeout * scale if options.shutdown_timeout else None,
            final_step=request.steps,
            end_after_final_step=job.stop_after_steps,
            max_restarts=job.max_restarts if options.max_restarts is None else options.max_restarts,
            restart_count=attempt.restart_count,
            echo=self.echo,
            label=attempt.label,
            max_rss_mb=request.max_rss_mb,
            preexec=options.preexec,
            distributed_env=job.distributed_env,
            log_limit_mb=self.settings.rank_log_mb or None,
        )
        launcher = Launcher(self.backend.launch_spec(spec))  # e.g. a Ray Train job's one driver
        if live_metrics is not None:
            launcher.on_metric.append(live_metrics)
        if attempt.on_metric is not None:
            launcher.on_metric.append(attempt.on_metric)
        if threading.current_thread() is not threading.main_thread():
            with self._lock:
                self._inflight.add(launcher)
        try:
            window: contextlib.AbstractContextManager[list[str]] = (
                measured() if attempt.timed else contextlib.nullcontext([]))
            with window as still_running:
                result = launcher.run()
        finally:
            with self._lock:
                self._inflight.discard(launcher)
        if still_running:  # the settling wait gave up: the lines' times may be coarse
            result.evidence["background_work_during_run"] = still_running
        result.checkpoint_dir = Path(str(values["checkpoint_dir"]))
        result.evidence.setdefault("checkpoint_dir", str(result.checkpoint_dir))
        self._record(LaunchRecord(attempt.label, request.world_size, result.duration_s, result.first_metric_s,
                                  len({p.step for p in result.points}), result.pace))
        capped, disk = result.evidence.get("logs_truncated"), result.evidence.get("run_dir_disk")
        if capped is not None or disk is not None:
            note = LogNote(str(result.run_dir), None if capped is None else CappedLogs.from_dict({"run_dir": str(result.run_dir), "logs": capped}),
                           None if disk is None else FullDisk.from_dict(disk))
            with self._lock:
                self.log_notes.append(note)
        if resumed_from:
            result.evidence["resumed_from"] = resumed_from
        return result

    def _record(self, record: LaunchRecord) -> None:
        root = self
        while root._parent is not None:
            root = root._parent
        with root._lock:
            root.launches.append(record)

    @property
    def resumes_from_latest(self) -> bool:
        """Whether ``job.resume_args`` names ``{latest_checkpoint}``: a resume needs a complete
        checkpoint to name."""
        return any("{latest_checkpoint}" in t for t in self.job_file.job.resume_args)

    def _resume_values(
        self, values: PlaceholderValues, resume: bool
    ) -> tuple[PlaceholderValues, bool, str]:
        """The placeholder values of one launch with ``{latest_checkpoint}`` filled, looked up
        now (each restart of a supervised run gets the newest one). No complete checkpoint: the
        launch starts afresh without ``resume_args``, as an agent would; the third item says
        what was resumed from (or why not)."""
        if not (resume and self.resumes_from_latest):
            return values, resume, ""
        directory = Path(str(values["checkpoint_dir"]))
        latest = latest_complete_checkpoint(directory)
        if latest is None:
            return values, False, (f"nothing: no complete checkpoint under {directory} "
                                   f"({describe_candidates(directory)}), so it started afresh "
                                   "without resume_args")
        return {**values, "latest_checkpoint": str(latest)}, True, str(latest)

    def _metric_sources(
        self, values: PlaceholderValues, log_dir: Path, env: Mapping[str, str], *, step_records: bool = True,
        ranks: int = 1,
    ) -> tuple[dict[str, str | LineMetric], dict[str, str], dict[str, str]]:
        """The launcher's metric regexes and files for one attempt, and the environment that
        puts the start-up hook's run agent on the ranks (trainer metrics, sample indices, step
        records) when the job needs it: a ``command`` job with a ``{trainer: ...}`` source,
        ``record_samples`` or ``record_steps`` (``step_records=False``: no step records). The agent writes under the attempt's own directory, so a restarted
        attempt's records are its own; ``env`` (a drill's fault hook included) keeps its
        PYTHONPATH entries after the hook's. A timed run (``step_records=False``) of several
        ``ranks`` records only each step's clocks, for the profile's per-rank table (three clock
        reads a step; none when the job turns the agent off with ``record_steps: false``)."""
        job = self.job_file.job
        regexes: dict[str, str | LineMetric] = {}
        files: dict[str, str] = {}
        trainers: dict[str, dict[str, str]] = {}
        for name, source in job.metrics.items():
            if isinstance(source, str):
                regexes[name] = source
            elif isinstance(source, MetricRegex):
                regexes[name] = LineMetric(source.regex, source.step_group, source.every)
            elif isinstance(source, MetricFile):
                files[name] = source.file.replace("{rank}", "\0").format_map(values).replace("\0", "{rank}")
            else:
                trainers.setdefault(source.trainer, {})[name] = source.key_for(name)
                files[name] = str(log_dir / METRICS_DIR / "rank{rank}.jsonl")
        steps = job.record_steps and step_records
        if not self.backend.rank_at_start():
            # the ranks are started by the job's driver (Ray Train): it installs the agent in
            # each rank once the rank is known, for the step records and clocks (docs/step-records.md)
            pace = log_dir / PACE_DIR if job.record_steps else None
            return regexes, files, worker_run_hook_env(log_dir / STEPS_DIR if steps else None, pace, job.record_state_every)
        if not (trainers or job.record_samples or steps):
            timed = not step_records and job.record_steps and ranks > 1
            return regexes, files, run_hook_env({"pace_dir": str(log_dir / PACE_DIR)}, env) if timed else {}
        spec = {
            "metrics_dir": str(log_dir / METRICS_DIR),
            "samples_dir": str(log_dir / SAMPLES_DIR) if job.record_samples else None,
            "steps_dir": str(log_dir / STEPS_DIR) if steps else None,
            "steps_cap": STEPS_CAP, "state_every": job.record_state_every,
            "stall_dir": str(log_dir / STALL_DIR),
            "pace_dir": str(log_dir / PACE_DIR),
            **trainers,
        }
        return regexes, files, run_hook_env(spec, env)

    def request_for(self, spec: CheckSpec, *, world_size: int | None = None) -> RunRequest:
        """The run a check spec asks for (its steps, seed, args, env, timeout)."""
        return RunRequest.make(
            steps=spec.steps,
            seed=spec.seed if spec.seed is not None else self.settings.seed,
            world_size=world_size if world_size is not None else self.job_file.job.world_size,
            args=spec.args,
            env=spec.env,
            timeout=spec.timeout,
        )

    @property
    def checkpoints_known(self) -> bool:
        """Whether the job is told where to checkpoint (``{checkpoint_dir}`` in its command,
        resume args or env): only then can trainguard copy a run's checkpoints."""
        job = self.job_file.job
        return any("{checkpoint_dir}" in t for t in [*job.command, *job.resume_args, *job.env.values()])

    def command_line(
        self,
        request: RunRequest,
        *,
        resume: bool = False,
        run_dir: Path | None = None,
        checkpoint_dir: Path | None = None,
        latest_checkpoint: Path | str | None = None,
    ) -> str:
        """The job's command as a person would type it, runnable as printed (for 'reproduce:'
        lines): ``cd`` to the job's directory, create the checkpoint directory, the job's and the
        check's environment, the command (through ``torchrun`` on several ranks). Placeholders
        are real paths: ``run_dir``/``checkpoint_dir`` when given (the failing run's own), else
        under :func:`repro_dir`; ``{latest_checkpoint}`` the given one (a relative path: inside
        the line's checkpoint directory, e.g. the name of the checkpoint a killed run left), else
        the newest complete checkpoint in that directory (else the directory itself). The
        backend says how the ranks are started (:meth:`JobBackend.reproduce_argv`)."""
        job = self.job_file.job
        values = self.placeholders(request, run_dir or repro_dir(job.name), checkpoint_dir)
        if resume and self.resumes_from_latest:
            directory = Path(str(values["checkpoint_dir"]))
            latest = directory / latest_checkpoint if latest_checkpoint else latest_complete_checkpoint(directory)
            values["latest_checkpoint"] = str(latest if latest is not None else directory)
        argv = self.job_file.argv(values, extra_args=request.args, resume=resume)
        pairs = [*job.env.items(), *request.env]
        env = " ".join(f"{k}={shlex.quote(v.format_map(values))}" for k, v in pairs)
        prefix = f"cd {shlex.quote(str(self.job_file.cwd))} && "
        uses_dir = any("{checkpoint_dir}" in t for t in [*job.command, *job.resume_args, *job.env.values()])
        if uses_dir:
            prefix += f"mkdir -p {shlex.quote(str(values['checkpoint_dir']))} && "
        prefix += env + " " if env else ""
        return prefix + shlex.join(self.backend.reproduce_argv(argv, request.world_size))
