"""What the runner reports about the runs it launches, to whoever records them.

:class:`~trainguard.run.runner.JobRunner` calls a :class:`RunObserver` at each point of a logical
run's life: it starts (before its first attempt), an attempt starts (the observer may add
environment variables for the ranks and a live metric callback), an attempt ends (a restart or
the final one), the launch raises (Ctrl-C), and a run started ahead in the background is taken
by the check that needs it. :class:`NullObserver` records nothing (the default);
:class:`trainguard.tracking.TrackingObserver` logs to MLflow. The runner never imports the
observer's implementation: whoever builds the runner passes one in.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from trainguard.run.request import RunRequest

if TYPE_CHECKING:  # pragma: no cover
    from trainguard.config import JobFile
    from trainguard.launch import Launcher, MetricPoint, RunResult

__all__ = ["MetricCallback", "NullObserver", "ObserverSource", "RunObserver"]

#: an ``on_metric`` callback of a :class:`~trainguard.launch.Launcher`
MetricCallback = Callable[["MetricPoint", "Launcher"], None]


class RunObserver(Protocol):
    """The events of the runs a runner launches. ``launch`` is the observer's own token for one
    logical run (what :meth:`launch_started` returned; None when it records nothing): the runner
    only hands it back. Methods must return quickly and never raise for a store's sake."""

    def launch_started(
        self, job_file: JobFile, request: RunRequest, *, label: str, command: str,
        ahead_of: str | None = None,
    ) -> object:
        """A logical run (all its attempts) begins; ``command`` reproduces it; ``ahead_of``:
        started early in the background for that check (see :meth:`launch_adopted`)."""

    def attempt_env(
        self, job_file: JobFile, launch: object, world_size: int, log_dir: Path
    ) -> tuple[dict[str, str], MetricCallback | None]:
        """An attempt is about to start in ``log_dir``: environment variables for its ranks (the
        job's own environment wins over them) and a callback for its metric points, or None."""

    def attempt_finished(
        self, job_file: JobFile, launch: object, result: RunResult, attempt: int, *, final: bool
    ) -> None:
        """Attempt ``attempt`` ended with ``result``; ``final``: no restart follows."""

    def launch_aborted(self, launch: object) -> None:
        """The launch raised (e.g. KeyboardInterrupt): the run ends without a result."""

    def launch_adopted(self, launch: object) -> None:
        """A run started ahead (``ahead_of``) was taken by the check running now."""


class ObserverSource(Protocol):
    """Something that provides a :class:`RunObserver` (a :class:`trainguard.tracking.Tracker`):
    ``JobRunner(..., tracker=source)`` reports to ``source.run_observer()``."""

    def run_observer(self) -> RunObserver:
        """The observer that records this source's runs."""


class NullObserver:
    """A :class:`RunObserver` that records nothing (tracking off)."""

    def launch_started(
        self, job_file: JobFile, request: RunRequest, *, label: str, command: str,
        ahead_of: str | None = None,
    ) -> object:
        """Nothing to record: no token."""
        return None

    def attempt_env(
        self, job_file: JobFile, launch: object, world_size: int, log_dir: Path
    ) -> tuple[dict[str, str], MetricCallback | None]:
        """No environment, no metric callback."""
        return {}, None

    def attempt_finished(
        self, job_file: JobFile, launch: object, result: RunResult, attempt: int, *, final: bool
    ) -> None:
        """Nothing to record."""

    def launch_aborted(self, launch: object) -> None:
        """Nothing to record."""

    def launch_adopted(self, launch: object) -> None:
        """Nothing to record."""
