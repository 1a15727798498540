"""Running a job file's command: placeholders, run directories, shared reference runs.

:class:`JobRunner` turns "run the job for 20 steps with seed 0 on 2 ranks" into a
:class:`~trainguard.launch.LaunchSpec` and launches it in a fresh run directory. Checks that need
the same uninterrupted run (determinism's first run, resume's reference) share it through
:meth:`JobRunner.reference`.
"""

from __future__ import annotations

import dataclasses
import shlex
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from trainguard.config import CheckSpec, JobFile, MetricFile
from trainguard.config.settings import Settings
from trainguard.launch import Launcher, LaunchSpec, MetricPoint, RunResult, trajectory
from trainguard.launch.rundir import new_run_dir

if TYPE_CHECKING:  # pragma: no cover
    from trainguard.raytrain.local_ray import LocalRay
    from trainguard.tracking import Tracker

__all__ = ["AheadRun", "JobRunner", "RunRequest", "SupervisedRun"]


@dataclass(frozen=True)
class RunRequest:
    """The parameters of one run; equal requests give interchangeable reference runs."""

    steps: int
    seed: int
    world_size: int
    args: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    timeout: float | None = None
    max_rss_mb: float | None = None  # per rank's process tree; the launcher stops the run above

    @classmethod
    def make(
        cls,
        *,
        steps: int,
        seed: int,
        world_size: int,
        args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        timeout: float | None = None,
        max_rss_mb: float | None = None,
    ) -> RunRequest:
        return cls(
            steps, seed, world_size, tuple(args), tuple(sorted((env or {}).items())), timeout,
            max_rss_mb,
        )


@dataclass
class SupervisedRun:
    """All attempts of one logical run under the restart policy."""

    attempts: list[RunResult]
    run_dir: Path
    checkpoint_dir: Path

    @property
    def final(self) -> RunResult:
        return self.attempts[-1]

    @property
    def ok(self) -> bool:
        return self.final.ok

    @property
    def restarts(self) -> int:
        return len(self.attempts) - 1

    @property
    def points(self) -> list[MetricPoint]:
        """Metric points of every attempt in order (a re-run step's latest value wins)."""
        return [p for attempt in self.attempts for p in attempt.points]

    def trajectory(self, name: str = "loss") -> dict[int, float]:
        return trajectory(self.points, name)


_warmed = threading.Event()


@dataclass
class AheadRun:
    """A run a later check will need, started early in the runner's background lane (see
    :meth:`JobRunner.start_lane`): ``check`` takes it with :meth:`JobRunner.take_ahead`."""

    check: str
    request: RunRequest
    label: str
    on_metric: Callable[[MetricPoint, Launcher], None] | None = None
    #: its result; None when the lane was closed before it started
    future: Future[RunResult | None] = field(default_factory=Future, repr=False)
    tracked: object = field(default=None, repr=False)  # its MLflow launch run, re-nested on take
    #: the check running in the foreground when this run started (the report says so)
    beside: str | None = None
    #: queued -> running -> done; "claimed": its check came first and runs it itself
    state: str = "queued"


def _warm_torch_import() -> None:
    """Import torch in a background thread while the first run starts: the checks load its
    checkpoints in this process later, and the import (2-3 s of one core) then overlaps the
    ranks' own start-up instead of following it."""
    if _warmed.is_set():
        return
    _warmed.set()

    def work() -> None:
        import contextlib

        with contextlib.suppress(Exception):
            import torch  # noqa: F401

    threading.Thread(target=work, name="trainguard-import-torch", daemon=True).start()


