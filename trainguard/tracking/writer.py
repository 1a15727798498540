"""The background writer of :class:`~trainguard.tracking.Tracker`: one queue, one thread.

:class:`StoreWriter` owns the queue of operations and the thread that drains it into one MLflow
store: run creations first (a launch waits for its run), metrics batched for
``metric_interval`` seconds, transient failures (store unreachable or locked) retried in order
with backoff, permanent ones (:func:`trainguard._internal.mlflow_errors.is_permanent_error`) recorded
in ``errors``. Between writes it samples system metrics into the runs being sampled.

``mlflow`` is imported only by this thread (never by ``import trainguard`` or the plugin).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import threading
import time
import warnings
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from trainguard._internal.atomic import atomic_write_text, os_error_text, unwritable_reason
from trainguard._internal.locks import file_lock, store_lock
from trainguard._internal.logsafe import safe_logger_registry
from trainguard._internal.mlflow_errors import PermanentWriteError, is_permanent_error
from trainguard._internal.quiet import begin, busy, end, measuring, wait_while_measured
from trainguard.tracking.runs import LIVE_INTERVAL_S, RunHandle
from trainguard.tracking.store import EXPERIMENT
from trainguard.tracking.system import system_metrics

__all__ = [
    "CONNECT_TIMEOUT_S",
    "FLUSH_CAP_FACTOR",
    "HTTP_TIMEOUT_S",
    "METRIC_BATCH_S",
    "StoreWriter",
    "local_store_path",
    "store_unwritable",
]

#: MLflow's per-request limits for log_batch
_MAX_METRICS, _MAX_PARAMS, _MAX_TAGS = 1000, 100, 100
#: seconds metrics wait in the queue to be written together (one ``log_batch`` per interval while
#: a job runs, instead of one per printed line)
METRIC_BATCH_S = 2.0
#: per-request timeout for a tracking server (the writer retries on its own, so MLflow's retries
#: with backoff, which could block for minutes, are turned off unless the user set them)
HTTP_TIMEOUT_S = "5"
#: :meth:`StoreWriter.drain` waits for a store that keeps accepting writes at most this many
#: times its timeout (one that stops is given up on after one timeout without a write)
FLUSH_CAP_FACTOR = 6
#: seconds :meth:`StoreWriter.drain` waits for mlflow to be imported and the client created, before
#: the flush bound starts
CONNECT_TIMEOUT_S = 60.0


#: errnos that mean a local store cannot take writes until someone frees space or remounts
_DISK_ERRNOS = {errno.ENOSPC, errno.EROFS, errno.EDQUOT, errno.EACCES, errno.EPERM, errno.ENOTDIR}
#: what sqlite says for the same, and the errno it stands for (None: ask the file system)
_SQLITE_DISK_ERRORS = {"database or disk is full": errno.ENOSPC, "readonly database": None,
                       "unable to open database file": None, "disk i/o error": None}


def local_store_path(tracking_uri: str) -> Path | None:
    """The file of a local sqlite store (``sqlite:///path``); None for a server or others."""
    if tracking_uri.startswith("sqlite:///"):
        return Path(tracking_uri[len("sqlite:///"):])
    return None


def store_unwritable(exc: BaseException, tracking_uri: str) -> str | None:
    """Why a local store cannot be written, when ``exc`` (or what it wraps) is a full disk, a
    read-only file system or a refused file: the errno in words (``No space left on device
    (ENOSPC)``). None for anything else (a server, a locked database: retried)."""
    db = local_store_path(tracking_uri)
    if db is None:
        return None
    seen: set[int] = set()
    cause: BaseException | None = exc
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        if isinstance(cause, UnicodeEncodeError):
            # a path of bytes that are not UTF-8 (a directory named by another system): the
            # store's URI cannot name it, now or later (retried, it stalled the end by 70 s)
            return (f"its path {str(db)!r} is not UTF-8, which an MLflow URI cannot hold; set "
                    "MLFLOW_TRACKING_URI to a store whose path is, or TRAINGUARD_TRACKING=off")
        if isinstance(cause, OSError) and cause.errno in _DISK_ERRNOS:
            if cause.filename and not _within(Path(os.fsdecode(cause.filename)), db.parent):
                return None  # another file (a run directory's): not the store
            return os_error_text(cause)
        text = str(cause).lower()
        for phrase, code in _SQLITE_DISK_ERRORS.items():
            if phrase in text:
                if code is not None:
                    return os_error_text(OSError(code, os.strerror(code)))
                return _disk_state(db) or (f"sqlite says {phrase!r}" if phrase != "disk i/o error"
                                           else None)
        cause = getattr(cause, "orig", None) or cause.__cause__ or cause.__context__
    return None


def _within(path: Path, directory: Path) -> bool:
    try:
        return Path(os.path.abspath(path)).is_relative_to(os.path.abspath(directory))
    except (TypeError, ValueError):
        return False


def _disk_state(db: Path) -> str | None:
    # sqlite names no errno: a full or read-only file system under the store says which
    reason = unwritable_reason(db, example="mlflow.db")
    if reason is not None:
        return reason
    with contextlib.suppress(OSError):
        if os.statvfs(db.parent).f_bavail == 0:
            return os_error_text(OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)))
    return None


