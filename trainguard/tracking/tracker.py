"""The MLflow tracker: every run trainguard launches becomes an MLflow run, off the critical path.

Structure (one experiment, ``trainguard``, per store):

* a **session run** per ``trainguard check`` invocation or pytest session (per store),
* a **check run** per check, nested under it (tags ``trainguard.check``, ``trainguard.status``;
  the check's result JSON as an artifact; see :func:`trainguard.tracking.track_check`),
* a **launch run** per logical run a check launches, nested under the check run. Restarts of one
  logical run (:meth:`JobRunner.supervise`) share it: the tag ``attempt`` holds the latest attempt
  number and each attempt's logs go under ``attempt-N/``.

Only the trainguard process writes (never the ranks). :class:`Tracker` only enqueues; its
background writer (:class:`~trainguard.tracking.writer.StoreWriter`) batches metrics, retries
while the store is unreachable, and is flushed within a bound at the end (:meth:`Tracker.close`):
a slow or dead tracking server never stalls or fails a check; what could not be written is named
in a warning. The runner reports its launches to a :class:`TrackingObserver`
(:meth:`Tracker.run_observer`), the :class:`~trainguard.run.observer.RunObserver` that turns
them into launch runs.

``mlflow`` is imported only by the writer thread (never by ``import trainguard`` or the plugin).
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainguard._internal.envvars import MLFLOW_RUN_ID, MLFLOW_RUN_ID_FILE, MLFLOW_TRACKING_URI
from trainguard._version import __version__
from trainguard.config.backends import backend_for
from trainguard.run.observer import MetricCallback
from trainguard.tracking.runs import (
    LIVE_INTERVAL_S,
    LiveMetrics,
    RunHandle,
    metric_rows,
    plot_metrics,
)
from trainguard.tracking.store import EXPERIMENT, store_for, tracking_enabled
from trainguard.tracking.system import environment_snapshot, git_tags
from trainguard.tracking.writer import FLUSH_CAP_FACTOR, METRIC_BATCH_S, StoreWriter

if TYPE_CHECKING:  # pragma: no cover
    from trainguard.config import JobFile
    from trainguard.config.settings import Settings
    from trainguard.launch import RunResult
    from trainguard.run.request import RunRequest

__all__ = [
    "FLUSH_TIMEOUT_S",
    "LAUNCH_RUN_WAIT_S",
    "RUN_ID_ENV",
    "RUN_ID_FILE_ENV",
    "TRACKING_URI_ENV",
    "FlushResult",
    "Tracker",
    "TrackingObserver",
    "TrackingWarning",
    "open_tracker",
]

#: seconds :meth:`Tracker.close` waits for the next write to finish by default: a store that keeps
#: accepting writes is waited for (up to ``FLUSH_CAP_FACTOR`` times this), one that stops is not
FLUSH_TIMEOUT_S = 10.0
#: seconds a launch waits for its MLflow run to exist before starting the ranks; past it the
#: ranks get a file to read the run id from once the writer has created the run
LAUNCH_RUN_WAIT_S = 2.0
#: environment variables :mod:`trainguard.tracking.track` reads in the ranks of a launched job
RUN_ID_ENV = MLFLOW_RUN_ID
RUN_ID_FILE_ENV = MLFLOW_RUN_ID_FILE
TRACKING_URI_ENV = MLFLOW_TRACKING_URI


class TrackingWarning(UserWarning):
    """Something could not be written to the tracking store (the check itself is unaffected)."""


@dataclass(frozen=True)
class FlushResult:
    """What :meth:`Tracker.close` achieved: seconds it took and what was not written."""

    seconds: float
    unwritten: list[str]
    errors: list[str]

    @property
    def complete(self) -> bool:
        return not self.unwritten and not self.errors



class Tracker(StoreWriter):
    """The one writer to one tracking store: a queue drained by a background thread.

    Every public method only enqueues and returns at once. The thread retries an operation that
    failed for a transient reason (store unreachable or locked) with backoff, in order, so nothing
    is lost while the store recovers; :meth:`close` waits at most ``flush_timeout`` seconds.
    ``session`` is the session run, ``check_run`` the run of the check running now (set by
    :func:`~trainguard.tracking.track_check`).
    """

    def __init__(
        self,
        tracking_uri: str,
        *,
        artifact_location: str | None = None,
        experiment: str = EXPERIMENT,
        flush_timeout: float | None = None,
        sample_interval: float = LIVE_INTERVAL_S,
        metric_interval: float = METRIC_BATCH_S,
        warn: Callable[[str], None] | None = None,
    ) -> None:
        self.flush_timeout = FLUSH_TIMEOUT_S if flush_timeout is None else flush_timeout
        self.warn = warn or (lambda text: warnings.warn(text, TrackingWarning, stacklevel=3))
        self.session: RunHandle | None = None
        self.session_failed = False
        self._check_run: RunHandle | None = None
        self._here = threading.local()  # a check run of one thread (check_run_here)
        self.flush_result: FlushResult | None = None
        super().__init__(tracking_uri, artifact_location=artifact_location, experiment=experiment,
                         sample_interval=sample_interval, metric_interval=metric_interval)

    @property
    def check_run(self) -> RunHandle | None:
        """The run of the check running now: this thread's own (:meth:`check_run_here`), else
        the one set for every thread."""
        own: RunHandle | None = getattr(self._here, "run", self._check_run)
        return own

    @check_run.setter
    def check_run(self, handle: RunHandle | None) -> None:
        self._check_run = handle

    @contextlib.contextmanager
    def check_run_here(self, handle: RunHandle | None) -> Iterator[None]:
        """``handle`` is the check run in this thread only, inside (a check finished in a thread
        of its own, beside others)."""
        self._here.run = handle
        try:
            yield
        finally:
            del self._here.run

    def run_observer(self) -> TrackingObserver:
        """The :class:`~trainguard.run.observer.RunObserver` that logs a runner's launches here
        (``JobRunner(..., tracker=tracker)`` asks for it)."""
        return TrackingObserver(self)

    # -- enqueueing (never blocks) ------------------------------------------------------------

    def start_run(
        self,
        name: str,
        *,
        parent: RunHandle | None = None,
        tags: Mapping[str, str] | None = None,
        params: Mapping[str, Any] | None = None,
        shared: str | os.PathLike[str] | None = None,
    ) -> RunHandle:
        """Create a run (nested under ``parent``), with tags and params; returns its handle.
        ``shared``: a registry file several processes share; the first to get there creates the
        run, the others join it (and write no params, tags or text artifacts to it)."""
        handle = RunHandle(name, parent, shared=None if shared is None else str(shared))
        all_tags = {"trainguard.version": __version__, **(tags or {})}
        self._put("create", handle, all_tags, f"run {name!r}")
        if params:
            self.log_params(handle, params)
        return handle

    def attach(self, run_id: str) -> RunHandle:
        """A handle on an existing run (the ``trainguard.tracking.track`` helper logs into one)."""
        handle = RunHandle(run_id, run_id=run_id)
        handle.created.set()
        return handle

    def log_params(self, handle: RunHandle, params: Mapping[str, Any]) -> None:
        """Log params (None values left out; others as text, JSON for non-strings)."""
        clean = {k: _param_text(v) for k, v in params.items() if v is not None}
        self._put("params", handle, clean, f"{len(clean)} params of {handle.name!r}")

    def set_tags(self, handle: RunHandle, tags: Mapping[str, str] | Callable[[], Mapping[str, str]]) -> None:
        """Set tags; a callable is evaluated by the writer (e.g. git state, off the critical path)."""
        self._put("tags", handle, tags, f"tags of {handle.name!r}")

    def log_metrics(self, handle: RunHandle, metrics: Sequence[tuple[str, float, int, int]]) -> None:
        """Log ``(key, value, step, timestamp_ms)`` tuples (batched by the writer)."""
        if metrics:
            self._put("metrics", handle, list(metrics), f"metrics of {handle.name!r}")

    def log_metrics_once(self, handle: RunHandle, metrics: Sequence[tuple[str, float, int, int]]) -> None:
        """Log the ``(key, value, step, timestamp_ms)`` tuples whose (key, step) the run does not
        hold yet, as the writer finds when it sends them (off the caller's thread): rows another
        process may already have logged (a Ray worker killed after its write, before its record)."""
        if metrics:
            self._put("metrics_once", handle, list(metrics), f"metrics of {handle.name!r}")

    def log_artifact(self, handle: RunHandle, path: str | os.PathLike[str], artifact_path: str | None = None) -> None:
        """Upload the file at ``path`` (skipped when it does not exist by then) under ``artifact_path``."""
        self._put("artifact", handle, (str(path), artifact_path), f"artifact {Path(path).name} of {handle.name!r}")

    def log_text(self, handle: RunHandle, text: str | Callable[[], str], artifact_file: str) -> None:
        """Write ``text`` (a callable: evaluated by the writer) as the artifact ``artifact_file``."""
        self._put("text", handle, (text, artifact_file), f"artifact {artifact_file} of {handle.name!r}")

    def log_generated(self, handle: RunHandle, make: Callable[[], Path | None], artifact_path: str) -> None:
        """Log the file ``make()`` writes (called by the writer, e.g. a plot; None: nothing)."""
        self._put("plot", handle, (make, artifact_path), f"{artifact_path}/ of {handle.name!r}")

    def end_run(self, handle: RunHandle, status: str = "FINISHED") -> None:
        """Mark the run ended (FINISHED, FAILED or KILLED)."""
        self.stop_sampling(handle)
        self._put("end", handle, status, f"end of {handle.name!r}")

    # -- closing ------------------------------------------------------------------------------

    def close(self, timeout: float | None = None) -> FlushResult:
        """End the session run, flush within ``timeout`` (default ``flush_timeout``) and join the
        writer. What was not written by then is dropped and named in a :class:`TrackingWarning`."""
        if self.flush_result is not None:
            return self.flush_result
        if self.session is not None and self.session.shared is None:  # a shared one: the pytest controller ends it
            self.end_run(self.session, "FAILED" if self.session_failed else "FINISHED")
        timeout = self.flush_timeout if timeout is None else timeout
        unwritten, seconds = self.drain(timeout)
        result = FlushResult(seconds, unwritten, list(self.errors))
        self.flush_result = result
        if self.unwritable is not None:
            self.warn(
                f"trainguard tracking: the MLflow store {self.tracking_uri} cannot be written: "
                f"{self.unwritable}; tracking stopped there ({len(unwritten) + self.dropped} "
                "item(s) not logged). The checks and their verdicts are unaffected and their run "
                "directories hold the logs; free space or make the store writable, point "
                "MLFLOW_TRACKING_URI elsewhere, or set TRAINGUARD_TRACKING=off"
            )
        elif unwritten:
            shown = "; ".join(unwritten[:8]) + (f"; and {len(unwritten) - 8} more" if len(unwritten) > 8 else "")
            self.warn(
                f"trainguard tracking: {len(unwritten)} item(s) not written to {self.tracking_uri} "
                f"(gave up after {result.seconds:.0f} s: no write finished for {timeout:g} s, or the "
                f"{timeout * FLUSH_CAP_FACTOR:g} s cap was reached; last error: {self.last_error or 'none'}): {shown}. "
                "The checks are unaffected and their run directories hold the logs; start the "
                "tracking server or set TRAINGUARD_TRACKING=off"
            )
        elif self.errors:
            self.warn(f"trainguard tracking: {len(self.errors)} write(s) to {self.tracking_uri} failed: "
                      + "; ".join(self.errors[:5]))
        return result

    def shutdown(self) -> None:
        """:meth:`close`, for cleanup callbacks that take no arguments and return nothing."""
        self.close()



class TrackingObserver:
    """The :class:`~trainguard.run.observer.RunObserver` that logs a runner's launches to a
    :class:`Tracker`: each logical run is a launch run (its token is the :class:`RunHandle`),
    nested under the check run running now (a run started ahead: under the session until its
    check takes it), with its system metrics, live metrics, attempts, logs and loss plot."""

    def __init__(self, tracker: Tracker) -> None:
        self.tracker = tracker

    def launch_started(
        self, job_file: JobFile, request: RunRequest, *, label: str, command: str,
        ahead_of: str | None = None,
    ) -> RunHandle:
        """Create the launch run of one logical run (before its first attempt) and start
        sampling. ``ahead_of``: a run started early for that check (see
        :meth:`RunScheduler.start_lane`); it is nested under the session until the check takes it
        (:meth:`launch_adopted`)."""
        tracker = self.tracker
        job = job_file.job
        check = ahead_of or (tracker.check_run.name if tracker.check_run else None)
        handle = tracker.start_run(
            label,
            parent=tracker.session if ahead_of else tracker.check_run or tracker.session,
            tags={"trainguard.kind": "launch", "trainguard.job": job.name,
                  **({"trainguard.check": check} if check else {}),
                  **({"trainguard.started_ahead": "true"} if ahead_of else {})},
            params={
                "job": job.name,
                "command": command,
                "world_size": request.world_size,
                "seed": request.seed,
                "steps": request.steps,
                "args": " ".join(request.args) or None,
                "check": check,
            },
        )
        tracker.log_artifact(handle, job_file.path, "job")
        tracker.start_sampling(handle)
        return handle

    def attempt_env(
        self, job_file: JobFile, launch: object, world_size: int, log_dir: Path
    ) -> tuple[dict[str, str], MetricCallback | None]:
        """What one attempt of a tracked launch needs: the environment that lets
        :mod:`trainguard.tracking.track` in the ranks log into the launch run, and the live
        metric callback.

        The launch run is created by the writer thread: this waits at most
        ``LAUNCH_RUN_WAIT_S`` for it (never longer: a slow store must not stall the check). Past
        that the ranks get ``TRAINGUARD_MLFLOW_RUN_ID_FILE`` instead, a file the writer fills in
        once the run exists (rank 0's writer reads it off its training loop's path); the tag
        ``trainguard.run_id_env`` records which way the id went (``env`` or ``file``)."""
        tracker = self.tracker
        if not isinstance(launch, RunHandle):
            return {}, None
        handle = launch
        env = {TRACKING_URI_ENV: tracker.tracking_uri}
        if tracker.last_error is None:  # a store that is failing is not waited for at every launch
            handle.created.wait(LAUNCH_RUN_WAIT_S)
        id_file = Path(log_dir) / "mlflow_run_id"
        run_id = tracker.run_id_or_file(handle, id_file)
        if run_id is None:
            id_file.parent.mkdir(parents=True, exist_ok=True)
            env[RUN_ID_FILE_ENV] = str(id_file)
        else:
            env[RUN_ID_ENV] = run_id
        tracker.set_tags(handle, {"trainguard.run_id_env": "env" if run_id else "file"})
        if backend_for(job_file.job.kind).ranks_log_metrics():
            return env, None  # e.g. Ray's workers: their designated writer streams the metrics
        handle.live = LiveMetrics(tracker, handle, world_size)
        return env, handle.live.on_metric

    def attempt_finished(
        self, job_file: JobFile, launch: object, result: RunResult, attempt: int, *, final: bool
    ) -> None:
        """Log one attempt's metrics (per rank and their mean, by step; what was not streamed
        live), outcome and rank logs; after the final attempt, the loss-curve plot of all
        attempts, and end the launch run."""
        tracker = self.tracker
        if not isinstance(launch, RunHandle):
            return
        handle = launch
        started_ms = int((time.time() - result.duration_s) * 1000)
        sent = handle.live.sent if handle.live is not None else set()
        handle.live = None
        rows = metric_rows(result.points, result.world_size, started_ms)
        log = tracker.log_metrics
        reconciled = backend_for(job_file.job.kind).reconcile_metrics(result, rows, handle.run_id)
        if reconciled is not None:  # the ranks' own writer logged what it could: the rest
            rows, writer_tags, note = reconciled
            tracker.set_tags(handle, writer_tags)
            if note:
                tracker.warn(note)
            if writer_tags.get("trainguard.ray_writer") != "none":
                # a worker killed between its write and its record (a drill, Ray Train's restart)
                # wrote steps its record does not hold: only the steps the run lacks are logged
                log = tracker.log_metrics_once
        log(handle, [row for row in rows if (row[0], row[2]) not in sent])
        handle.history.append((attempt, list(result.points)))
        end_ms = int(time.time() * 1000)
        tracker.log_metrics(handle, [
            *((f"peak_rss_mb/rank{r}", v, attempt, end_ms) for r, v in sorted(result.peak_rss_mb.items())),
            *((f"peak_gpu_mb/rank{r}", v, attempt, end_ms) for r, v in sorted(result.peak_gpu_mb.items())),
            ("duration_s", result.duration_s, attempt, end_ms),
        ])
        tracker.set_tags(handle, {
            "attempt": str(attempt),
            f"attempt.{attempt}.outcome": result.outcome,
            f"attempt.{attempt}.reason": result.reason[:5000],
            "trainguard.outcome": result.outcome,
            "trainguard.run_dir": str(result.run_dir),
        })
        for rank in range(result.world_size):
            for stream in ("stdout", "stderr"):
                tracker.log_artifact(handle, result.log_path(rank, stream), f"logs/attempt-{attempt}")
        if final:
            history = list(handle.history)
            target = Path(result.run_dir) / "plots" / "loss.png"
            tracker.log_generated(handle, lambda: plot_metrics(history, result.world_size, target, title=handle.name),
                                  "plots")
            tracker.end_run(handle, "FINISHED" if result.ok else "FAILED")

    def launch_aborted(self, launch: object) -> None:
        """End the launch run of a launch that raised (e.g. KeyboardInterrupt) as KILLED."""
        if isinstance(launch, RunHandle):
            self.tracker.end_run(launch, "KILLED")

    def launch_adopted(self, launch: object) -> None:
        """Nest a launch run started ahead (``ahead_of``) under the check that takes it, the
        one running now."""
        check = self.tracker.check_run
        if check is None or not isinstance(launch, RunHandle):
            return
        self.tracker.set_tags(launch, lambda: {"mlflow.parentRunId": check.run_id} if check.run_id else {})


def open_tracker(
    job_file: JobFile,
    settings: Settings,
    *,
    run_name: str,
    environ: Mapping[str, str] | None = None,
    tags: Mapping[str, str] | None = None,
    warn: Callable[[str], None] | None = None,
    shared: str | os.PathLike[str] | None = None,
) -> Tracker | None:
    """A started :class:`Tracker` for ``job_file`` with its session run created, or None when
    tracking is off. ``MLFLOW_TRACKING_URI`` (when set) wins over the default store. ``shared``:
    the registry file of a session run several processes share (pytest-xdist workers), see
    :meth:`Tracker.start_run`."""
    if not tracking_enabled(settings.tracking):
        return None
    uri, artifacts = store_for(job_file, environ)
    tracker = Tracker(uri, artifact_location=artifacts, warn=warn)
    tracker.session = tracker.start_run(
        run_name,
        tags={"trainguard.job": job_file.job.name, "trainguard.kind": "session", **(tags or {})},
        params={"job_file": str(job_file.path), "job": job_file.job.name},
        shared=shared,
    )
    tracker.log_artifact(tracker.session, job_file.path, "job")
    tracker.set_tags(tracker.session, lambda: git_tags(job_file.cwd))
    tracker.log_text(tracker.session, lambda: json.dumps(environment_snapshot(), indent=2), "environment.json")
    return tracker


def _param_text(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    return text[:6000]
