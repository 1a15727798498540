"""MLflow tracking from Ray Train workers: one designated writer per fit, batched, never blocking.

MLflow's fluent API keeps its active run inside the process that started it, so the Ray workers
of a fit cannot log to trainguard's launch run through it. Instead the run id travels to them:
trainguard hands the driver ``TRAINGUARD_MLFLOW_RUN_ID`` (or ``TRAINGUARD_MLFLOW_RUN_ID_FILE``)
and ``TRAINGUARD_MLFLOW_TRACKING_URI``; the driver passes them to every worker through the
runtime env (:func:`worker_env`); in each worker :func:`writer_from_env` makes a
:class:`WorkerWriter` on world rank 0 only -- the designated writer -- and nothing elsewhere.

The writer logs every numeric key of every ``ray.train.report`` (not only ``job.metrics``) at the
reported step, with :class:`mlflow.MlflowClient` (not the fluent API): rows wait in a bounded
queue and a background thread writes them with ``log_batch`` every ``flush_interval`` seconds
(and at once when 1000 are waiting), retrying while the store is unreachable. ``report`` only
enqueues: a slow or dead store never blocks or fails training. Rows that cannot be written (the
queue is full, the store is down at the end, the run does not exist) are counted, a warning is
printed once, and the count goes into the summary.

**One row per step, not two.** trainguard's launcher also reads the report lines and used to log
them to the launch run after the attempt. For a ``ray_train`` launch the writer is the source:
after every write it records which steps (and keys) it wrote in ``<run_dir>/ray_tracking.json``
(:data:`SUMMARY_FILE`, also printed as a ``trainguard-tracking`` line on stderr at the end), and
the launcher logs only the rows of the steps the writer did not write (:func:`reconcile`): none
when the writer wrote everything, all of them when there was no writer (its store unreachable
from the workers, a sqlite store on another machine, mlflow missing in the workers). A writer
stops writing as soon as its driver has exited (a killed run), so the launcher's view after the
run is final.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import sys
import threading
import time
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from trainguard._internal import envvars
from trainguard._internal.atomic import atomic_write_text
from trainguard._internal.envvars import MLFLOW_RUN_ID, MLFLOW_RUN_ID_FILE, MLFLOW_TRACKING_URI
from trainguard._internal.locks import store_lock
from trainguard._internal.mlflow_errors import is_permanent_error
from trainguard._internal.pids import pid_alive

if TYPE_CHECKING:  # pragma: no cover
    from trainguard.launch import RunResult

__all__ = [
    "DRIVER_ENV",
    "SUMMARY_FILE",
    "SUMMARY_PREFIX",
    "WorkerSummary",
    "WorkerWriter",
    "read_summary",
    "reconcile",
    "worker_env",
    "writer_from_env",
]

#: the file (in the launch's run directory) where the writer records what it wrote
SUMMARY_FILE = "ray_tracking.json"
#: the stderr line the writer prints when it closes
SUMMARY_PREFIX = "trainguard-tracking"
#: ``host:pid`` of the driver, set by the driver for its workers (a writer stops once it exited)
DRIVER_ENV = envvars.RAY_DRIVER
#: the environment the driver passes on to every worker (tracking and the run directory)
WORKER_ENV_VARS = (
    MLFLOW_RUN_ID,
    MLFLOW_RUN_ID_FILE,
    MLFLOW_TRACKING_URI,
    "TRAINGUARD_TRACKING",
    envvars.RUN_DIR,
    "MLFLOW_TRACKING_URI",
)
#: seconds rows wait to be written together; MLflow's sqlite store costs ~10 ms per request
FLUSH_INTERVAL_S = 2.0
#: seconds :meth:`WorkerWriter.close` waits for the last rows at the end of the function
CLOSE_TIMEOUT_S = 10.0
#: rows queued at most; a report beyond it is dropped (counted), never waited for
MAX_QUEUED_ROWS = 50_000
_BATCH = 1000  # MLflow's per-request limit of metrics in log_batch
_NAME = re.compile(r"^[\w\-. /:]{1,250}$")  # what every MLflow store accepts as a metric key


def worker_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """What the driver adds to its workers' ``runtime_env`` env_vars: the tracking variables it
    was given and :data:`DRIVER_ENV` (this host and pid)."""
    environ = os.environ if environ is None else environ
    env = {name: environ[name] for name in WORKER_ENV_VARS if environ.get(name)}
    env[DRIVER_ENV] = f"{socket.gethostname()}:{os.getpid()}"
    return env


def writer_from_env(rank: int, environ: Mapping[str, str] | None = None) -> WorkerWriter | None:
    """The designated writer for this worker, or None: on world ranks other than 0, with
    ``TRAINGUARD_TRACKING=off``, without a run id (or run-id file), or without mlflow."""
    environ = os.environ if environ is None else environ
    if rank != 0 or environ.get("TRAINGUARD_TRACKING", "").strip().lower() == "off":
        return None
    run_id = environ.get(MLFLOW_RUN_ID) or None
    id_file = None if run_id else environ.get(MLFLOW_RUN_ID_FILE) or None
    if run_id is None and id_file is None:
        return None
    import importlib.util

    if importlib.util.find_spec("mlflow") is None:
        print(f"{SUMMARY_PREFIX}: mlflow is not installed in the Ray workers; the launcher logs "
              "the reported metrics instead", file=sys.stderr, flush=True)
        return None
    uri = (environ.get(MLFLOW_TRACKING_URI) or environ.get("MLFLOW_TRACKING_URI")
           or "sqlite:///.trainguard/mlflow.db")
    run_dir = environ.get(envvars.RUN_DIR)
    return WorkerWriter(
        uri, run_id=run_id, run_id_file=id_file,
        summary_path=Path(run_dir) / SUMMARY_FILE if run_dir else None,
        driver=environ.get(DRIVER_ENV),
    )


@dataclass
class WorkerSummary:
    """What a designated writer did (the JSON of :data:`SUMMARY_FILE`)."""

    run_id: str | None = None
    tracking_uri: str = ""
    written_rows: int = 0
    dropped_rows: int = 0
    written_steps: set[int] = field(default_factory=set)
    dropped_steps: set[int] = field(default_factory=set)
    keys: set[str] = field(default_factory=set)
    closed: bool = False
    reason: str = ""
    writers: int = 1  # several when Ray Train restarted the workers inside one fit
    requests: int = 0  # log_batch requests made (the writer's overhead, with write_s and cpu_s)
    write_s: float = 0.0  # wall seconds in log_batch (waiting on the store included)
    cpu_s: float = 0.0  # CPU seconds of the writer thread (importing mlflow included)

    def to_dict(self) -> dict[str, Any]:
        return {
            "run_id": self.run_id, "tracking_uri": self.tracking_uri,
            "written_rows": self.written_rows, "dropped_rows": self.dropped_rows,
            "written_steps": _ranges(self.written_steps), "dropped_steps": _ranges(self.dropped_steps),
            "keys": sorted(self.keys), "closed": self.closed, "reason": self.reason,
            "writers": self.writers, "requests": self.requests, "write_s": round(self.write_s, 3),
            "cpu_s": round(self.cpu_s, 3),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> WorkerSummary:
        return cls(
            run_id=data.get("run_id"), tracking_uri=str(data.get("tracking_uri", "")),
            written_rows=int(data.get("written_rows", 0)), dropped_rows=int(data.get("dropped_rows", 0)),
            written_steps=_unranges(data.get("written_steps", [])),
            dropped_steps=_unranges(data.get("dropped_steps", [])),
            keys=set(data.get("keys", [])), closed=bool(data.get("closed", False)),
            reason=str(data.get("reason", "")), writers=int(data.get("writers", 1)),
            requests=int(data.get("requests", 0)), write_s=float(data.get("write_s", 0.0)),
            cpu_s=float(data.get("cpu_s", 0.0)),
        )

    def line(self) -> str:
        """The one-line form printed on stderr (read when the summary file is not reachable)."""
        return (f"{SUMMARY_PREFIX} run={self.run_id or '-'} written={self.written_rows} "
                f"dropped={self.dropped_rows} steps={_range_text(self.written_steps) or '-'} "
                f"keys={','.join(sorted(self.keys)) or '-'}")


def _ranges(values: Iterable[int]) -> list[list[int]]:
    out: list[list[int]] = []
    for v in sorted(set(values)):
        if out and v == out[-1][1] + 1:
            out[-1][1] = v
        else:
            out.append([v, v])
    return out


def _unranges(ranges: Iterable[Sequence[int]]) -> set[int]:
    return {v for a, b in ranges for v in range(int(a), int(b) + 1)}


def _range_text(values: Iterable[int]) -> str:
    return ",".join(f"{a}" if a == b else f"{a}-{b}" for a, b in _ranges(values))


class WorkerWriter:
    """Writes reported metrics to one MLflow run from a background thread (see the module doc).

    Args:
        tracking_uri: the store (``TRAINGUARD_MLFLOW_TRACKING_URI``).
        run_id: the run to log into; or ``run_id_file``, a file that holds it once it exists.
        summary_path: where to record what was written (the launcher reads it).
        flush_interval: seconds rows wait to be written in one batch.
        max_rows: rows queued at most; reports beyond it are dropped and counted.
        driver: ``host:pid`` of the Ray driver; the writer stops writing once it has exited.
        out: where the one warning and the closing summary line go (default stderr).
    """

    # keyword-only constructor, documented above: its options are its parameters (pyproject.toml, PLR0913)
    def __init__(  # noqa: PLR0913
        self,
        tracking_uri: str,
        *,
        run_id: str | None = None,
        run_id_file: str | os.PathLike[str] | None = None,
        summary_path: str | os.PathLike[str] | None = None,
        flush_interval: float = FLUSH_INTERVAL_S,
        max_rows: int = MAX_QUEUED_ROWS,
        driver: str | None = None,
        out: IO[str] | None = None,
    ) -> None:
        if run_id is None and run_id_file is None:
            raise ValueError("WorkerWriter needs run_id or run_id_file")
        self.tracking_uri = tracking_uri
        self.run_id = run_id
        self.run_id_file = Path(run_id_file) if run_id_file is not None else None
        self.summary_path = Path(summary_path) if summary_path is not None else None
        self.flush_interval = flush_interval
        self.max_rows = max_rows
        self.out = out
        self.summary = WorkerSummary(run_id=run_id, tracking_uri=tracking_uri)
        self._merge_previous()
        self.last_error: str | None = None
        self._driver = _parse_driver(driver)
        self._pending: deque[tuple[int, list[tuple[str, float, int]]]] = deque()
        self._pending_rows = 0
        self._cond = threading.Condition()
        self._closing = False
        self._stopped: str | None = None  # why the writer gave up (nothing more is written)
        self._deadline: float | None = None
        self._warned = False
        self._client: Any = None
        if tracking_uri.startswith(("http://", "https://")):
            # the thread retries on its own: MLflow's own retries with backoff could hold one
            # request for minutes
            os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
            os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")
        reason = self._local_store_elsewhere()
        if reason:
            self._stopped = reason
        self._thread = threading.Thread(target=self._loop, name="trainguard-ray-tracking", daemon=True)
        self._thread.start()

    # -- the training side (never blocks) ------------------------------------------------------

    def log(self, step: int, metrics: Mapping[str, Any], timestamp_ms: int | None = None) -> None:
        """Queue the numeric values of ``metrics`` at ``step``; returns at once. Dropped (and
        counted) when the queue is full or the writer has given up."""
        now = int(time.time() * 1000) if timestamp_ms is None else timestamp_ms
        rows = [(k, float(v), now) for k, v in metrics.items()
                if isinstance(k, str) and _NAME.match(k) and isinstance(v, (int, float)) and not isinstance(v, bool)]
        if not rows:
            return
        with self._cond:
            if self._stopped or self._closing or self._pending_rows + len(rows) > self.max_rows:
                why = self._stopped or ("the writer was closed" if self._closing else
                                        f"more than {self.max_rows} rows waiting: the store is too slow or down")
                self._drop(step, len(rows), why)
                return
            self._pending.append((int(step), rows))
            self._pending_rows += len(rows)
            self.summary.keys.update(k for k, _, _ in rows)
            if len(self._pending) == 1 or self._pending_rows >= _BATCH:
                self._cond.notify()

    def close(self, timeout: float = CLOSE_TIMEOUT_S) -> WorkerSummary:
        """Write what is queued (at most ``timeout`` seconds; at most 1 s when no write has
        succeeded yet: a store down all along is not waited for), record the summary and print
        its line. What is left is dropped and counted. Idempotent."""
        if self.summary.closed:
            return self.summary
        if self.summary.written_rows == 0 and self.last_error:
            timeout = min(timeout, 1.0)
        with self._cond:
            self._closing = True
            self._deadline = time.monotonic() + timeout
            self._cond.notify_all()
        if self._thread.native_id:  # training is over and waits on it now (raising needs root)
            with contextlib.suppress(OSError, AttributeError):
                os.setpriority(os.PRIO_PROCESS, self._thread.native_id, 0)
        self._thread.join(timeout + 0.5)
        with self._cond:
            if self._thread.is_alive():
                # still inside a retry at the deadline: a store that never took a row was
                # unreachable (a loaded machine's retry outlasted the 1 s close), not slow
                never = self.summary.written_rows == 0 and self.last_error
                self._stopped = self._stopped or (f"the store was unreachable ({self.last_error})" if never else
                                                  f"the store did not take the last rows within {timeout:g} s")
            why = self._stopped or (f"the store was unreachable ({self.last_error})" if self.last_error
                                    else "the writer was closed")
            for step, rows in self._pending:
                self._drop(step, len(rows), why)
            self._pending.clear()
            self._pending_rows = 0
            self.summary.closed = True
        self._save()
        print(self.summary.line(), file=self.out or sys.stderr, flush=True)
        return self.summary

    # -- internals -------------------------------------------------------------------------

    def _drop(self, step: int, rows: int, why: str) -> None:
        """Count dropped rows (lock held) and warn once."""
        self.summary.dropped_rows += rows
        self.summary.dropped_steps.add(int(step))
        self.summary.reason = self.summary.reason or why
        if not self._warned:
            self._warned = True
            print(f"{SUMMARY_PREFIX}: WARNING: metric rows are being dropped ({why}); training goes on "
                  f"and the count is reported at the end (store {self.tracking_uri})",
                  file=self.out or sys.stderr, flush=True)

    def _merge_previous(self) -> None:
        """Keep what an earlier writer of the same run directory wrote (Ray Train restarted the
        workers inside one fit)."""
        if self.summary_path is None:
            return
        with contextlib.suppress(OSError, ValueError, TypeError):
            old = WorkerSummary.from_dict(json.loads(self.summary_path.read_text()))
            s = self.summary
            s.written_rows, s.dropped_rows = old.written_rows, old.dropped_rows
            s.written_steps, s.dropped_steps, s.keys = old.written_steps, old.dropped_steps, old.keys
            s.reason, s.writers = old.reason, old.writers + 1
            s.requests, s.write_s, s.cpu_s = old.requests, old.write_s, old.cpu_s

    def _save(self) -> None:
        if self.summary_path is None:
            return
        with contextlib.suppress(OSError):
            with self._cond:
                text = json.dumps(self.summary.to_dict(), indent=1)
            atomic_write_text(self.summary_path, text)

    def _local_store_elsewhere(self) -> str | None:
        """A file store (sqlite, ./mlruns) on the driver's machine cannot be written from a
        worker on another machine (it would make a second store there)."""
        if self._driver is None or self._driver[0] == socket.gethostname():
            return None
        if self.tracking_uri.startswith(("http://", "https://", "databricks")):
            return None
        return (f"the store {self.tracking_uri} is a file on the driver's machine {self._driver[0]}, "
                f"not on this worker's ({socket.gethostname()}); use a tracking server to log from workers")

    def _driver_gone(self) -> bool:
        if self._driver is None or self._driver[0] != socket.gethostname():
            return False
        return not pid_alive(self._driver[1])

    def _connect(self) -> Any:
        if self._client is None:
            import logging
            import warnings

            for name in ("mlflow.store.db.utils", "alembic.runtime.migration"):
                logging.getLogger(name).setLevel(logging.WARNING)
            warnings.filterwarnings("ignore", category=DeprecationWarning, module=r"mlflow\.store")
            from mlflow import MlflowClient

            with store_lock(self.tracking_uri):
                self._client = MlflowClient(self.tracking_uri)
        return self._client

    def _resolve_run_id(self) -> str | None:
        if self.run_id is None and self.run_id_file is not None:
            with contextlib.suppress(OSError):
                self.run_id = self.run_id_file.read_text().strip() or None
            self.summary.run_id = self.run_id
        return self.run_id

    def _take(self) -> list[tuple[int, list[tuple[str, float, int]]]]:
        """Whole steps from the front of the queue, up to one request's worth (lock held)."""
        batch: list[tuple[int, list[tuple[str, float, int]]]] = []
        n = 0
        for step, rows in self._pending:
            if batch and n + len(rows) > _BATCH:
                break
            batch.append((step, rows))
            n += len(rows)
        return batch

    def _loop(self) -> None:
        self._open_store()
        delay = 0.2
        while True:
            with self._cond:
                self._wait_for_batch()
                if self._stopped or not self._pending:
                    if self._closing or self._stopped:
                        return
                    continue
                if self._closing and self._deadline is not None and time.monotonic() > self._deadline:
                    return
                batch = self._take()
            error = self._write(batch)
            with self._cond:
                if error is None:
                    for _ in batch:
                        self._pending.popleft()
                    self._pending_rows -= sum(len(rows) for _, rows in batch)
                    delay = 0.2
                    continue
                if not self._retry_after(error, delay):
                    return
                delay = min(delay * 2, 2.0)

    def _open_store(self) -> None:
        """Lower this thread's CPU priority and import mlflow and open the store now, while
        training starts, not at the first flush."""
        # low CPU priority for this thread (Linux: per thread): importing mlflow (~3 s of CPU in a
        # fresh worker) and writing must not take cores from training
        with contextlib.suppress(OSError, AttributeError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
        cpu = time.thread_time()
        with contextlib.suppress(Exception):
            if not self._stopped:  # e.g. a file store on another machine: never opened
                self._connect()
        with self._cond:
            self.summary.cpu_s += time.thread_time() - cpu

    def _wait_for_batch(self) -> None:
        """Wait (lock held) until a request's worth of rows is queued, the oldest queued row is
        ``flush_interval`` old, or the writer closes or stops."""
        while not self._closing and not self._stopped:
            if self._pending_rows >= _BATCH:
                break
            if self._pending:
                age = time.time() - self._pending[0][1][0][2] / 1000
                if age >= self.flush_interval:
                    break
                self._cond.wait(self.flush_interval - age)
            else:
                self._cond.wait()

    def _retry_after(self, error: str, delay: float) -> bool:
        """After a failed write (lock held): wait ``delay`` seconds (no later than the close
        deadline) and say to retry; or, for an error retrying cannot help or a stopped writer,
        drop and count every queued row and say to stop."""
        self.last_error = error
        permanent = error.startswith("permanent: ")
        if permanent or self._stopped:
            self._stopped = self._stopped or error
            for step, rows in self._pending:
                self._drop(step, len(rows), self._stopped)
            self._pending.clear()
            self._pending_rows = 0
            return False
        if not self._warned:
            self._warned = True
            print(f"{SUMMARY_PREFIX}: WARNING: cannot write to {self.tracking_uri} ({error}); "
                  "retrying in the background, training goes on", file=self.out or sys.stderr, flush=True)
        wait = delay
        if self._closing and self._deadline is not None:
            wait = min(wait, max(0.0, self._deadline - time.monotonic()))
            if wait <= 0:
                return False
        self._cond.wait(wait)
        return True

    def _write(self, batch: list[tuple[int, list[tuple[str, float, int]]]]) -> str | None:
        """One ``log_batch``; None on success, else the error (``permanent: ...`` when retrying
        cannot help). Sets ``_stopped`` when the driver has exited."""
        if self._driver_gone():
            with self._cond:
                self._stopped = "the driver exited (the run was stopped)"
            return self._stopped
        started, cpu = time.monotonic(), time.thread_time()
        try:
            client = self._connect()
            run_id = self._resolve_run_id()
            if run_id is None:
                return f"the run id is not in {self.run_id_file} yet"
            from mlflow.entities import Metric

            client.log_batch(run_id, metrics=[Metric(k, v, ts, step) for step, rows in batch for k, v, ts in rows])
        except Exception as exc:
            text = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]
            return f"permanent: {text}" if is_permanent_error(exc) else text
        finally:
            with self._cond:
                self.summary.requests += 1
                self.summary.write_s += time.monotonic() - started
                self.summary.cpu_s += time.thread_time() - cpu
        with self._cond:
            self.summary.written_rows += sum(len(rows) for _, rows in batch)
            self.summary.written_steps.update(step for step, _ in batch)
        self._save()
        return None


