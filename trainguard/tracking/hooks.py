"""Tracking hooks that take a runner: the check run around one check (:func:`track_check`), and
the per-launch hooks of earlier versions, now thin calls of the runner's
:class:`~trainguard.tracking.tracker.TrackingObserver`.

A runner tracks when it was built with a tracker (``JobRunner(..., tracker=tracker)``) or a
:class:`~trainguard.tracking.tracker.TrackingObserver`; :func:`tracker_of` finds that tracker.
Every hook is a no-op for a runner that does not track.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainguard.run.observer import MetricCallback
from trainguard.tracking.runs import RunHandle
from trainguard.tracking.tracker import Tracker, TrackingObserver

if TYPE_CHECKING:  # pragma: no cover
    from trainguard.config import CheckSpec
    from trainguard.launch import RunResult
    from trainguard.report import CheckResult
    from trainguard.run.request import RunRequest
    from trainguard.run.runner import JobRunner

__all__ = [
    "CheckRun",
    "adopt_launch",
    "launch_hooks",
    "log_attempt",
    "open_check_run",
    "start_launch",
    "track_check",
    "tracker_of",
]


def tracker_of(runner: JobRunner) -> Tracker | None:
    """The :class:`Tracker` ``runner`` reports its launches to, or None when it does not track."""
    observer = runner.observer
    return observer.tracker if isinstance(observer, TrackingObserver) else None


def _observer_of(runner: JobRunner) -> TrackingObserver | None:
    observer = runner.observer
    return observer if isinstance(observer, TrackingObserver) else None


class CheckRun:
    """The tracking run of one check (:func:`open_check_run`): :meth:`current` makes it the run
    that launches nest under, :meth:`record` ends it with the check's result, :meth:`failed`
    with an error. Every method is a no-op without a tracker."""

    def __init__(self, tracker: Tracker | None, handle: RunHandle | None) -> None:
        self.tracker = tracker
        self.handle = handle

    @contextlib.contextmanager
    def current(self, *, this_thread: bool = False) -> Iterator[None]:
        """The check's run is the tracker's ``check_run`` inside (``this_thread``: in this thread
        only, for a check finished beside others; else for every thread, as a check in the
        foreground and the background runs it starts)."""
        tracker, handle = self.tracker, self.handle
        if tracker is None:
            yield
        elif this_thread:
            with tracker.check_run_here(handle):
                yield
        else:
            previous, tracker.check_run = tracker.check_run, handle
            try:
                yield
            finally:
                tracker.check_run = previous

    def failed(self) -> None:
        """End it as FAILED: the check raised."""
        tracker, handle = self.tracker, self.handle
        if tracker is None or handle is None:
            return
        tracker.set_tags(handle, {"trainguard.status": "error"})
        tracker.session_failed = True
        tracker.end_run(handle, "FAILED")

    def record(self, result: CheckResult | None) -> None:
        """End it with ``result`` (None: the check returned nothing to record)."""
        tracker, handle = self.tracker, self.handle
        if tracker is None or handle is None:
            return
        if result is None:
            tracker.end_run(handle)
            return
        tracker.set_tags(handle, {"trainguard.status": result.status, "trainguard.summary": result.summary[:5000]})
        tracker.log_metrics(handle, [("duration_s", result.duration_s, 0, int(time.time() * 1000))])
        tracker.log_text(handle, lambda: json.dumps({**result.to_dict(), "skip_reason": result.skip_reason}, indent=2, default=str), "result.json")
        plots = result.evidence.to_dict().get("plots", [])  # the contract: checks put plot paths here
        for plot in [plots] if isinstance(plots, (str, os.PathLike)) else plots or []:
            tracker.log_artifact(handle, plot, "plots")
        if not result.ok:
            tracker.session_failed = True
        tracker.end_run(handle, "FINISHED" if result.ok else "FAILED")


def open_check_run(runner: JobRunner, name: str, spec: CheckSpec) -> CheckRun:
    """Open a check run under the tracker's session run (a :class:`CheckRun` that does nothing
    when the runner has no tracker)."""
    tracker = tracker_of(runner)
    if tracker is None:
        return CheckRun(None, None)
    handle = tracker.start_run(
        name,
        parent=tracker.session,
        tags={"trainguard.kind": "check", "trainguard.check": name, "trainguard.job": runner.job_file.job.name},
        params={"check": name, **{k: v for k, v in asdict(spec).items() if v not in (None, (), [], {})}}
        if _is_dataclass(spec) else {"check": name},
    )
    return CheckRun(tracker, handle)


@contextlib.contextmanager
def track_check(runner: JobRunner, name: str, spec: CheckSpec) -> Iterator[Callable[[CheckResult], None]]:
    """Open a check run under the tracker's session run for the duration of one check; yields a
    function that records the check's result. A no-op when the runner has no tracker."""
    run = open_check_run(runner, name, spec)
    outcome: list[CheckResult] = []
    with run.current():
        try:
            yield outcome.append
        except BaseException:
            run.failed()
            raise
    run.record(outcome[-1] if outcome else None)


def _is_dataclass(value: Any) -> bool:
    return dataclasses.is_dataclass(value) and not isinstance(value, type)


def start_launch(
    runner: JobRunner, request: RunRequest, *, label: str, command: str, ahead_of: str | None = None
) -> RunHandle | None:
    """Create the launch run of one logical run of ``runner`` (see
    :meth:`TrackingObserver.launch_started`); None when the runner does not track."""
    observer = _observer_of(runner)
    if observer is None:
        return None
    return observer.launch_started(runner.job_file, request, label=label, command=command, ahead_of=ahead_of)


def adopt_launch(runner: JobRunner, handle: object) -> None:
    """Nest a launch run started ahead under the check that takes it, the one running now (see
    :meth:`TrackingObserver.launch_adopted`)."""
    observer = _observer_of(runner)
    if observer is not None:
        observer.launch_adopted(handle)


def launch_hooks(
    runner: JobRunner, handle: RunHandle | None, world_size: int, run_dir: Path
) -> tuple[dict[str, str], MetricCallback | None]:
    """The ranks' environment and the live metric callback of one attempt of a tracked launch
    (see :meth:`TrackingObserver.attempt_env`); nothing when the runner does not track."""
    observer = _observer_of(runner)
    if observer is None:
        return {}, None
    return observer.attempt_env(runner.job_file, handle, world_size, run_dir)


def log_attempt(runner: JobRunner, handle: RunHandle | None, result: RunResult, attempt: int, *, final: bool) -> None:
    """Log one attempt of a tracked launch (see :meth:`TrackingObserver.attempt_finished`)."""
    observer = _observer_of(runner)
    if observer is not None:
        observer.attempt_finished(runner.job_file, handle, result, attempt, final=final)
