"""MLflow tracking: every run trainguard launches becomes an MLflow run, off the critical path.

Structure (one experiment, ``trainguard``, per store):

* a **session run** per ``trainguard check`` invocation or pytest session (per store),
* a **check run** per check, nested under it (tags ``trainguard.check``, ``trainguard.status``;
  the check's result JSON as an artifact),
* a **launch run** per logical run a check launches, nested under the check run. Restarts of one
  logical run (:meth:`JobRunner.supervise`) share it: the tag ``attempt`` holds the latest attempt
  number and each attempt's logs go under ``attempt-N/``.

Only the trainguard process writes (never the ranks). Every write goes through a queue drained by
one background thread (:class:`Tracker`), which batches metrics, retries while the store is
unreachable, and is flushed within a bound at the end (:meth:`Tracker.close`): a slow or dead
tracking server never stalls or fails a check; what could not be written is named in a warning.

``mlflow`` is imported only by the writer thread (never by ``import trainguard`` or the plugin).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import platform
import shutil
import subprocess
import sys
import threading
import time
import warnings
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainguard._internal.envvars import MLFLOW_RUN_ID, MLFLOW_RUN_ID_FILE, MLFLOW_TRACKING_URI
from trainguard._internal.gitstate import git_state
from trainguard._version import __version__
from trainguard.errors import ConfigError

if TYPE_CHECKING:  # pragma: no cover
    from trainguard.config import CheckSpec, JobFile
    from trainguard.config.settings import Settings
    from trainguard.launch import MetricPoint, RunResult
    from trainguard.report import CheckResult
    from trainguard.run.runner import JobRunner, RunRequest

__all__ = [
    "EXPERIMENT",
    "FlushResult",
    "LiveMetrics",
    "RunHandle",
    "Tracker",
    "TrackingWarning",
    "default_store",
    "environment_snapshot",
    "open_tracker",
    "store_for",
    "track_check",
]

#: the experiment every trainguard run is logged to
EXPERIMENT = "trainguard"
#: MLflow's per-request limits for log_batch
_MAX_METRICS, _MAX_PARAMS, _MAX_TAGS = 1000, 100, 100
#: seconds :meth:`Tracker.close` waits for the next write to finish by default: a store that keeps
#: accepting writes is waited for (up to ``FLUSH_CAP_FACTOR`` times this), one that stops is not
FLUSH_TIMEOUT_S = 10.0
FLUSH_CAP_FACTOR = 6
#: seconds :meth:`Tracker.close` waits for mlflow to be imported and the client created, before
#: the flush bound starts
CONNECT_TIMEOUT_S = 60.0
#: seconds metrics wait in the queue to be written together (one ``log_batch`` per interval while
#: a job runs, instead of one per printed line)
METRIC_BATCH_S = 2.0
#: seconds between two live snapshots of a running launch (:class:`LiveMetrics`) and between two
#: system-metric samples. MLflow's sqlite store costs ~1 ms of CPU per metric row and ~10 ms per
#: request: streaming every row of every step live would take 10-20% of a core from the ranks
#: of a fast job (measured: 2 ms of writer CPU per 10 ms step), so the live view is thinned and
#: the rest is written after the attempt; at 2 s the writer still took ~0.9% of a core
LIVE_INTERVAL_S = 5.0
#: seconds a launch waits for its MLflow run to exist before starting the ranks; past it the
#: ranks get a file to read the run id from once the writer has created the run
LAUNCH_RUN_WAIT_S = 2.0
#: environment variables :mod:`trainguard.tracking.track` reads in the ranks of a launched job
RUN_ID_ENV = MLFLOW_RUN_ID
RUN_ID_FILE_ENV = MLFLOW_RUN_ID_FILE
TRACKING_URI_ENV = MLFLOW_TRACKING_URI
#: per-request timeout for a tracking server (the writer retries on its own, so MLflow's retries
#: with backoff, which could block for minutes, are turned off unless the user set them)
_HTTP_TIMEOUT_S = "5"


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


def default_store(state_dir: Path) -> tuple[str, str]:
    """``(tracking_uri, artifact_location)`` of the store next to a job file: sqlite at
    ``.trainguard/mlflow.db`` and artifacts in ``.trainguard/mlartifacts`` (never MLflow's own
    ``./mlflow.db``, which would dirty the user's repository)."""
    state_dir = Path(state_dir).resolve()
    return f"sqlite:///{state_dir / 'mlflow.db'}", (state_dir / "mlartifacts").as_uri()


def store_for(job_file: JobFile, environ: Mapping[str, str] | None = None) -> tuple[str, str | None]:
    """``(tracking_uri, artifact_location)`` for a job: ``MLFLOW_TRACKING_URI`` when set (the
    server decides where artifacts go), else :func:`default_store` next to the job file."""
    environ = os.environ if environ is None else environ
    if environ.get("MLFLOW_TRACKING_URI", "").strip():
        return environ["MLFLOW_TRACKING_URI"].strip(), None
    return default_store(job_file.state_dir)


def tracking_enabled(mode: str) -> bool:
    """Whether tracking mode ``on``/``off``/``auto`` turns tracking on here (``auto``: when mlflow
    is installed; ``on`` without mlflow is an error that says how to install it)."""
    if mode == "off":
        return False
    import importlib.util

    installed = importlib.util.find_spec("mlflow") is not None
    if mode == "on" and not installed:
        raise ConfigError(
            "tracking is 'on' but mlflow is not installed; install it with "
            "`pip install 'trainguard[tracking]'` or set TRAINGUARD_TRACKING=off",
            key="tracking",
        )
    return installed


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


# ------------------------------------------------------------------------------------------------
# the writer


@dataclass
class RunHandle:
    """An MLflow run as the writer will create it; ``run_id`` is set once it exists."""

    name: str
    parent: RunHandle | None = None
    run_id: str | None = None
    failed: str | None = None
    #: set while a run's processes are alive: the writer samples system metrics into it
    sampling_since: float | None = None
    created: threading.Event = field(default_factory=threading.Event, repr=False)
    #: a session run shared by several processes (pytest-xdist workers): the JSON registry file
    #: mapping tracking URI -> run id; the first process creates the run, the others join it
    shared: str | None = None
    #: True when this process joined a shared run another process created
    joined: bool = False
    #: files the writer writes the run id into once the run exists (ranks launched before that
    #: read it from there); a handle made for a rank resolves its run id from ``id_file``
    id_files: list[Path] = field(default_factory=list, repr=False)
    id_file: Path | None = None
    #: per attempt: (attempt, metric points), for the loss-curve plot of a launch run
    history: list[tuple[int, list[MetricPoint]]] = field(default_factory=list, repr=False)
    #: the live metric stream of the attempt running now (see :class:`LiveMetrics`)
    live: LiveMetrics | None = field(default=None, repr=False)


@dataclass(eq=False)
class _Op:
    kind: str  # create | params | tags | metrics | artifact | text | plot | end
    handle: RunHandle
    payload: Any
    what: str
    queued_at: float = field(default_factory=time.monotonic)


class Tracker:
    """The one writer to one tracking store: a queue drained by a background thread.

    Every public method only enqueues and returns at once. The thread retries an operation that
    failed for a transient reason (store unreachable or locked) with backoff, in order, so nothing
    is lost while the store recovers; :meth:`close` waits at most ``flush_timeout`` seconds.
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
        self.tracking_uri = tracking_uri
        self.artifact_location = artifact_location
        self.experiment = experiment
        self.flush_timeout = FLUSH_TIMEOUT_S if flush_timeout is None else flush_timeout
        self.sample_interval = sample_interval
        self.metric_interval = metric_interval
        self.warn = warn or (lambda text: warnings.warn(text, TrackingWarning, stacklevel=3))
        self.session: RunHandle | None = None
        self.session_failed = False
        self.current_check: RunHandle | None = None
        self.errors: list[str] = []
        self.last_error: str | None = None
        self.flush_result: FlushResult | None = None
        self._ops: deque[_Op] = deque()
        #: queued ops by kind ("create", "metrics", other kinds under "other"), so choosing the
        #: next op does not scan the queue
        self._counts: dict[str, int] = {"create": 0, "metrics": 0, "other": 0}
        self._cond = threading.Condition()
        self._closing = False
        self._abandon = False
        self._client: Any = None
        self._experiment_id: str | None = None
        self._sampled: list[RunHandle] = []
        self._progress_at = time.monotonic()
        if tracking_uri.startswith(("http://", "https://")):
            os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
            os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", _HTTP_TIMEOUT_S)
            os.environ.setdefault("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")  # per ended run
        self._thread = threading.Thread(target=self._loop, name="trainguard-tracking", daemon=True)
        self._thread.start()

    # -- enqueueing (never blocks) ------------------------------------------------------------

    def _put(self, op: _Op) -> None:
        with self._cond:
            if self._closing:
                self.errors.append(f"{op.what}: logged after the tracker was closed")
                return
            self._ops.append(op)
            self._count(op, 1)
            if op.kind != "metrics" or self._counts["metrics"] == 1:
                # further metrics wait to be batched: the writer wakes for the first one only,
                # to set its timer
                self._cond.notify()

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
        self._put(_Op("create", handle, all_tags, f"run {name!r}"))
        if params:
            self.log_params(handle, params)
        return handle

    def attach(self, run_id: str) -> RunHandle:
        """A handle on an existing run (the ``trainguard.tracking.track`` helper logs into one)."""
        handle = RunHandle(run_id, run_id=run_id)
        handle.created.set()
        return handle

    def log_params(self, handle: RunHandle, params: Mapping[str, Any]) -> None:
        clean = {k: _param_text(v) for k, v in params.items() if v is not None}
        self._put(_Op("params", handle, clean, f"{len(clean)} params of {handle.name!r}"))

    def set_tags(self, handle: RunHandle, tags: Mapping[str, str] | Callable[[], Mapping[str, str]]) -> None:
        """Set tags; a callable is evaluated by the writer (e.g. git state, off the critical path)."""
        self._put(_Op("tags", handle, tags, f"tags of {handle.name!r}"))

    def log_metrics(self, handle: RunHandle, metrics: Sequence[tuple[str, float, int, int]]) -> None:
        """Log ``(key, value, step, timestamp_ms)`` tuples (batched by the writer)."""
        if metrics:
            self._put(_Op("metrics", handle, list(metrics), f"metrics of {handle.name!r}"))

    def log_artifact(self, handle: RunHandle, path: str | os.PathLike[str], artifact_path: str | None = None) -> None:
        self._put(_Op("artifact", handle, (str(path), artifact_path), f"artifact {Path(path).name} of {handle.name!r}"))

    def log_text(self, handle: RunHandle, text: str | Callable[[], str], artifact_file: str) -> None:
        self._put(_Op("text", handle, (text, artifact_file), f"artifact {artifact_file} of {handle.name!r}"))

    def log_generated(self, handle: RunHandle, make: Callable[[], Path | None], artifact_path: str) -> None:
        """Log the file ``make()`` writes (called by the writer, e.g. a plot; None: nothing)."""
        self._put(_Op("plot", handle, (make, artifact_path), f"{artifact_path}/ of {handle.name!r}"))

    def end_run(self, handle: RunHandle, status: str = "FINISHED") -> None:
        """Mark the run ended (FINISHED, FAILED or KILLED)."""
        self.stop_sampling(handle)
        self._put(_Op("end", handle, status, f"end of {handle.name!r}"))

    def start_sampling(self, handle: RunHandle) -> None:
        """Sample system metrics (CPU, RSS of this process tree, GPUs) into ``handle`` until
        :meth:`stop_sampling`; the writer thread samples between writes."""
        with self._cond:
            handle.sampling_since = time.monotonic()
            self._sampled.append(handle)

    def stop_sampling(self, handle: RunHandle) -> None:
        with self._cond:
            handle.sampling_since = None
            if handle in self._sampled:
                self._sampled.remove(handle)

    # -- closing ------------------------------------------------------------------------------

    def close(self, timeout: float | None = None) -> FlushResult:
        """End the session run, flush within ``timeout`` (default ``flush_timeout``) and join the
        writer. What was not written by then is dropped and named in a :class:`TrackingWarning`."""
        if self.flush_result is not None:
            return self.flush_result
        if self.session is not None and self.session.shared is None:  # a shared one: the pytest controller ends it
            self.end_run(self.session, "FAILED" if self.session_failed else "FINISHED")
        timeout = self.flush_timeout if timeout is None else timeout
        started = time.monotonic()
        with self._cond:
            self._sampled.clear()
            self._closing = True
            self._cond.notify_all()
        # the writer ran at low priority so as not to slow the ranks; now the run is over and
        # the caller waits on it, also for the mlflow import when that has not finished (at
        # nice 10 on a loaded machine it takes minutes); raising a priority needs privileges:
        # best effort
        if self._thread.native_id:
            with contextlib.suppress(OSError, AttributeError):
                os.setpriority(os.PRIO_PROCESS, self._thread.native_id, 0)
        # importing mlflow (seconds on a loaded machine) is local work, not the store's: the
        # bound starts once the client exists
        connect_deadline = started + CONNECT_TIMEOUT_S
        while self._client is None and self._thread.is_alive() and time.monotonic() < connect_deadline:
            self._thread.join(0.05)
        # the bound is on progress: wait while writes keep completing, at most FLUSH_CAP_FACTOR x
        connected = time.monotonic()
        self._progress_at = max(self._progress_at, connected)
        cap = connected + timeout * FLUSH_CAP_FACTOR
        while self._thread.is_alive():
            now = time.monotonic()
            if now >= cap or now - self._progress_at >= timeout:
                break
            self._thread.join(min(0.1, cap - now))
        if self._thread.is_alive():
            with self._cond:
                self._abandon = True
                self._cond.notify_all()
            # the request in flight is bounded by MLFLOW_HTTP_REQUEST_TIMEOUT
            self._thread.join(float(os.environ.get("MLFLOW_HTTP_REQUEST_TIMEOUT", _HTTP_TIMEOUT_S)) + 5)
        with self._cond:
            unwritten = [op.what for op in self._ops]
            self._ops.clear()
            self._counts = dict.fromkeys(self._counts, 0)
        result = FlushResult(time.monotonic() - started, unwritten, list(self.errors))
        self.flush_result = result
        if unwritten:
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

    # -- the writer thread --------------------------------------------------------------------

    def _loop(self) -> None:
        # low CPU priority for this thread (Linux: per thread): importing mlflow and writing
        # must not take cores from the ranks
        with contextlib.suppress(OSError, AttributeError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
        delay = 0.2
        next_sample = time.monotonic()
        while True:
            with self._cond:
                if self._abandon or (self._closing and not self._ops):
                    return
                op = self._next_op()
                if op is None:
                    wake = next_sample
                    if self._ops:  # young metrics only: wake when the oldest is due
                        wake = min(wake, self._ops[0].queued_at + self.metric_interval)
                    if wake > time.monotonic():
                        self._cond.wait(wake - time.monotonic())
                    op = self._next_op()
            if time.monotonic() >= next_sample:
                next_sample = time.monotonic() + self.sample_interval
                self._sample()
            if op is None:
                continue
            try:
                self._apply(op)
            except Exception as exc:
                text = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]
                self.last_error = text
                if _permanent(exc):
                    self.errors.append(f"{op.what}: {text}")
                    if op.kind == "create":
                        op.handle.failed = text
                        op.handle.created.set()
                else:
                    with self._cond:
                        if not self._abandon:
                            self._cond.wait(delay)
                    delay = min(delay * 2, 2.0)
                    continue
            delay = 0.2
            with self._cond:
                for i, queued in enumerate(self._ops):
                    if queued is op:
                        del self._ops[i]
                        self._count(op, -1)
                        break
                self._progress_at = time.monotonic()

    def _next_op(self) -> _Op | None:
        """The op to write next (lock held): a run creation first (a launch waits for its run to
        exist, and creations depend on nothing but earlier creations); then in order, except that
        metrics wait up to ``metric_interval`` to be written in one batch."""
        if not self._ops:
            return None
        if self._counts["create"]:
            for op in self._ops:
                if op.kind == "create":
                    return op
        head = self._ops[0]
        if head.kind == "metrics":
            self._merge_metrics(head)
            young = time.monotonic() - head.queued_at < self.metric_interval
            if young and not self._closing and len(head.payload) < _MAX_METRICS and not self._counts["other"]:
                return None
        return head

    def _count(self, op: _Op, delta: int) -> None:
        kind = op.kind if op.kind in ("create", "metrics") else "other"
        self._counts[kind] += delta

    def _merge_metrics(self, head: _Op) -> None:
        """Fold the metric ops queued right behind ``head`` (same run) into it (lock held)."""
        while len(self._ops) > 1 and len(head.payload) < _MAX_METRICS:
            nxt = self._ops[1]
            if nxt.kind != "metrics" or nxt.handle is not head.handle:
                break
            head.payload.extend(nxt.payload)
            del self._ops[1]
            self._count(nxt, -1)

    def _connect(self) -> Any:
        if self._client is not None:
            return self._client
        import logging

        for name in ("mlflow.store.db.utils", "alembic.runtime.migration"):
            if logging.getLogger(name).level == logging.NOTSET:  # "Creating initial tables" noise
                logging.getLogger(name).setLevel(logging.WARNING)
        # mlflow's own SQLAlchemy deprecation warning says nothing to trainguard's users
        warnings.filterwarnings("ignore", category=DeprecationWarning, module=r"mlflow\.store")
        from mlflow import MlflowClient

        with _store_lock(self.tracking_uri):
            # creating the client creates (migrates) a sqlite schema: once, under the lock
            client = MlflowClient(self.tracking_uri)
            self._client = client
        return client

    def _experiment(self) -> str:
        if self._experiment_id is None:
            client = self._connect()
            with _store_lock(self.tracking_uri):
                exp = client.get_experiment_by_name(self.experiment)
                if exp is None:
                    self._experiment_id = client.create_experiment(
                        self.experiment, artifact_location=self.artifact_location
                    )
                else:
                    self._experiment_id = exp.experiment_id
        return self._experiment_id

    def _apply(self, op: _Op) -> None:
        handle = op.handle
        client = self._connect()
        if handle.run_id is None and handle.id_file is not None:
            # a rank's handle on the launch run: the launching process writes the id once the
            # run exists (transient until then: retried, and named at close if it never comes)
            with contextlib.suppress(OSError):
                handle.run_id = handle.id_file.read_text().strip() or None
            if handle.run_id is None:
                raise _Pending(f"the run id is not in {handle.id_file} yet")
            handle.created.set()
        if op.kind != "create" and handle.run_id is None:
            self.errors.append(f"{op.what}: its run was not created ({handle.failed})")
            return
        if handle.joined and op.kind in ("params", "tags", "text"):
            return  # a shared run's creator wrote those
        if op.kind == "create":
            tags = dict(op.payload)
            if handle.parent is not None:
                if handle.parent.run_id is None:
                    raise _Permanent(f"parent run {handle.parent.name!r} was not created")
                tags["mlflow.parentRunId"] = handle.parent.run_id
            if handle.shared is not None:
                self._create_shared(handle, tags)
            else:
                run = client.create_run(self._experiment(), run_name=handle.name, tags=tags)
                self._created(handle, run.info.run_id)
        elif op.kind == "params":
            from mlflow.entities import Param

            items = list(op.payload.items())
            while items:
                client.log_batch(handle.run_id, params=[Param(k, v) for k, v in items[:_MAX_PARAMS]])
                del items[:_MAX_PARAMS]
                op.payload = dict(items)
        elif op.kind == "tags":
            from mlflow.entities import RunTag

            if callable(op.payload):
                op.payload = dict(op.payload())
            items = [(k, str(v)) for k, v in op.payload.items()]
            while items:
                client.log_batch(handle.run_id, tags=[RunTag(k, v) for k, v in items[:_MAX_TAGS]])
                del items[:_MAX_TAGS]
                op.payload = dict(items)
        elif op.kind == "metrics":
            from mlflow.entities import Metric

            while op.payload:
                chunk = op.payload[:_MAX_METRICS]
                client.log_batch(handle.run_id, metrics=[Metric(k, float(v), ts, step) for k, v, step, ts in chunk])
                del op.payload[:_MAX_METRICS]  # sent: a retry must not send it twice
        elif op.kind == "artifact":
            path, artifact_path = op.payload
            if Path(path).exists():
                client.log_artifact(handle.run_id, path, artifact_path)
        elif op.kind == "text":
            text, artifact_file = op.payload
            if callable(text):
                op.payload = (text := text(), artifact_file)
            client.log_text(handle.run_id, text, artifact_file)
        elif op.kind == "plot":
            make, artifact_path = op.payload
            made = make()
            op.payload = (lambda: made, artifact_path)  # a retry uploads, it does not redraw
            if made is not None and Path(made).exists():
                client.log_artifact(handle.run_id, str(made), artifact_path)
        elif op.kind == "end":
            client.set_terminated(handle.run_id, op.payload)

    def _created(self, handle: RunHandle, run_id: str) -> None:
        """Publish a new run's id: to the handle, and to the files ranks read it from."""
        with self._cond:
            handle.run_id = run_id
            files = list(handle.id_files)
        handle.created.set()
        for path in files:
            with contextlib.suppress(OSError):
                _write_atomic(path, run_id)

    def _create_shared(self, handle: RunHandle, tags: dict[str, str]) -> None:
        """Create the run, or join the one another process already created for this store."""
        assert handle.shared is not None
        registry = Path(handle.shared)
        with _file_lock(registry.with_name(registry.name + ".lock")):
            try:
                known = json.loads(registry.read_text())
            except (OSError, ValueError):
                known = {}
            run_id = known.get(self.tracking_uri)
            if run_id:
                handle.joined = True
                self._created(handle, run_id)
                return
            run = self._connect().create_run(self._experiment(), run_name=handle.name, tags=tags)
            known[self.tracking_uri] = run.info.run_id
            _write_atomic(registry, json.dumps(known, indent=2))
        self._created(handle, run.info.run_id)

    def _sample(self) -> None:
        with self._cond:
            handles = [h for h in self._sampled if h.sampling_since is not None]
        if not handles:
            return
        now_ms = int(time.time() * 1000)
        values = _system_metrics()
        for h in handles:
            step = int(time.monotonic() - (h.sampling_since or 0.0))
            with self._cond:
                if self._closing:
                    return
                op = _Op("metrics", h, [(k, v, step, now_ms) for k, v in values.items()],
                         f"system metrics of {h.name!r}")
                self._ops.append(op)
                self._count(op, 1)


class _Permanent(Exception):
    """An operation that can never succeed (retrying would not help)."""


class _Pending(Exception):
    """An operation that cannot be done yet (retried)."""


def _permanent(exc: BaseException) -> bool:
    if isinstance(exc, (_Permanent, OSError)) and not isinstance(exc, ConnectionError):
        return isinstance(exc, (_Permanent, FileNotFoundError))
    try:
        from mlflow.exceptions import MlflowException
    except ImportError:  # pragma: no cover
        return True
    if isinstance(exc, MlflowException):
        code = getattr(exc, "error_code", "")
        return code in {"INVALID_PARAMETER_VALUE", "RESOURCE_ALREADY_EXISTS", "RESOURCE_DOES_NOT_EXIST",
                        "BAD_REQUEST", "INVALID_STATE", "PERMISSION_DENIED", "UNAUTHENTICATED"}
    return False


@contextlib.contextmanager
def _store_lock(uri: str) -> Iterator[None]:
    """An exclusive file lock next to a sqlite store (pytest-xdist workers share it); a no-op for
    other stores."""
    if not uri.startswith("sqlite:///"):
        yield
        return
    db = Path(uri[len("sqlite:///"):])
    db.parent.mkdir(parents=True, exist_ok=True)
    with _file_lock(db.with_name(db.name + ".lock")):
        yield


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    with open(path, "a+") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _write_atomic(path: Path, text: str) -> None:
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _param_text(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    return text[:6000]


# ------------------------------------------------------------------------------------------------
# what is logged


_PSUTIL_PRIMED = False


def _system_metrics() -> dict[str, float]:
    """CPU and RSS of this process tree (trainguard + its ranks), and GPUs when pynvml works."""
    global _PSUTIL_PRIMED
    out: dict[str, float] = {}
    try:
        import psutil

        out["system/cpu_percent"] = psutil.cpu_percent(None)
        if not _PSUTIL_PRIMED:  # the first cpu_percent(None) call has no interval to measure
            _PSUTIL_PRIMED = True
            del out["system/cpu_percent"]
        me = psutil.Process()
        rss = me.memory_info().rss
        for child in me.children(recursive=True):
            with contextlib.suppress(psutil.Error):
                rss += child.memory_info().rss
        out["system/rss_mb"] = rss / 2**20
        out["system/memory_percent"] = psutil.virtual_memory().percent
    except Exception:
        pass
    out.update(_gpu_metrics())
    return out


#: pynvml once initialised (None: not tried yet; False: unavailable here, never retried)
_NVML: Any = None


def _nvml() -> Any:
    """pynvml, initialised once per process (NVML stays initialised: it is reference counted
    and cheap to keep; initialising it per sample is not), or None without it or a driver."""
    global _NVML
    if _NVML is None:
        try:
            import pynvml  # type: ignore[import-not-found,unused-ignore]

            pynvml.nvmlInit()
            _NVML = pynvml
        except Exception:
            _NVML = False
    return _NVML or None


def _gpu_metrics() -> dict[str, float]:
    """Per GPU: utilization %, memory used (MB), power (W), temperature (C), via pynvml."""
    nvml = _nvml()
    if nvml is None:
        return {}
    out: dict[str, float] = {}
    try:
        count = nvml.nvmlDeviceGetCount()
    except Exception:
        return out
    for i in range(count):
        try:
            h = nvml.nvmlDeviceGetHandleByIndex(i)
        except Exception:
            continue
        with contextlib.suppress(Exception):
            out[f"system/gpu{i}/utilization_percent"] = float(nvml.nvmlDeviceGetUtilizationRates(h).gpu)
        with contextlib.suppress(Exception):
            out[f"system/gpu{i}/memory_mb"] = nvml.nvmlDeviceGetMemoryInfo(h).used / 2**20
        with contextlib.suppress(Exception):
            out[f"system/gpu{i}/power_w"] = nvml.nvmlDeviceGetPowerUsage(h) / 1000.0
        with contextlib.suppress(Exception):
            out[f"system/gpu{i}/temperature_c"] = float(nvml.nvmlDeviceGetTemperature(h, 0))
    return out


def git_tags(directory: Path) -> dict[str, str]:
    """``git.commit`` and ``git.dirty`` of the repository holding ``directory`` (empty when it is
    not in one or git is missing); dirty as everywhere else (:func:`trainguard._internal.gitstate.git_state`)."""
    state = git_state(directory)
    if state.commit is None:
        return {}
    tags = {"git.commit": state.commit, "mlflow.source.git.commit": state.commit}
    if state.dirty is not None:
        tags["git.dirty"] = "true" if state.dirty else "false"
    return tags


def environment_snapshot() -> dict[str, Any]:
    """Python, torch, CUDA, NCCL, GPU models and installed packages. torch is not imported for
    this: its version comes from package metadata and the CUDA version it was built with from
    its ``version.py`` (or from torch itself when already imported); NCCL from torch when
    imported, else the ``nvidia-nccl-*`` wheel torch depends on; GPU models from pynvml (or
    ``nvidia-smi``) when present."""
    import importlib.metadata as md

    dists = {d.metadata["Name"]: d.version for d in md.distributions() if d.metadata["Name"]}
    packages = sorted({f"{name}=={version}" for name, version in dists.items()}, key=str.lower)
    snap: dict[str, Any] = {
        "python": sys.version.split()[0],
        "python_executable": sys.executable,
        "platform": platform.platform(),
        "trainguard": __version__,
        "torch": None,
        "cuda": None,
        "nccl": None,
        "gpus": [],
        "packages": packages,
    }
    with contextlib.suppress(md.PackageNotFoundError):
        snap["torch"] = md.version("torch")
    torch = sys.modules.get("torch")
    if torch is not None:
        snap["cuda"] = getattr(torch.version, "cuda", None)
        with contextlib.suppress(Exception):
            snap["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    elif snap["torch"] is not None:
        snap["cuda"] = _torch_built_with_cuda()
    if snap["nccl"] is None:
        snap["nccl"] = next((v for n, v in sorted(dists.items()) if n.lower().startswith("nvidia-nccl")), None)
    nvml = _nvml()
    if nvml is not None:
        with contextlib.suppress(Exception):
            snap["gpus"] = [
                _text(nvml.nvmlDeviceGetName(nvml.nvmlDeviceGetHandleByIndex(i)))
                for i in range(nvml.nvmlDeviceGetCount())
            ]
        with contextlib.suppress(Exception):
            snap["cuda_driver"] = nvml.nvmlSystemGetCudaDriverVersion()
        with contextlib.suppress(Exception):
            snap["nvidia_driver"] = _text(nvml.nvmlSystemGetDriverVersion())
    elif shutil.which("nvidia-smi"):
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=10, check=True).stdout
            snap["gpus"] = [line.strip() for line in out.splitlines() if line.strip()]
    return snap


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _torch_built_with_cuda() -> str | None:
    """The CUDA version torch was built with, read from ``torch/version.py`` (no torch import)."""
    import importlib.util
    import re

    with contextlib.suppress(Exception):
        spec = importlib.util.find_spec("torch")
        if spec is not None and spec.submodule_search_locations:
            text = (Path(next(iter(spec.submodule_search_locations))) / "version.py").read_text()
            found = re.search(r"^cuda\s*(?::[^=]*)?=\s*['\"]([^'\"]+)['\"]", text, re.MULTILINE)
            return found.group(1) if found else None
    return None


# ------------------------------------------------------------------------------------------------
# hooks the runner and the checks call


@contextlib.contextmanager
def track_check(runner: JobRunner, name: str, spec: CheckSpec) -> Iterator[Callable[[CheckResult], None]]:
    """Open a check run under the tracker's session run for the duration of one check; yields a
    function that records the check's result. A no-op when the runner has no tracker."""
    tracker: Tracker | None = getattr(runner, "tracker", None)
    if tracker is None:
        yield lambda result: None
        return
    handle = tracker.start_run(
        name,
        parent=tracker.session,
        tags={"trainguard.kind": "check", "trainguard.check": name, "trainguard.job": runner.job_file.job.name},
        params={"check": name, **{k: v for k, v in asdict(spec).items() if v not in (None, (), [], {})}}
        if _is_dataclass(spec) else {"check": name},
    )
    outcome: list[CheckResult] = []
    previous, tracker.current_check = tracker.current_check, handle
    try:
        yield outcome.append
    except BaseException:
        tracker.set_tags(handle, {"trainguard.status": "error"})
        tracker.session_failed = True
        tracker.end_run(handle, "FAILED")
        raise
    finally:
        tracker.current_check = previous
    if outcome:
        result = outcome[-1]
        tracker.set_tags(handle, {"trainguard.status": result.status, "trainguard.summary": result.summary[:5000]})
        tracker.log_metrics(handle, [("duration_s", result.duration_s, 0, int(time.time() * 1000))])
        tracker.log_text(handle, lambda: json.dumps(asdict(result), indent=2, default=str), "result.json")
        plots = result.evidence.get("plots", [])  # the contract: checks put plot paths here
        for plot in [plots] if isinstance(plots, (str, os.PathLike)) else plots or []:
            tracker.log_artifact(handle, plot, "plots")
        if not result.ok:
            tracker.session_failed = True
        tracker.end_run(handle, "FINISHED" if result.ok else "FAILED")
    else:
        tracker.end_run(handle)


def _is_dataclass(value: Any) -> bool:
    import dataclasses

    return dataclasses.is_dataclass(value) and not isinstance(value, type)


def start_launch(
    runner: JobRunner, request: RunRequest, *, label: str, command: str, ahead_of: str | None = None
) -> RunHandle | None:
    """Create the launch run of one logical run (before its first attempt) and start sampling.
    ``ahead_of``: a run started early for that check (see :meth:`JobRunner.start_lane`); it is
    nested under the session until the check takes it (:func:`adopt_launch`)."""
    tracker: Tracker | None = getattr(runner, "tracker", None)
    if tracker is None:
        return None
    job = runner.job_file.job
    check = ahead_of or (tracker.current_check.name if tracker.current_check else None)
    handle = tracker.start_run(
        label,
        parent=tracker.session if ahead_of else tracker.current_check or tracker.session,
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
    tracker.log_artifact(handle, runner.job_file.path, "job")
    tracker.start_sampling(handle)
    return handle


def adopt_launch(runner: JobRunner, handle: object) -> None:
    """Nest a launch run started ahead (:func:`start_launch` ``ahead_of``) under the check that
    takes it, the one running now."""
    tracker: Tracker | None = getattr(runner, "tracker", None)
    check = tracker.current_check if tracker is not None else None
    if tracker is None or check is None or not isinstance(handle, RunHandle):
        return
    tracker.set_tags(handle, lambda: {"mlflow.parentRunId": check.run_id} if check.run_id else {})


class LiveMetrics:
    """Streams a running attempt's metrics into its launch run (an ``on_metric`` callback of the
    launcher): every ``interval`` seconds, for each metric, the mean over the ranks of the
    latest step every rank has printed. MLflow's store costs about 1 ms of CPU per row, so the
    live view is thinned to keep the writer's CPU well under 1% of a core; after the attempt
    :func:`log_attempt` logs every row not streamed (the other steps, the per-rank rows), so the
    record is complete and no row is logged twice."""

    def __init__(self, tracker: Tracker, handle: RunHandle, world_size: int,
                 interval: float | None = None) -> None:
        self.tracker = tracker
        self.handle = handle
        self.world_size = world_size
        self.interval = LIVE_INTERVAL_S if interval is None else interval
        self.sent: set[tuple[str, int]] = set()
        self._pending: dict[tuple[str, int], dict[int, float]] = {}
        self._latest: dict[str, tuple[float, int]] = {}  # name -> (mean, step) not sent yet
        self._next = time.monotonic() + self.interval

    def on_metric(self, point: MetricPoint, launcher: Any) -> None:
        key = (point.name, point.step)
        if key in self.sent:
            return
        ranks = self._pending.setdefault(key, {})
        ranks.setdefault(point.rank, point.value)
        if len(ranks) >= self.world_size:
            del self._pending[key]
            latest = self._latest.get(point.name)
            if latest is None or point.step >= latest[1]:
                self._latest[point.name] = (sum(ranks.values()) / len(ranks), point.step)
        now = time.monotonic()
        if now >= self._next and self._latest:
            self._next = now + self.interval
            now_ms = int(time.time() * 1000)
            rows = [(name, mean, step, now_ms) for name, (mean, step) in self._latest.items()]
            self.sent.update((name, step) for name, _, step, _ in rows)
            self._latest.clear()
            self.tracker.log_metrics(self.handle, rows)


def launch_hooks(
    runner: JobRunner, handle: RunHandle | None, world_size: int, run_dir: Path
) -> tuple[dict[str, str], Callable[[MetricPoint, Any], None] | None]:
    """What one attempt of a tracked launch needs: the environment that lets
    :mod:`trainguard.tracking.track` in the ranks log into the launch run, and the live metric callback.

    The launch run is created by the writer thread: this waits at most ``LAUNCH_RUN_WAIT_S`` for
    it (never longer: a slow store must not stall the check). Past that the ranks get
    ``TRAINGUARD_MLFLOW_RUN_ID_FILE`` instead, a file the writer fills in once the run exists
    (rank 0's writer reads it off its training loop's path); the tag ``trainguard.run_id_env``
    records which way the id went (``env`` or ``file``)."""
    tracker: Tracker | None = getattr(runner, "tracker", None)
    if tracker is None or handle is None:
        return {}, None
    env = {TRACKING_URI_ENV: tracker.tracking_uri}
    if tracker.last_error is None:  # a store that is failing is not waited for at every launch
        handle.created.wait(LAUNCH_RUN_WAIT_S)
    with tracker._cond:
        run_id = handle.run_id
        if run_id is None:
            id_file = Path(run_dir) / "mlflow_run_id"
            handle.id_files.append(id_file)
    if run_id is None:
        id_file.parent.mkdir(parents=True, exist_ok=True)
    if run_id is not None:
        env[RUN_ID_ENV] = run_id
    else:
        env[RUN_ID_FILE_ENV] = str(id_file)
    tracker.set_tags(handle, {"trainguard.run_id_env": "env" if run_id else "file"})
    if runner.job_file.job.kind == "ray_train":
        return env, None  # the workers' designated writer streams the metrics (trainguard.raytrain.tracking)
    handle.live = LiveMetrics(tracker, handle, world_size)
    return env, handle.live.on_metric


def log_attempt(runner: JobRunner, handle: RunHandle | None, result: RunResult, attempt: int, *, final: bool) -> None:
    """Log one attempt's metrics (per rank and their mean, by step; what was not streamed live),
    outcome and rank logs; after the final attempt, the loss-curve plot of all attempts."""
    tracker: Tracker | None = getattr(runner, "tracker", None)
    if tracker is None or handle is None:
        return
    started_ms = int((time.time() - result.duration_s) * 1000)
    sent = handle.live.sent if handle.live is not None else set()
    handle.live = None
    rows = metric_rows(result.points, result.world_size, started_ms)
    if runner.job_file.job.kind == "ray_train":  # the workers' writer logged what it could: the rest
        from trainguard.raytrain.tracking import reconcile

        rows, writer_tags, note = reconcile(result, rows, handle.run_id)
        tracker.set_tags(handle, writer_tags)
        if note:
            tracker.warn(note)
    tracker.log_metrics(handle, [row for row in rows if (row[0], row[2]) not in sent])
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


def plot_metrics(
    history: Sequence[tuple[int, Sequence[MetricPoint]]], world_size: int, target: Path, *, title: str = ""
) -> Path | None:
    """Draw the loss curve(s) of a launch run into ``target`` (PNG): one panel per metric whose
    name contains ``loss`` (else the first metric), one line per attempt (and per rank when
    several). Returns None when there is nothing to draw. matplotlib is imported here (the
    writer thread calls it), through its object API: no pyplot, no global backend switch."""
    names = sorted({p.name for _, points in history for p in points})
    if not names:
        return None
    shown = [n for n in names if "loss" in n.lower()][:4] or names[:1]
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(7, 3.2 * len(shown)), dpi=100)
    FigureCanvasAgg(fig)
    for i, name in enumerate(shown):
        ax = fig.add_subplot(len(shown), 1, i + 1)
        for n, (attempt, points) in enumerate(history):
            by_rank: dict[int, dict[int, float]] = {}
            for p in points:
                if p.name == name:
                    by_rank.setdefault(p.rank, {})[p.step] = p.value
            for rank, values in sorted(by_rank.items()):
                steps = sorted(values)
                label = f"attempt {attempt}" + (f" rank {rank}" if world_size > 1 else "")
                # a colour per rank, a line style per attempt: a restarted attempt that re-runs
                # steps stays visible next to the one before it
                ax.plot(steps, [values[s] for s in steps], color=f"C{rank % 10}",
                        linestyle=("-", "--", ":", "-.")[(len(history) - 1 - n) % 4],
                        marker="." if len(steps) < 50 else None, linewidth=1.2, alpha=0.9, label=label)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("step")
        ax.set_ylabel(name)
        ax.grid(True, alpha=0.3)
        if len(history) > 1 or world_size > 1:
            ax.legend(fontsize="small")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    target.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(target)
    return target


def metric_rows(points: Sequence[MetricPoint], world_size: int, started_ms: int) -> list[tuple[str, float, int, int]]:
    """``(key, value, step, timestamp_ms)`` rows: ``name`` is the mean over the ranks that
    reported the step; with several ranks also ``name/rank{r}``."""
    per: dict[tuple[str, int], dict[int, MetricPoint]] = {}
    for p in points:
        per.setdefault((p.name, p.step), {})[p.rank] = p  # a re-run step's latest value wins
    rows: list[tuple[str, float, int, int]] = []
    for (name, step), ranks in per.items():
        latest = max(p.t for p in ranks.values())
        rows.append((name, sum(p.value for p in ranks.values()) / len(ranks), step, started_ms + int(latest * 1000)))
        if world_size > 1:
            rows.extend((f"{name}/rank{r}", p.value, step, started_ms + int(p.t * 1000)) for r, p in sorted(ranks.items()))
    return rows