def _parse_driver(text: str | None) -> tuple[str, int] | None:
    if not text or ":" not in text:
        return None
    host, _, pid = text.rpartition(":")
    return (host, int(pid)) if pid.isdigit() else None


# ------------------------------------------------------------------------------------------------
# the launcher's side


_LINE = re.compile(rf"{SUMMARY_PREFIX} run=(?P<run>\S+) written=(?P<written>\d+) dropped=(?P<dropped>\d+) "
                   r"steps=(?P<steps>\S+) keys=(?P<keys>\S+)")


def read_summary(run_dir: str | os.PathLike[str], stderr_log: str | os.PathLike[str] | None = None) -> WorkerSummary | None:
    """What the designated writer of a launch recorded: :data:`SUMMARY_FILE` in ``run_dir``,
    else the last summary line in the driver's stderr log (a writer on another machine), else
    None (there was no writer)."""
    with contextlib.suppress(OSError, ValueError, TypeError):
        return WorkerSummary.from_dict(json.loads((Path(run_dir) / SUMMARY_FILE).read_text()))
    if stderr_log is None:
        return None
    found = None
    with contextlib.suppress(OSError):
        for line in Path(stderr_log).read_text(errors="replace").splitlines():
            match = _LINE.search(line)
            if match:
                found = match
    if found is None:
        return None
    steps: set[int] = set()
    for part in found["steps"].split(",") if found["steps"] != "-" else []:
        a, _, b = part.partition("-")
        steps.update(range(int(a), int(b or a) + 1))
    return WorkerSummary(
        run_id=None if found["run"] == "-" else found["run"], written_rows=int(found["written"]),
        dropped_rows=int(found["dropped"]), written_steps=steps, closed=True,
        keys=set() if found["keys"] == "-" else set(found["keys"].split(",")),
    )