@dataclass(eq=False)
class _Op:
    kind: str  # create | params | tags | metrics | artifact | text | plot | end
    handle: RunHandle
    payload: Any
    what: str
    queued_at: float = field(default_factory=time.monotonic)


class _Pending(Exception):
    """An operation that cannot be done yet (retried)."""


class StoreWriter:
    """The queue of writes to one tracking store and the thread that drains it (the base of
    :class:`~trainguard.tracking.Tracker`, which adds the enqueueing API and the bounded flush).

    ``errors`` collects writes that failed for good, ``last_error`` the latest failure of any kind.
    """

    def __init__(
        self,
        tracking_uri: str,
        *,
        artifact_location: str | None = None,
        experiment: str = EXPERIMENT,
        sample_interval: float = LIVE_INTERVAL_S,
        metric_interval: float = METRIC_BATCH_S,
    ) -> None:
        self.tracking_uri = tracking_uri
        self.artifact_location = artifact_location
        self.experiment = experiment
        self.sample_interval = sample_interval
        self.metric_interval = metric_interval
        self.errors: list[str] = []
        self.last_error: str | None = None
        #: why a local store cannot be written (full disk, read-only, ...): tracking stopped
        self.unwritable: str | None = None
        #: writes dropped after the store was found unwritable
        self.dropped = 0
        self._ops: deque[_Op] = deque()
        #: queued ops by kind ("create", "metrics", other kinds under "other"), so choosing the
        #: next op does not scan the queue
        self._counts: dict[str, int] = {"create": 0, "metrics": 0, "other": 0}
        self._create_token: object | None = None
        self._failing = False  # the last write failed and is being retried
        self._connect_error: Exception | None = None
        self._cond = threading.Condition()
        self._closing = False
        self._abandon = False
        self._client: Any = None
        self._experiment_id: str | None = None
        self._sampled: list[RunHandle] = []
        self._progress_at = time.monotonic()
        if tracking_uri.startswith(("http://", "https://")):
            os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
            os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", HTTP_TIMEOUT_S)
            os.environ.setdefault("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")  # per ended run
        safe_logger_registry()  # mlflow's imports in the thread add loggers
        self._thread = threading.Thread(target=self._loop, name="trainguard-tracking", daemon=True)
        self._thread.start()

    # -- enqueueing (never blocks) ------------------------------------------------------------

    def _put(self, kind: str, handle: RunHandle, payload: Any, what: str) -> None:
        """Queue one write (never blocks); ``what`` names it in errors and warnings."""
        op = _Op(kind, handle, payload, what)
        with self._cond:
            if self.unwritable is not None:  # nothing more is kept in memory for a dead store
                self.dropped += 1
                return
            if self._closing:
                self.errors.append(f"{op.what}: logged after the tracker was closed")
                return
            self._ops.append(op)
            self._count(op, 1)
            if op.kind != "metrics" or self._counts["metrics"] == 1:
                # further metrics wait to be batched: the writer wakes for the first one only,
                # to set its timer
                self._cond.notify()

    def run_id_or_file(self, handle: RunHandle, id_file: Path) -> str | None:
        """``handle``'s run id when the run exists; else None, and the writer will write the id
        into ``id_file`` once it does (a launch that could not wait for its run hands the ranks
        that file instead)."""
        with self._cond:
            run_id = handle.run_id
            if run_id is None:
                handle.id_files.append(id_file)
        return run_id

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
    def drain(self, timeout: float) -> tuple[list[str], float]:
        """Stop taking writes and wait for the queue to empty, bounded: while writes keep
        completing (none for ``timeout`` seconds: give up), at most ``FLUSH_CAP_FACTOR`` times
        ``timeout``, after up to ``CONNECT_TIMEOUT_S`` for mlflow's import and the client. Joins
        the thread; returns what was dropped unwritten and the seconds it took."""
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
            self._thread.join(float(os.environ.get("MLFLOW_HTTP_REQUEST_TIMEOUT", HTTP_TIMEOUT_S)) + 5)
        with self._cond:
            unwritten = [op.what for op in self._ops]
            self._ops.clear()
            self._counts = dict.fromkeys(self._counts, 0)
            self._creating(False)
        return unwritten, time.monotonic() - started

    # -- the writer thread --------------------------------------------------------------------

    def _loop(self) -> None:
        # importing mlflow and creating the client (a sqlite store's migrations) is the heaviest
        # work of this thread: done at once, at the process's own priority, so that it overlaps
        # the first (untimed) run and a run whose lines are timed waits for it (a few seconds)
        # instead of running beside it. At nice 10 on a loaded machine it took minutes, holding
        # the GIL whenever the scheduler preempted it: every other thread of this process
        # waited with it, the launcher's line readers included.
        with busy("tracking: importing mlflow"):
            try:
                self._connect()
            except Exception as exc:  # raised by the first write, classified there
                self._connect_error = exc
        # then low CPU priority for this thread (Linux: per thread): writes must not take cores
        # from the ranks; while a timed run is in flight it does not write at all
        with contextlib.suppress(OSError, AttributeError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
        delay = 0.2
        next_sample = time.monotonic()
        while True:
            done, op = self._wait_for_op(next_sample)
            if done:
                return
            if self._held(op):
                continue
            if time.monotonic() >= next_sample:
                next_sample = time.monotonic() + self.sample_interval
                self._sample()
            if op is None:
                continue
            # a retry against a failing store (a hung server: 5 s a request) is not waited for
            work = busy(f"tracking: {op.what}") if not self._failing else contextlib.nullcontext()
            try:
                with work:
                    self._apply(op)
            except Exception as exc:
                text = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]
                self.last_error = text
                unwritable = store_unwritable(exc, self.tracking_uri)
                if unwritable is not None:
                    self._stop_on_unwritable(unwritable)
                    return
                if is_permanent_error(exc):
                    self.errors.append(f"{op.what}: {text}")
                    if op.kind == "create":
                        op.handle.failed = text
                        op.handle.created.set()
                else:
                    with self._cond:
                        self._failing = True  # a window does not wait on a store that fails
                        self._creating(False)
                        if not self._abandon:
                            self._cond.wait(delay)
                    delay = min(delay * 2, 2.0)
                    continue
            delay = 0.2
            with self._cond:
                self._failing = False
                for i, queued in enumerate(self._ops):
                    if queued is op:
                        del self._ops[i]
                        self._count(op, -1)
                        break
                self._progress_at = time.monotonic()

    def _wait_for_op(self, next_sample: float) -> tuple[bool, _Op | None]:
        """(whether the thread is done, the op to write next): None when there is none yet by
        the next system sample or the oldest queued metrics' batch time."""
        with self._cond:
            if self._abandon or (self._closing and not self._ops):
                return True, None
            op = self._next_op()
            if op is None:
                wake = next_sample
                if self._ops:  # young metrics only: wake when the oldest is due
                    wake = min(wake, self._ops[0].queued_at + self.metric_interval)
                if wake > time.monotonic():
                    self._cond.wait(wake - time.monotonic())
                op = self._next_op()
            return False, op

    def _held(self, op: _Op | None) -> bool:
        """Whether ``op`` (and the system sample) waits, having waited a while: a run whose lines
        are timed is in flight (:mod:`trainguard._internal.quiet`). A run's creation is not held
        (its launch waits for it), nor is anything once the tracker closes."""
        if (op is not None and op.kind == "create") or self._closing or not measuring():
            return False
        return not wait_while_measured(0.5)

    def _stop_on_unwritable(self, why: str) -> None:
        """A local store on a full or read-only disk: stop writing (the queue is dropped and
        counted, nothing waits for a run to be created) instead of retrying until the flush
        bound; :meth:`Tracker.close` says so once."""
        with self._cond:
            self.unwritable = why
            for op in self._ops:
                if op.kind == "create":
                    op.handle.failed = f"the store cannot be written: {why}"
                    op.handle.created.set()
            self._creating(False)
            self._cond.notify_all()

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
        if kind == "create":
            self._creating(self._counts["create"] > 0)

    def _creating(self, queued: bool) -> None:
        """Run creations queued or not (lock held): a run whose lines are timed lets them through
        (its launch waits for its run), so it waits for them before it starts instead
        (:mod:`trainguard._internal.quiet`; a creation took 0.8-2.8 s on a loaded machine). Not
        while the store fails: a store that is down would hold every timed run for the window's
        whole bound."""
        if queued and self._create_token is None and not self._failing:
            self._create_token = begin("tracking: creating runs")
        elif not queued and self._create_token is not None:
            end(self._create_token)
            self._create_token = None

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

        with store_lock(self.tracking_uri):
            # creating the client creates (migrates) a sqlite schema: once, under the lock
            client = MlflowClient(self.tracking_uri)
            self._client = client
        return client

    def _experiment(self) -> str:
        if self._experiment_id is None:
            client = self._connect()
            with store_lock(self.tracking_uri):
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
        if self._connect_error is not None:
            # the connection made at start failed: that error (a full disk mid-migration, say)
            # is this write's, as when the first write connected; a retry connects again
            error, self._connect_error = self._connect_error, None
            if self._client is None:  # (a client handed in since is used instead)
                raise error
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
        write = self._writers.get(op.kind)
        if write is not None:
            write(self, client, op)

    def _write_create(self, client: Any, op: _Op) -> None:
        handle = op.handle
        tags = dict(op.payload)
        if handle.parent is not None:
            if handle.parent.run_id is None:
                raise PermanentWriteError(f"parent run {handle.parent.name!r} was not created")
            tags["mlflow.parentRunId"] = handle.parent.run_id
        if handle.shared is not None:
            self._create_shared(handle, tags)
        else:
            run = client.create_run(self._experiment(), run_name=handle.name, tags=tags)
            self._created(handle, run.info.run_id)

    def _write_params(self, client: Any, op: _Op) -> None:
        from mlflow.entities import Param

        items = list(op.payload.items())
        while items:
            client.log_batch(op.handle.run_id, params=[Param(k, v) for k, v in items[:_MAX_PARAMS]])
            del items[:_MAX_PARAMS]
            op.payload = dict(items)

    def _write_tags(self, client: Any, op: _Op) -> None:
        from mlflow.entities import RunTag

        if callable(op.payload):
            op.payload = dict(op.payload())
        items = [(k, str(v)) for k, v in op.payload.items()]
        while items:
            client.log_batch(op.handle.run_id, tags=[RunTag(k, v) for k, v in items[:_MAX_TAGS]])
            del items[:_MAX_TAGS]
            op.payload = dict(items)

    def _write_metrics(self, client: Any, op: _Op) -> None:
        from mlflow.entities import Metric

        while op.payload:
            chunk = op.payload[:_MAX_METRICS]
            client.log_batch(op.handle.run_id, metrics=[Metric(k, float(v), ts, step) for k, v, step, ts in chunk])
            del op.payload[:_MAX_METRICS]  # sent: a retry must not send it twice

    def _write_metrics_once(self, client: Any, op: _Op) -> None:
        """Metrics the run does not hold yet (the same key at the same step): a write that may
        repeat one an earlier writer of the run made."""
        keys = sorted({row[0] for row in op.payload})
        held = {(key, m.step) for key in keys for m in client.get_metric_history(op.handle.run_id, key)}
        op.payload = [row for row in op.payload if (row[0], row[2]) not in held]
        self._write_metrics(client, op)

    def _write_artifact(self, client: Any, op: _Op) -> None:
        path, artifact_path = op.payload
        if Path(path).exists():
            client.log_artifact(op.handle.run_id, path, artifact_path)

    def _write_text(self, client: Any, op: _Op) -> None:
        text, artifact_file = op.payload
        if callable(text):
            op.payload = (text := text(), artifact_file)
        client.log_text(op.handle.run_id, text, artifact_file)

    def _write_plot(self, client: Any, op: _Op) -> None:
        make, artifact_path = op.payload
        try:
            made = make()
        except OSError as exc:  # the run directory's disk, not the store: drawn never
            raise PermanentWriteError(f"the plot could not be written: {os_error_text(exc)}") from None
        op.payload = (lambda: made, artifact_path)  # a retry uploads, it does not redraw
        if made is not None and Path(made).exists():
            client.log_artifact(op.handle.run_id, str(made), artifact_path)

    def _write_end(self, client: Any, op: _Op) -> None:
        client.set_terminated(op.handle.run_id, op.payload)

    #: how :meth:`_apply` writes each kind of op (a kind not named here writes nothing)
    _writers: ClassVar[dict[str, Callable[[StoreWriter, Any, _Op], None]]] = {
        "create": _write_create, "params": _write_params, "tags": _write_tags,
        "metrics": _write_metrics, "metrics_once": _write_metrics_once, "artifact": _write_artifact,
        "text": _write_text, "plot": _write_plot, "end": _write_end,
    }

    def _created(self, handle: RunHandle, run_id: str) -> None:
        """Publish a new run's id: to the handle, and to the files ranks read it from."""
        with self._cond:
            handle.run_id = run_id
            files = list(handle.id_files)
        handle.created.set()
        for path in files:
            with contextlib.suppress(OSError):
                atomic_write_text(path, run_id)

    def _create_shared(self, handle: RunHandle, tags: dict[str, str]) -> None:
        """Create the run, or join the one another process already created for this store."""
        assert handle.shared is not None
        registry = Path(handle.shared)
        with file_lock(registry.with_name(registry.name + ".lock")):
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
            atomic_write_text(registry, json.dumps(known, indent=2))
        self._created(handle, run.info.run_id)

    def _sample(self) -> None:
        with self._cond:
            handles = [h for h in self._sampled if h.sampling_since is not None]
        if not handles:
            return
        now_ms = int(time.time() * 1000)
        values = system_metrics()
        for h in handles:
            step = int(time.monotonic() - (h.sampling_since or 0.0))
            with self._cond:
                if self._closing:
                    return
                op = _Op("metrics", h, [(k, v, step, now_ms) for k, v in values.items()],
                         f"system metrics of {h.name!r}")
                self._ops.append(op)
                self._count(op, 1)
