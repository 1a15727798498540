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

from trainguard._version import __version__
from trainguard.errors import ConfigError

if TYPE_CHECKING:  # pragma: no cover
    from trainguard.config import CheckSpec, JobFile
    from trainguard.launch import MetricPoint, RunResult
    from trainguard.report import CheckResult
    from trainguard.runner import JobRunner, RunRequest
    from trainguard.settings import Settings

__all__ = [
    "EXPERIMENT",
    "FlushResult",
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
) -> Tracker | None:
    """A started :class:`Tracker` for ``job_file`` with its session run created, or None when
    tracking is off. ``MLFLOW_TRACKING_URI`` (when set) wins over the default store."""
    if not tracking_enabled(settings.tracking):
        return None
    uri, artifacts = store_for(job_file, environ)
    tracker = Tracker(uri, artifact_location=artifacts, warn=warn)
    tracker.session = tracker.start_run(
        run_name,
        tags={"trainguard.job": job_file.job.name, "trainguard.kind": "session", **(tags or {})},
        params={"job_file": str(job_file.path), "job": job_file.job.name},
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


@dataclass
class _Op:
    kind: str  # create | params | tags | metrics | artifact | text | end
    handle: RunHandle
    payload: Any
    what: str


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
        sample_interval: float = 1.0,
        warn: Callable[[str], None] | None = None,
    ) -> None:
        self.tracking_uri = tracking_uri
        self.artifact_location = artifact_location
        self.experiment = experiment
        self.flush_timeout = FLUSH_TIMEOUT_S if flush_timeout is None else flush_timeout
        self.sample_interval = sample_interval
        self.warn = warn or (lambda text: warnings.warn(text, TrackingWarning, stacklevel=3))
        self.session: RunHandle | None = None
        self.session_failed = False
        self.current_check: RunHandle | None = None
        self.errors: list[str] = []
        self.last_error: str | None = None
        self.flush_result: FlushResult | None = None
        self._ops: deque[_Op] = deque()
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
            self._cond.notify()

    def start_run(
        self,
        name: str,
        *,
        parent: RunHandle | None = None,
        tags: Mapping[str, str] | None = None,
        params: Mapping[str, Any] | None = None,
    ) -> RunHandle:
        """Create a run (nested under ``parent``), with tags and params; returns its handle."""
        handle = RunHandle(name, parent)
        all_tags = {"trainguard.version": __version__, **(tags or {})}
        self._put(_Op("create", handle, all_tags, f"run {name!r}"))
        if params:
            self.log_params(handle, params)
        return handle

    def attach(self, run_id: str) -> RunHandle:
        """A handle on an existing run (the ``trainguard.track`` helper logs into one)."""
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
        if self.session is not None:
            self.end_run(self.session, "FAILED" if self.session_failed else "FINISHED")
        timeout = self.flush_timeout if timeout is None else timeout
        started = time.monotonic()
        with self._cond:
            self._sampled.clear()
            self._closing = True
            self._cond.notify_all()
        # importing mlflow (seconds on a loaded machine) is local work, not the store's: the
        # bound starts once the client exists
        connect_deadline = started + CONNECT_TIMEOUT_S
        while self._client is None and self._thread.is_alive() and time.monotonic() < connect_deadline:
            self._thread.join(0.05)
        # the writer ran at low priority so as not to slow the ranks; now the run is over and
        # the caller waits on it (raising a priority needs privileges: best effort)
        if self._thread.native_id:
            with contextlib.suppress(OSError, AttributeError):
                os.setpriority(os.PRIO_PROCESS, self._thread.native_id, 0)
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
            op = None
            with self._cond:
                if self._abandon or (self._closing and not self._ops):
                    return
                if not self._ops:
                    self._cond.wait(max(0.0, next_sample - time.monotonic()) or self.sample_interval)
                if self._ops:
                    op = self._ops[0]
                    if op.kind == "metrics":
                        self._merge_metrics(op)
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
                if self._ops and self._ops[0] is op:
                    self._ops.popleft()
                self._progress_at = time.monotonic()

    def _merge_metrics(self, head: _Op) -> None:
        """Fold the metric ops queued right behind ``head`` (same run) into it (lock held)."""
        while len(self._ops) > 1 and len(head.payload) < _MAX_METRICS:
            nxt = self._ops[1]
            if nxt.kind != "metrics" or nxt.handle is not head.handle:
                break
            head.payload.extend(nxt.payload)
            del self._ops[1]

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
        if op.kind != "create" and handle.run_id is None:
            self.errors.append(f"{op.what}: its run was not created ({handle.failed})")
            return
        client = self._connect()
        if op.kind == "create":
            tags = dict(op.payload)
            if handle.parent is not None:
                if handle.parent.run_id is None:
                    raise _Permanent(f"parent run {handle.parent.name!r} was not created")
                tags["mlflow.parentRunId"] = handle.parent.run_id
            run = client.create_run(self._experiment(), run_name=handle.name, tags=tags)
            handle.run_id = run.info.run_id
            handle.created.set()
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
        elif op.kind == "end":
            client.set_terminated(handle.run_id, op.payload)

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
                self._ops.append(_Op("metrics", h, [(k, v, step, now_ms) for k, v in values.items()],
                                     f"system metrics of {h.name!r}"))


