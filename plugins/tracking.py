"""MLflow tracking of a pytest session: one session run per store, also under pytest-xdist.

Without xdist the pytest process opens one :class:`~trainguard.tracking.Tracker` per tracking
store on first use (the first check item of a job file using it) and, at session end, logs the
session's report to the session run and closes it.

Under xdist only the workers collect and run checks, and the controller cannot know which stores
they will use. So the controller hands every worker one registry file (through ``workerinput``);
the first worker writing to a store creates the session run there and records its id in the
registry (under a file lock, in its writer thread: no check waits for it), the others join that
run. At session end the workers flush their writes and the controller, which has every check's
verdict, logs the report to each registered session run and ends it.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from trainguard.plugins.session import TrainguardSession, get_session

if TYPE_CHECKING:
    from trainguard.report import ReportStatus

__all__ = ["REGISTRY_KEY", "configure_node", "finish_session", "runner_for", "session_tracker"]

#: the workerinput key naming the registry file (tracking URI -> session run id)
REGISTRY_KEY = "trainguard_tracking_registry"
_REGISTRY = pytest.StashKey[str]()
_RUN_NAME = "pytest session"


def _warn(text: str) -> None:
    print(text, file=sys.stderr)


def configure_node(node: Any) -> None:
    """The controller's ``pytest_configure_node``: give the worker the session's registry file."""
    config = node.config
    if get_session(config).settings.tracking == "off":
        return
    registry = config.stash.get(_REGISTRY, None)
    if registry is None:
        registry = str(Path(tempfile.mkdtemp(prefix="trainguard-mlflow-")) / "sessions.json")
        config.stash[_REGISTRY] = registry
    node.workerinput[REGISTRY_KEY] = registry


def runner_for(config: pytest.Config, job_file: Any) -> Any:
    """The pytest session's :class:`~trainguard.run.runner.JobRunner` of ``job_file`` (one per
    job file per process, so its checks share reference runs), reporting to the session's tracker
    of the job's store whichever item or fixture asks first; closed at session end."""
    from trainguard.run.runner import JobRunner

    session = get_session(config)
    key = str(job_file.path)
    runner = session.runners.get(key)
    if runner is None:
        runner = JobRunner(job_file, session.settings, tracker=session_tracker(config, job_file))
        session.runners[key] = runner
    return runner


def session_tracker(config: pytest.Config, job_file: Any) -> Any:
    """The session's tracker for ``job_file``'s store, opened on first use and closed (flushed
    within its bound) at session end; None when tracking is off."""
    from trainguard.tracking import open_tracker, store_for, tracking_enabled

    session = get_session(config)
    if not tracking_enabled(session.settings.tracking):
        return None
    uri, _ = store_for(job_file)
    if uri not in session.trackers:
        workerinput = getattr(config, "workerinput", {})
        worker = workerinput.get("workerid", "")
        tags = {"trainguard.xdist_workers": str(workerinput.get("workercount", ""))} if worker else None
        tracker = open_tracker(
            job_file, session.settings, run_name=_RUN_NAME, tags=tags, warn=_warn,
            shared=workerinput.get(REGISTRY_KEY),
        )
        session.trackers[uri] = tracker
        if tracker is not None:  # normally closed by finish_session; this covers an aborted session
            config.add_cleanup(tracker.shutdown)
    return session.trackers[uri]


def summary(state: TrainguardSession, status: ReportStatus) -> dict[str, Any]:
    """The session's check verdicts as a small JSON-able dict (logged when no report is set);
    ``status`` the session report's (:attr:`trainguard.report.Report.status`)."""
    counts: dict[str, int] = {}
    for _, result in state.check_results:
        counts[result.status] = counts.get(result.status, 0) + 1
    return {
        "status": status,
        "counts": counts,
        "checks": [
            {"nodeid": nodeid, "name": r.name, "status": r.status, "summary": r.summary,
             "duration_s": round(r.duration_s, 3)}
            for nodeid, r in state.check_results
        ],
    }


def finish_session(config: pytest.Config, report_path: str | os.PathLike[str] | None,
                   status: ReportStatus) -> None:
    """At session end: a worker flushes its trackers; the controller (or the only process) logs
    the report (``report_path``, else :func:`summary`) to each session run, tags it with the
    report's ``status`` (``trainguard.status``: failed, interrupted, skipped or passed) and ends
    it."""
    state = get_session(config)
    trackers = [t for t in state.trackers.values() if t is not None]
    state.trackers.clear()
    if hasattr(config, "workerinput"):
        for tracker in trackers:
            tracker.close()
        return
    text = json.dumps(summary(state, status), indent=2)
    for tracker in trackers:  # no xdist: this process made the session runs
        if tracker.session is not None:
            _log_report(tracker, tracker.session, report_path, text)
            tracker.set_tags(tracker.session, {"trainguard.status": _session_status(status, tracker.session_failed)})
        tracker.close()
    registry = config.stash.get(_REGISTRY, None)
    if registry is None:
        return
    try:
        try:
            runs: dict[str, str] = json.loads(Path(registry).read_text())
        except (OSError, ValueError):
            runs = {}  # no worker tracked anything
        from trainguard.tracking import Tracker

        for uri, run_id in runs.items():
            tracker = Tracker(uri, warn=_warn)
            handle = tracker.attach(run_id)
            handle.name = _RUN_NAME
            _log_report(tracker, handle, report_path, text)
            tracker.set_tags(handle, {"trainguard.status": status})
            tracker.end_run(handle, "FAILED" if status == "failed" else "FINISHED")
            tracker.close()
    finally:
        shutil.rmtree(Path(registry).parent, ignore_errors=True)


def _session_status(status: ReportStatus, failed_here: bool) -> ReportStatus:
    """The status of one store's session run: ``failed`` when one of its checks failed; else the
    report's, except that another store's failure leaves this one ``passed``."""
    if failed_here:
        return "failed"
    return "passed" if status == "failed" else status


def _log_report(tracker: Any, handle: Any, report_path: str | os.PathLike[str] | None, text: str) -> None:
    if report_path is not None:
        tracker.log_artifact(handle, report_path, "report")
    else:
        tracker.log_text(handle, text, "report/pytest-summary.json")
