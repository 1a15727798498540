"""MLflow tracking of every launched run, nested under its check and session (docs/tracking.md).

Modules: :mod:`~trainguard.tracking.tracker` (:class:`Tracker`, :class:`TrackingObserver`,
:func:`open_tracker`), :mod:`~trainguard.tracking.writer` (its background writer),
:mod:`~trainguard.tracking.runs` (run handles, live metrics, plots),
:mod:`~trainguard.tracking.hooks` (:func:`track_check` and the per-launch hooks),
:mod:`~trainguard.tracking.store` (where it writes), :mod:`~trainguard.tracking.system` (system
metrics, environment) and :mod:`~trainguard.tracking.track` (the training-loop helper).
"""

from __future__ import annotations

from trainguard.tracking.hooks import (
    adopt_launch,
    launch_hooks,
    log_attempt,
    start_launch,
    track_check,
    tracker_of,
)
from trainguard.tracking.runs import LiveMetrics, RunHandle, metric_rows, plot_metrics
from trainguard.tracking.store import EXPERIMENT, default_store, store_for, tracking_enabled
from trainguard.tracking.system import environment_snapshot
from trainguard.tracking.tracker import (
    FlushResult,
    Tracker,
    TrackingObserver,
    TrackingWarning,
    open_tracker,
)

__all__ = [
    "EXPERIMENT",
    "FlushResult",
    "LiveMetrics",
    "RunHandle",
    "Tracker",
    "TrackingObserver",
    "TrackingWarning",
    "adopt_launch",
    "default_store",
    "environment_snapshot",
    "launch_hooks",
    "log_attempt",
    "metric_rows",
    "open_tracker",
    "plot_metrics",
    "start_launch",
    "store_for",
    "track_check",
    "tracker_of",
    "tracking_enabled",
]
