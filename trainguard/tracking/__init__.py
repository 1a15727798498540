"""MLflow tracking of every launched run, nested under its check and session (docs/tracking.md)."""

from __future__ import annotations

from trainguard.tracking.tracker import (
    EXPERIMENT,
    FlushResult,
    LiveMetrics,
    RunHandle,
    Tracker,
    TrackingWarning,
    adopt_launch,
    default_store,
    environment_snapshot,
    launch_hooks,
    log_attempt,
    metric_rows,
    open_tracker,
    plot_metrics,
    start_launch,
    store_for,
    track_check,
    tracking_enabled,
)

__all__ = [
    "EXPERIMENT",
    "FlushResult",
    "LiveMetrics",
    "RunHandle",
    "Tracker",
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
    "tracking_enabled",
]
