"""The environment variables trainguard sets for the processes it launches, named once.

A launched job (and the Ray workers it starts) finds its MLflow run through these; the pytest
layer's ``TRAINGUARD_*`` settings have their own table in :mod:`trainguard.config.settings`.
"""

from __future__ import annotations

__all__ = ["MLFLOW_RUN_ID", "MLFLOW_RUN_ID_FILE", "MLFLOW_TRACKING_URI"]

#: the MLflow run a launched process logs to (``trainguard.track``, the Ray workers' writer)
MLFLOW_RUN_ID = "TRAINGUARD_MLFLOW_RUN_ID"
#: a file the run's id is written to when the process starts before its run exists
MLFLOW_RUN_ID_FILE = "TRAINGUARD_MLFLOW_RUN_ID_FILE"
#: the tracking URI of that run's store
MLFLOW_TRACKING_URI = "TRAINGUARD_MLFLOW_TRACKING_URI"
