"""Compatibility path: the public names of :mod:`trainguard.queue.base` (docs/architecture.md, re-export modules)."""

from __future__ import annotations

from trainguard.queue.base import (
    BACKENDS,
    QueueBackend,
    Submission,
    SubmissionError,
    SubmissionSpec,
    SubmissionStatus,
    get_backend,
    spec_from_job,
    torchrun_argv,
)

__all__ = [
    "BACKENDS",
    "QueueBackend",
    "Submission",
    "SubmissionError",
    "SubmissionSpec",
    "SubmissionStatus",
    "get_backend",
    "spec_from_job",
    "torchrun_argv",
]
