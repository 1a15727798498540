"""Compatibility path: the public names of :mod:`trainguard.queue.base` and
:mod:`trainguard.queue.backends` (docs/architecture.md, re-export modules)."""

from __future__ import annotations

from trainguard.queue.backends import BACKENDS, get_backend
from trainguard.queue.base import (
    TERMINAL_STATUSES,
    QueueBackend,
    Submission,
    SubmissionError,
    SubmissionSpec,
    SubmissionStatus,
    spec_from_job,
    torchrun_argv,
)

__all__ = [
    "BACKENDS",
    "TERMINAL_STATUSES",
    "QueueBackend",
    "Submission",
    "SubmissionError",
    "SubmissionSpec",
    "SubmissionStatus",
    "get_backend",
    "spec_from_job",
    "torchrun_argv",
]
