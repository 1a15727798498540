"""Picking a production queue backend by name (``ray`` or ``slurm``) and building it.

The names and their classes are one registry, :data:`trainguard.config.queues.QUEUES` (the
job file's ``gate.queue`` accepts the same names); the backends import the submission types from
:mod:`trainguard.queue.base`, so ``base`` never needs to know which backends exist.
"""

from __future__ import annotations

from typing import Any, cast

from trainguard.config.queues import QUEUES
from trainguard.errors import UsageError
from trainguard.queue.base import QueueBackend

__all__ = ["get_backend"]


def get_backend(name: str, **options: Any) -> QueueBackend:
    """The backend called ``name`` (``"ray"`` or ``"slurm"``), built with ``options``.

    ``ray``: :class:`~trainguard.raytrain.ray_jobs.RayJobsBackend` (``cluster=``, ``pending_timeout=``,
    ...); ``slurm``: :class:`~trainguard.queue.slurm.SlurmBackend` (``script_dir=``, ...).
    """
    if name not in QUEUES:
        raise UsageError(f"unknown queue backend {name!r}; expected one of {', '.join(QUEUES)}")
    return cast(QueueBackend, QUEUES.get(name)(**options))
