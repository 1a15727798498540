"""MLflow tracking of every launched run, nested under its check and session (docs/tracking.md).

Modules: :mod:`~trainguard.tracking.tracker` (:class:`Tracker`, :class:`TrackingObserver`,
:func:`open_tracker`), :mod:`~trainguard.tracking.writer` (its background writer),
:mod:`~trainguard.tracking.runs` (run handles, live metrics, plots),
:mod:`~trainguard.tracking.hooks` (:func:`track_check` and the per-launch hooks),
:mod:`~trainguard.tracking.store` (where it writes), :mod:`~trainguard.tracking.system` (system
metrics, environment) and :mod:`~trainguard.tracking.track` (the training-loop helper).

The constants are re-exported here to read (their documented path); each module reads its own,
so a test that changes one patches the defining module (e.g. ``trainguard.tracking.runs``).
"""

from __future__ import annotations

from trainguard.tracking.hooks import (
    CheckRun,
    adopt_launch,
    launch_hooks,
    log_attempt,
    open_check_run,
    start_launch,
    track_check,
    tracker_of,
)
from trainguard.tracking.runs import (
    LIVE_INTERVAL_S,
    LiveMetrics,
    RunHandle,
    metric_rows,
    plot_metrics,
)
from trainguard.tracking.store import (
    EXPERIMENT,
    default_store,
    store_for,
    tracking_enabled,
    ui_command,
)
from trainguard.tracking.system import environment_snapshot, git_tags
from trainguard.tracking.tracker import (
    FLUSH_TIMEOUT_S,
    LAUNCH_RUN_WAIT_S,
    RUN_ID_ENV,
    RUN_ID_FILE_ENV,
    TRACKING_URI_ENV,
    FlushResult,
    Tracker,
    TrackingObserver,
    TrackingWarning,
    open_tracker,
)
from trainguard.tracking.writer import CONNECT_TIMEOUT_S, FLUSH_CAP_FACTOR, METRIC_BATCH_S

__all__ = [
    "CONNECT_TIMEOUT_S",
    "EXPERIMENT",
    "FLUSH_CAP_FACTOR",
    "FLUSH_TIMEOUT_S",
    "LAUNCH_RUN_WAIT_S",
    "LIVE_INTERVAL_S",
    "METRIC_BATCH_S",
    "RUN_ID_ENV",
    "RUN_ID_FILE_ENV",
    "TRACKING_URI_ENV",
    "CheckRun",
    "FlushResult",
    "LiveMetrics",
    "RunHandle",
    "Tracker",
    "TrackingObserver",
    "TrackingWarning",
    "adopt_launch",
    "default_store",
    "environment_snapshot",
    "git_tags",
    "launch_hooks",
    "log_attempt",
    "metric_rows",
    "open_check_run",
    "open_tracker",
    "plot_metrics",
    "start_launch",
    "store_for",
    "track_check",
    "tracker_of",
    "tracking_enabled",
    "ui_command",
]
