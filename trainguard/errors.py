"""The exceptions trainguard raises.

Every message says what went wrong with which value, what was expected, and how to fix it; a
failure also says how to reproduce it (the seed, the command).
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "CheckFailed",
    "ConfigError",
    "RankFailure",
    "TrainguardAssertionError",
    "TrainguardError",
    "UsageError",
]


class TrainguardError(Exception):
    """Root of every error trainguard raises on purpose."""


class UsageError(TrainguardError):
    """A function, flag or marker was called with arguments it cannot accept."""


class ConfigError(TrainguardError):
    """A job file (trainguard.yaml) or a setting is invalid.

    The message names the file, the key path (``job.metrics.loss``) and the fix.
    """

    def __init__(self, message: str, *, path: str | None = None, key: str | None = None) -> None:
        self.path = path
        self.key = key
        self.detail = message
        where = ""
        if path and key:
            where = f"{path}: {key}: "
        elif path:
            where = f"{path}: "
        elif key:
            where = f"{key}: "
        super().__init__(where + message)


class TrainguardAssertionError(TrainguardError, AssertionError):
    """A unit-test assertion of the toolkit failed (pytest shows it as a test failure)."""


class CheckFailed(TrainguardError):
    """A check on a training job found a defect, or could not run (an error).

    Raised by :meth:`trainguard.report.Report.raise_for_failures` and
    :meth:`~trainguard.report.CheckResult.raise_for_status`, and by a job-file check collected
    by pytest; ``results`` holds the :class:`~trainguard.report.CheckResult` of each."""

    def __init__(self, message: str, *, results: tuple[Any, ...] = ()) -> None:
        self.results = results
        super().__init__(message)


class RankFailure(TrainguardError):
    """A rank of a launched job died or hung: raised by
    :meth:`trainguard.launch.RunResult.raise_for_ranks`; ``result`` is that run's result."""

    def __init__(self, message: str, *, result: Any = None) -> None:
        self.result = result
        super().__init__(message)