def reconcile(
    result: RunResult, rows: Sequence[tuple[str, float, int, int]], run_id: str | None = None
) -> tuple[list[tuple[str, float, int, int]], dict[str, str], str | None]:
    """For a ``ray_train`` launch run (``run_id``): the launcher's metric rows that the workers'
    writer did not write (so no step is logged twice), tags describing the writer, and a warning
    when it dropped rows (None otherwise). A writer that logged into another run (the job's env
    named one) counts as none."""
    summary = read_summary(result.run_dir, result.log_path(0, "stderr"))
    if summary is not None and run_id and summary.run_id and summary.run_id != run_id:
        summary = None
    if summary is None:
        return list(rows), {"trainguard.ray_writer": "none", "trainguard.ray_writer.backfilled_rows": str(len(rows))}, None
    keys = summary.keys
    left = [r for r in rows if r[2] not in summary.written_steps or (keys and r[0] not in keys)]
    tags = {
        "trainguard.ray_writer": "world rank 0",
        "trainguard.ray_writer.written_rows": str(summary.written_rows),
        "trainguard.ray_writer.dropped_rows": str(summary.dropped_rows),
        "trainguard.ray_writer.backfilled_rows": str(len(left)),
        "trainguard.ray_writer.requests": str(summary.requests),
        "trainguard.ray_writer.write_s": f"{summary.write_s:.3f}",
        "trainguard.ray_writer.cpu_s": f"{summary.cpu_s:.3f}",
    }
    note = None
    if summary.dropped_rows:
        tags["trainguard.ray_writer.reason"] = summary.reason[:5000]
        names = sorted({r[0] for r in left})
        note = (f"trainguard tracking: the Ray workers' writer (world rank 0) dropped {summary.dropped_rows} "
                f"metric row(s) of {len(summary.dropped_steps)} step(s) for {summary.tracking_uri or 'the store'} "
                f"({summary.reason or 'no reason recorded'}); trainguard logged {len(left)} row(s) it read from "
                f"the report lines ({', '.join(names) or 'none'}) in their place. Training was not affected")
    return left, tags, note