class _Permanent(Exception):
    """An operation that can never succeed (retrying would not help)."""


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
    with open(db.with_name(db.name + ".lock"), "a+") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


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


def _gpu_metrics() -> dict[str, float]:
    try:
        import pynvml  # type: ignore[import-not-found,unused-ignore]

        pynvml.nvmlInit()
    except Exception:
        return {}
    out: dict[str, float] = {}
    try:
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            with contextlib.suppress(Exception):
                out[f"system/gpu{i}/utilization_percent"] = float(pynvml.nvmlDeviceGetUtilizationRates(h).gpu)
            with contextlib.suppress(Exception):
                out[f"system/gpu{i}/memory_mb"] = pynvml.nvmlDeviceGetMemoryInfo(h).used / 2**20
            with contextlib.suppress(Exception):
                out[f"system/gpu{i}/power_w"] = pynvml.nvmlDeviceGetPowerUsage(h) / 1000.0
            with contextlib.suppress(Exception):
                out[f"system/gpu{i}/temperature_c"] = float(pynvml.nvmlDeviceGetTemperature(h, 0))
    finally:
        with contextlib.suppress(Exception):
            pynvml.nvmlShutdown()
    return out


def git_tags(directory: Path, timeout: float = 5.0) -> dict[str, str]:
    """``git.commit`` and ``git.dirty`` of the repository holding ``directory`` (empty when it is
    not in one or git is missing)."""

    def git(*args: str) -> str | None:
        try:
            proc = subprocess.run(
                ["git", "-C", str(directory), *args], capture_output=True, text=True, timeout=timeout
            )
        except (OSError, subprocess.TimeoutExpired):
            return None
        return proc.stdout if proc.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    if commit is None:
        return {}
    tags = {"git.commit": commit.strip(), "mlflow.source.git.commit": commit.strip()}
    status = git("status", "--porcelain")
    if status is not None:
        tags["git.dirty"] = "true" if status.strip() else "false"
    return tags


def environment_snapshot() -> dict[str, Any]:
    """Python, torch, CUDA, NCCL, GPU models and installed packages. torch is not imported for
    this (its version comes from package metadata; CUDA and NCCL versions only when torch is
    already imported in this process); GPU models come from pynvml when present."""
    import importlib.metadata as md

    packages = sorted(
        {f"{d.metadata['Name']}=={d.version}" for d in md.distributions() if d.metadata["Name"]},
        key=str.lower,
    )
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
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            snap["gpus"] = [
                str(pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(i)))
                for i in range(pynvml.nvmlDeviceGetCount())
            ]
            snap["cuda_driver"] = pynvml.nvmlSystemGetCudaDriverVersion()
        finally:
            pynvml.nvmlShutdown()
    except Exception:
        pass
    return snap


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
        if not result.ok:
            tracker.session_failed = True
        tracker.end_run(handle, "FINISHED" if result.ok else "FAILED")
    else:
        tracker.end_run(handle)


def _is_dataclass(value: Any) -> bool:
    import dataclasses

    return dataclasses.is_dataclass(value) and not isinstance(value, type)


def start_launch(runner: JobRunner, request: RunRequest, *, label: str, command: str) -> RunHandle | None:
    """Create the launch run of one logical run (before its first attempt) and start sampling."""
    tracker: Tracker | None = getattr(runner, "tracker", None)
    if tracker is None:
        return None
    job = runner.job_file.job
    handle = tracker.start_run(
        label,
        parent=tracker.current_check or tracker.session,
        tags={"trainguard.kind": "launch", "trainguard.job": job.name,
              **({"trainguard.check": tracker.current_check.name} if tracker.current_check else {})},
        params={
            "job": job.name,
            "command": command,
            "world_size": request.world_size,
            "seed": request.seed,
            "steps": request.steps,
            "args": " ".join(request.args) or None,
            "check": tracker.current_check.name if tracker.current_check else None,
        },
    )
    tracker.log_artifact(handle, runner.job_file.path, "job")
    tracker.start_sampling(handle)
    return handle


def log_attempt(runner: JobRunner, handle: RunHandle | None, result: RunResult, attempt: int, *, final: bool) -> None:
    """Log one attempt's metrics (per rank and their mean, by step), outcome and rank logs."""
    tracker: Tracker | None = getattr(runner, "tracker", None)
    if tracker is None or handle is None:
        return
    started_ms = int((time.time() - result.duration_s) * 1000)
    tracker.log_metrics(handle, metric_rows(result.points, result.world_size, started_ms))
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
        tracker.end_run(handle, "FINISHED" if result.ok else "FAILED")


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