@dataclass
class JobRunner:
    """Launches runs of one job file."""

    job_file: JobFile
    settings: Settings = field(default_factory=Settings)
    echo: Callable[[int, str, str], None] | None = None
    #: logs every launched run to MLflow (see trainguard.tracking); None: tracking off
    tracker: Tracker | None = None
    _references: dict[RunRequest, RunResult] = field(default_factory=dict)
    #: the embedded Ray head a ray_train job's runs share (started on first use; see close())
    _ray: LocalRay | None = field(default=None, repr=False)
    #: the loss curve of every run launched through :meth:`run` (label, world size, step -> loss),
    #: in launch order: the profile's report plots the checks' curves next to its own
    curves: list[dict[str, object]] = field(default_factory=list, repr=False)
    _pending: dict[RunRequest, Future[RunResult]] = field(default_factory=dict, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _inflight: set[Launcher] = field(default_factory=set, repr=False)
    _parent: JobRunner | None = field(default=None, repr=False)
    _lane: list[AheadRun] = field(default_factory=list, repr=False)
    _lane_closed: threading.Event = field(default_factory=threading.Event, repr=False)
    _lane_thread: threading.Thread | None = field(default=None, repr=False)
    #: the check running in the foreground (set by :func:`trainguard.session.run_check`)
    current_check: str | None = None

    def sibling(self, job_file: JobFile) -> JobRunner:
        """A runner of a variant of this job file (another batch size, say) with the same
        settings, echo and tracker that shares this runner's embedded Ray head."""
        other = JobRunner(job_file, self.settings, echo=self.echo, tracker=self.tracker)
        other._parent = self
        return other

    def ray_env(self) -> dict[str, str]:
        """For a ``ray_train`` job: the environment that points its driver at Ray --
        ``RAY_ADDRESS`` when set (a real cluster), else one embedded local head shared by every
        run of this runner (starting Ray once instead of per run). Empty for command jobs."""
        if self.job_file.job.kind != "ray_train":
            return {}
        if self._parent is not None:
            return self._parent.ray_env()
        if self._ray is None:
            from trainguard.raytrain.local_ray import LocalRay

            self._ray = LocalRay(dashboard=False)
        return self._ray.start().client_env()

    def close(self) -> None:
        """Stop what this runner started for its runs (background reference runs, the embedded
        Ray head). Idempotent."""
        self.close_lane()
        self.stop_background("the runner was closed")
        if self._ray is not None:
            self._ray.stop()
            self._ray = None

    def placeholders(self, request: RunRequest, run_dir: Path, checkpoint_dir: Path | None) -> dict[str, object]:
        job = self.job_file.job
        values: dict[str, object] = {
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

    def run(
        self,
        request: RunRequest,
        *,
        label: str,
        resume: bool = False,
        checkpoint_dir: Path | None = None,
        on_metric: Callable[[MetricPoint, Launcher], None] | None = None,
        restart_count: int = 0,
        ahead: AheadRun | None = None,
    ) -> RunResult:
        """Launch one run in a new run directory (``checkpoint_dir`` given: reuse that one)."""
        run_dir = new_run_dir(
            self.job_file.state_dir, self.job_file.job.name, label, keep=self.settings.keep_runs
        )
        values = self.placeholders(request, run_dir, checkpoint_dir)
        _warm_torch_import()
        tracked = self._track_start(request, label, resume, ahead_of=ahead.check if ahead else None)
        if ahead is not None:
            ahead.tracked = tracked
        launched = time.monotonic()
        try:
            result = self._launch(
                request, values, run_dir, label=label, resume=resume, on_metric=on_metric,
                restart_count=restart_count, tracked=tracked,
            )
        except BaseException:
            self._track_abort(tracked)
            raise
        self._track_attempt(tracked, result, restart_count, final=True)
        self._record_curve(label, request, result, (launched, time.monotonic()))
        return result

    def _record_curve(self, label: str, request: RunRequest, result: RunResult, span: tuple[float, float]) -> None:
        metrics = self.job_file.job.metrics
        name = "loss" if "loss" in metrics else next(iter(metrics), None)
        if name is None or len(self.curves) >= 32:
            return
        curve = trajectory(result.points, name)
        if curve:
            self.curves.append({"label": label, "world_size": request.world_size, "metric": name,
                                "outcome": result.outcome, "values": curve, "span": span})

    def supervise(
        self,
        request: RunRequest,
        *,
        label: str,
        max_restarts: int | None = None,
        backoff_s: float = 1.0,
        on_metric: Callable[[MetricPoint, Launcher], None] | None = None,
        restart_on: tuple[str, ...] = ("failed", "hung"),
        extra_env: Mapping[str, str] | None = None,
        preexec: Callable[[int], None] | None = None,
        checkpoint_dir: Path | None = None,
        stall_timeout: float | None = None,
        startup_timeout: float | None = None,
    ) -> SupervisedRun:
        """Run with the restart policy: when an attempt fails (a rank died or hung), restart the
        whole group from the latest checkpoint with ``resume_args``, in new processes on a fresh
        rendezvous port, up to ``max_restarts`` times (default ``job.max_restarts``), waiting
        ``backoff_s`` (doubling, at most 30 s) between attempts. Every attempt is recorded; all
        attempts of one logical run share its ``{run_dir}`` and checkpoint directory, each with
        its own ``attempt-N/`` log directory. ``on_metric`` callbacks see the attempt number as
        ``launcher.spec.restart_count``. Fault drills pass ``extra_env`` and ``preexec`` (for
        every rank of every attempt), their own ``checkpoint_dir``, ``stall_timeout`` and
        ``startup_timeout`` (the stall limit before the first metric line)."""
        limit = self.job_file.job.max_restarts if max_restarts is None else max_restarts
        run_dir = new_run_dir(
            self.job_file.state_dir, self.job_file.job.name, label, keep=self.settings.keep_runs
        )
        values = self.placeholders(request, run_dir, checkpoint_dir)
        attempts: list[RunResult] = []
        delay = backoff_s
        tracked = self._track_start(request, label, False)  # all attempts share one tracked run
        for attempt in range(limit + 1):
            if attempt:
                time.sleep(delay)
                delay = min(delay * 2, 30.0)
            try:
                result = self._launch(
                    request, values, run_dir / f"attempt-{attempt}", label=f"{label}-{attempt}",
                    resume=attempt > 0, on_metric=on_metric, restart_count=attempt,
                    max_restarts=limit, extra_env=extra_env, preexec=preexec,
                    stall_timeout=stall_timeout, startup_timeout=startup_timeout, tracked=tracked,
                )
            except BaseException:
                self._track_abort(tracked)
                raise
            attempts.append(result)
            last = result.outcome not in restart_on or attempt == limit
            self._track_attempt(tracked, result, attempt, final=last)
            if last:
                break
        return SupervisedRun(attempts, run_dir, Path(str(values["checkpoint_dir"])))

    def _track_start(self, request: RunRequest, label: str, resume: bool, ahead_of: str | None = None) -> object:
        if self.tracker is None:
            return None
        from trainguard.tracking import start_launch

        return start_launch(self, request, label=label, command=self.command_line(request, resume=resume),
                            ahead_of=ahead_of)

    def _track_attempt(self, tracked: object, result: RunResult, attempt: int, *, final: bool) -> None:
        if self.tracker is None or tracked is None:
            return
        from trainguard.tracking import RunHandle, log_attempt

        assert isinstance(tracked, RunHandle)
        log_attempt(self, tracked, result, attempt, final=final)

    def _track_abort(self, tracked: object) -> None:
        """End the tracked run of a launch that raised (e.g. KeyboardInterrupt) as KILLED."""
        from trainguard.tracking import RunHandle

        if self.tracker is not None and isinstance(tracked, RunHandle):
            self.tracker.end_run(tracked, "KILLED")

    def _track_hooks(
        self, tracked: object, world_size: int, log_dir: Path
    ) -> tuple[dict[str, str], Callable[[MetricPoint, Launcher], None] | None]:
        """The launch run's id for ``trainguard.tracking.track`` in the ranks, and the live metric stream."""
        if self.tracker is None or tracked is None:
            return {}, None
        from trainguard.tracking import RunHandle, launch_hooks

        assert isinstance(tracked, RunHandle)
        return launch_hooks(self, tracked, world_size, log_dir)

    def _launch(
        self,
        request: RunRequest,
        values: dict[str, object],
        log_dir: Path,
        *,
        label: str,
        resume: bool,
        on_metric: Callable[[MetricPoint, Launcher], None] | None,
        restart_count: int,
        max_restarts: int | None = None,
        extra_env: Mapping[str, str] | None = None,
        preexec: Callable[[int], None] | None = None,
        stall_timeout: float | None = None,
        startup_timeout: float | None = None,
        tracked: object = None,
    ) -> RunResult:
        job = self.job_file.job
        Path(str(values["checkpoint_dir"])).mkdir(parents=True, exist_ok=True)
        argv = self.job_file.argv(values, extra_args=request.args, resume=resume)
        env = self.ray_env()
        env.update({k: v.format_map(values) for k, v in job.env.items()})
        env.update({k: v.format_map(values) for k, v in request.env})
        env.update(extra_env or {})
        track_env, live_metrics = self._track_hooks(tracked, request.world_size, log_dir)
        env = {**track_env, **env}  # the job's own environment wins
        scale = self.settings.timeout_scale
        timeout = (request.timeout or job.timeout) * scale
        regexes = {n: s for n, s in job.metrics.items() if isinstance(s, str)}
        files = {
            n: s.file.replace("{rank}", "\0").format_map(values).replace("\0", "{rank}")
            for n, s in job.metrics.items()
            if isinstance(s, MetricFile)
        }
        spec = LaunchSpec(
            argv=argv,
            run_dir=log_dir,
            # a Ray Train job is one driver process; its workers are Ray's (request.world_size)
            world_size=1 if job.kind == "ray_train" else request.world_size,
            cwd=self.job_file.cwd,
            env=env,
            metric_regexes=regexes,
            metric_files=files,
            timeout=timeout,
            stall_timeout=(stall_timeout or job.stall_timeout) * scale,
            startup_timeout=startup_timeout * scale if startup_timeout else None,
            max_restarts=job.max_restarts if max_restarts is None else max_restarts,
            restart_count=restart_count,
            echo=self.echo,
            label=label,
            max_rss_mb=request.max_rss_mb,
            preexec=preexec,
        )
        launcher = Launcher(spec)
        if live_metrics is not None:
            launcher.on_metric.append(live_metrics)
        if on_metric is not None:
            launcher.on_metric.append(on_metric)
        if threading.current_thread() is not threading.main_thread():
            with self._lock:
                self._inflight.add(launcher)
        try:
            result = launcher.run()
        finally:
            with self._lock:
                self._inflight.discard(launcher)
        result.evidence.setdefault("checkpoint_dir", str(values["checkpoint_dir"]))
        return result

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

    @staticmethod
    def _reference_key(request: RunRequest) -> RunRequest:
        # limits are not what a run computes: a run that finished within any limits is the
        # uninterrupted run of its steps, seed, world size, args and env
        return dataclasses.replace(request, timeout=None, max_rss_mb=None)

    def reference(self, request: RunRequest) -> RunResult:
        """An uninterrupted run for ``request``, launched once and shared between checks (one
        started by :meth:`prefetch` or offered by :meth:`offer_reference` counts)."""
        key = self._reference_key(request)
        with self._lock:
            if key in self._references:
                return self._references[key]
            pending = self._pending.get(key)
        if pending is not None:
            try:
                return pending.result()
            except BaseException:
                self.stop_background("interrupted while waiting for a reference run")
                raise
        result = self.run(request, label="reference")
        with self._lock:
            return self._references.setdefault(key, result)

    def offer_reference(self, request: RunRequest, result: RunResult) -> None:
        """Keep ``result`` as the reference of ``request`` when it completed and none is kept
        yet (the canary's run is the uninterrupted run of its request)."""
        if result.ok:
            with self._lock:
                self._references.setdefault(self._reference_key(request), result)

    def prefetch(self, request: RunRequest) -> None:
        """Start the reference run of ``request`` in the background (when none is kept or
        running): the check launches its own run meanwhile, and :meth:`reference` waits for it.
        On a machine with spare cores two start-ups overlap; every check joins what it started
        (through :meth:`reference`) before it returns, so timing-sensitive checks run alone."""
        if self.job_file.job.kind == "ray_train":
            return  # two fits would queue for the same Ray CPUs: run them one after the other
        key = self._reference_key(request)
        with self._lock:
            if key in self._references or key in self._pending:
                return
            future: Future[RunResult] = Future()
            self._pending[key] = future

        def work() -> None:
            try:
                result = self.run(request, label="reference")
            except BaseException as exc:  # handed to whoever waits in reference()
                future.set_exception(exc)
            else:
                if result.outcome != "stopped":  # stopped by stop_background: not a reference
                    with self._lock:
                        self._references.setdefault(key, result)
                future.set_result(result)
            finally:
                with self._lock:
                    self._pending.pop(key, None)

        threading.Thread(target=work, name=f"trainguard-reference-{request.world_size}", daemon=True).start()

    def join_background(self) -> None:
        """Wait for every background reference run (checks call this before they return)."""
        with self._lock:
            pending = list(self._pending.values())
        for future in pending:
            try:
                future.result()
            except BaseException:
                self.stop_background("interrupted while waiting for a reference run")
                raise

    def stop_background(self, reason: str) -> None:
        """Stop every run still launched by a :meth:`prefetch` thread (Ctrl-C, a failed check)."""
        with self._lock:
            running = list(self._inflight)
        for launcher in running:
            launcher.stop(reason)

    def start_lane(self, runs: Sequence[AheadRun]) -> None:
        """Launch ``runs`` one after the other in one background thread while the checks before
        the ones that need them run in the foreground (on a 2-core machine two start-ups overlap
        well; a third would only queue). Each is taken by its check with :meth:`take_ahead`;
        :meth:`close_lane` stops what nobody took. Only for runs that are not timing-sensitive:
        the checks that measure speed (profile, drills) must not start before the lane is closed.
        A ``ray_train`` job's fits would queue for the same Ray CPUs: no lane for those."""
        if not runs or self.job_file.job.kind == "ray_train":
            return
        if self._lane_thread is not None:
            raise RuntimeError("the runner's lane was already started")
        self._lane = list(runs)
        items = list(runs)

        def work() -> None:
            for item in items:
                with self._lock:
                    if self._lane_closed.is_set() or item.state == "claimed":
                        item.future.set_result(None)
                        continue
                    item.state = "running"
                item.beside = self.current_check
                try:
                    result = self.run(item.request, label=item.label, on_metric=item.on_metric, ahead=item)
                except BaseException as exc:  # handed to the check that takes it
                    item.future.set_exception(exc)
                else:
                    item.future.set_result(result)
                finally:
                    item.state = "done"

        self._lane_thread = threading.Thread(target=work, name="trainguard-lane", daemon=True)
        self._lane_thread.start()

    def ahead_started(self, check: str, request: RunRequest) -> bool:
        """Whether the lane has started (or finished) a run for ``check`` with ``request``."""
        return any(i.check == check and i.request == request and i.state in ("running", "done")
                   for i in self._lane)

    def take_ahead(self, check: str, request: RunRequest) -> RunResult | None:
        """The run started ahead for ``check`` with exactly ``request`` (waiting for it to end),
        or None when there is none, the lane has not started it yet (it never will: the check
        runs it now) or it was stopped before it could finish."""
        with self._lock:
            item = next((i for i in self._lane if i.check == check and i.request == request), None)
            if item is None:
                return None
            self._lane.remove(item)
            if item.state == "queued":
                item.state = "claimed"
                return None
        try:
            result = item.future.result()
        except BaseException:
            self.close_lane()
            raise
        if result is None or (result.outcome == "stopped" and self._lane_closed.is_set()):
            return None
        from trainguard.tracking import adopt_launch

        adopt_launch(self, item.tracked)
        result.evidence["started_ahead"] = {
            "beside": item.beside,
            "note": "launched in the background while the check before it ran",
        }
        return result

    def close_lane(self) -> None:
        """Stop the lane's runs that no check took and wait for its thread (idempotent)."""
        self._lane_closed.set()
        thread = self._lane_thread
        if thread is None or thread is threading.current_thread():
            return
        # a run between its start and its launcher's registration is caught on a later pass
        deadline = time.monotonic() + 60
        while thread.is_alive() and time.monotonic() < deadline:
            with self._lock:
                running = list(self._inflight)
            for launcher in running:
                launcher.stop("the checks that needed this run are not running")
            thread.join(timeout=0.2)

    def command_line(self, request: RunRequest, *, resume: bool = False) -> str:
        """The job's command as a person would type it (for 'reproduce:' lines)."""
        values = self.placeholders(request, Path("<run_dir>"), None)
        argv = self.job_file.argv(values, extra_args=request.args, resume=resume)
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in request.env)
        prefix = env + " " if env else ""
        if request.world_size > 1 and self.job_file.job.kind == "command":
            if argv and argv[0] in ("python", "python3"):
                return prefix + shlex.join(["torchrun", f"--nproc-per-node={request.world_size}", *argv[1:]])
            return prefix + f"(on {request.world_size} ranks with the torchrun environment) " + shlex.join(argv)
        return prefix + shlex.join(argv)
