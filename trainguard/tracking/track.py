"""``trainguard.tracking.track``: log metrics from your own training loop to one MLflow run, from any rank.

MLflow's fluent API keeps the active run inside the process that started it, so the workers a
launcher spawns cannot log to it. Here the run id travels through the environment: jobs that
trainguard launches get their launch run's id (``TRAINGUARD_MLFLOW_RUN_ID``, or
``TRAINGUARD_MLFLOW_RUN_ID_FILE`` naming a file that holds it once the run exists) and store
(``TRAINGUARD_MLFLOW_TRACKING_URI``); elsewhere the launcher (or rank 0 before spawning) calls
:func:`init`, which creates a run and exports ``TRAINGUARD_MLFLOW_RUN_ID``, ``MLFLOW_RUN_ID`` and
``MLFLOW_TRACKING_URI``. Workers inherit them and call :func:`log`. Only rank 0 (``RANK`` unset or ``0``) writes; on other ranks, without a run id,
or without mlflow, every call is a no-op. Writes are batched by a background thread and never
block the training loop; :func:`flush` (also run at exit, bounded) drains them::

    from trainguard import track

    for step, batch in enumerate(loader):
        loss = train_step(batch)
        track.log(step, loss=loss.item(), lr=sched.get_last_lr()[0])
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import time
from typing import Any

from trainguard._internal.envvars import MLFLOW_RUN_ID, MLFLOW_RUN_ID_FILE, MLFLOW_TRACKING_URI

__all__ = ["RUN_ID_ENV", "flush", "init", "log", "run_id"]

#: the environment variable carrying the run id to workers (MLFLOW_RUN_ID is read too)
RUN_ID_ENV = MLFLOW_RUN_ID
#: a file holding the run id once it exists (trainguard launched the job before its run existed)
RUN_ID_FILE_ENV = MLFLOW_RUN_ID_FILE
#: the store trainguard's launch run is in (MLFLOW_TRACKING_URI is read after it)
TRACKING_URI_ENV = MLFLOW_TRACKING_URI

_lock = threading.Lock()
_state: dict[str, Any] = {}


def run_id() -> str | None:
    """The run this process logs to (from the environment), or None."""
    return os.environ.get(RUN_ID_ENV) or os.environ.get("MLFLOW_RUN_ID") or None


def _rank() -> int:
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


def init(
    run_name: str | None = None,
    *,
    tracking_uri: str | None = None,
    experiment: str = "trainguard",
) -> str | None:
    """Create a run (synchronously, once, in the launching process) and export its id and
    tracking URI to the environment for the workers spawned after this call. An id already in
    the environment is reused. Returns the run id, or None on non-zero ranks / without mlflow."""
    existing = run_id()
    if existing or _rank() != 0:
        return existing
    try:
        from mlflow import MlflowClient
    except ImportError:
        return None
    uri = tracking_uri or _uri()
    try:
        if uri.startswith("sqlite:///"):
            os.makedirs(os.path.dirname(os.path.abspath(uri[len("sqlite:///"):])), exist_ok=True)
        client = MlflowClient(uri)
        exp = client.get_experiment_by_name(experiment)
        exp_id = exp.experiment_id if exp is not None else client.create_experiment(experiment)
        rid: str = client.create_run(exp_id, run_name=run_name).info.run_id
    except Exception as exc:
        from trainguard.tracking.writer import store_unwritable

        why = store_unwritable(exc, uri)
        if why is None:
            raise
        # a full or read-only disk under a local store must not stop the training
        print(f"trainguard tracking: the MLflow store {uri} cannot be written: {why}; this run "
              "is not tracked", file=sys.stderr, flush=True)
        return None
    os.environ[RUN_ID_ENV] = rid
    os.environ["MLFLOW_RUN_ID"] = rid
    os.environ["MLFLOW_TRACKING_URI"] = uri
    return rid


def _uri() -> str:
    return (os.environ.get(TRACKING_URI_ENV) or os.environ.get("MLFLOW_TRACKING_URI")
            or "sqlite:///.trainguard/mlflow.db")


def _tracker() -> Any:
    """The process's writer for the run in the environment (None: this process does not log)."""
    rid = run_id()
    id_file = None if rid else os.environ.get(RUN_ID_FILE_ENV) or None
    key = rid or (f"file:{id_file}" if id_file else None)
    if key is None or _rank() != 0:
        return None
    with _lock:
        if _state.get("run_id") != key:
            import importlib.util

            if importlib.util.find_spec("mlflow") is None:
                _state.update(run_id=key, tracker=None, handle=None)
                return None
            from pathlib import Path

            from trainguard.tracking.runs import RunHandle
            from trainguard.tracking.tracker import Tracker

            tracker = Tracker(_uri(), sample_interval=3600.0)
            if rid:
                handle = tracker.attach(rid)
            else:  # the writer reads the id from the file once trainguard has written it
                handle = RunHandle("launch run", id_file=Path(str(id_file)))
            _state.update(run_id=key, tracker=tracker, handle=handle)
            if not _state.get("atexit"):
                atexit.register(flush)
                _state["atexit"] = True
        return _state["tracker"]


def log(step: int | None = None, **metrics: float) -> None:
    """Queue ``metrics`` at ``step`` (default: a per-process counter); returns at once."""
    tracker = _tracker()
    if tracker is None:
        return
    if step is None:
        step = _state.setdefault("step", 0)
        _state["step"] = step + 1
    now = int(time.time() * 1000)
    tracker.log_metrics(_state["handle"], [(k, float(v), int(step), now) for k, v in metrics.items()])


def flush(timeout: float = 10.0) -> None:
    """Write what is queued (at most ``timeout`` seconds) and stop the writer; a later
    :func:`log` starts a new one."""
    with _lock:
        tracker = _state.pop("tracker", None)
        _state.pop("run_id", None)
    if tracker is not None:
        tracker.close(timeout)
