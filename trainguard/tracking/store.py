"""Where tracking writes: the store of a job, and whether tracking is on at all.

The default store is sqlite next to the job file (``.trainguard/mlflow.db``, artifacts in
``.trainguard/mlartifacts``); ``MLFLOW_TRACKING_URI`` wins when set. The lock that serialises
schema creation in a shared sqlite store is :func:`trainguard._internal.locks.store_lock`.
"""

from __future__ import annotations

import os
import shlex
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from trainguard.errors import ConfigError

if TYPE_CHECKING:  # pragma: no cover
    from trainguard.config import JobFile

__all__ = ["EXPERIMENT", "default_store", "store_for", "tracking_enabled", "ui_command"]

#: the experiment every trainguard run is logged to
EXPERIMENT = "trainguard"


def default_store(state_dir: Path) -> tuple[str, str]:
    """``(tracking_uri, artifact_location)`` of the store next to a job file: sqlite at
    ``.trainguard/mlflow.db`` and artifacts in ``.trainguard/mlartifacts`` (never MLflow's own
    ``./mlflow.db``, which would dirty the user's repository)."""
    state_dir = Path(state_dir).resolve()
    return f"sqlite:///{state_dir / 'mlflow.db'}", (state_dir / "mlartifacts").as_uri()


def store_for(job_file: JobFile, environ: Mapping[str, str] | None = None) -> tuple[str, str | None]:
    """``(tracking_uri, artifact_location)`` for a job: ``MLFLOW_TRACKING_URI`` when set (the
    server decides where artifacts go), else :func:`default_store` next to the job file."""
    environ = os.environ if environ is None else environ
    if environ.get("MLFLOW_TRACKING_URI", "").strip():
        return environ["MLFLOW_TRACKING_URI"].strip(), None
    return default_store(job_file.state_dir)


def ui_command(tracking_uri: str) -> str:
    """The shell command that opens the MLflow UI on ``tracking_uri``, the URI quoted for a POSIX
    shell (a job under ``my dir's/`` gives a path with a space and a quote)."""
    return f"mlflow ui --backend-store-uri {shlex.quote(tracking_uri)}"


def tracking_enabled(mode: str) -> bool:
    """Whether tracking mode ``on``/``off``/``auto`` turns tracking on here (``auto``: when mlflow
    is installed; ``on`` without mlflow is an error that says how to install it)."""
    if mode == "off":
        return False
    import importlib.util

    installed = importlib.util.find_spec("mlflow") is not None
    if mode == "on" and not installed:
        raise ConfigError(
            "tracking is 'on' but mlflow is not installed; install it with "
            "`pip install 'trainguard[tracking]'` or set TRAINGUARD_TRACKING=off",
            key="tracking",
        )
    return installed
