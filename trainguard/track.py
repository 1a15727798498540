"""Compatibility path: the public names of :mod:`trainguard.tracking.track` (docs/architecture.md, re-export modules)."""

from __future__ import annotations

from trainguard.tracking.track import (
    RUN_ID_ENV,
    RUN_ID_FILE_ENV,
    TRACKING_URI_ENV,
    flush,
    init,
    log,
    run_id,
)

__all__ = [
    "RUN_ID_ENV",
    "RUN_ID_FILE_ENV",
    "TRACKING_URI_ENV",
    "flush",
    "init",
    "log",
    "run_id",
]
