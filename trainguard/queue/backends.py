"""Picking a production queue backend by name (``ray`` or ``slurm``) and building it.

The backends import the submission types from :mod:`trainguard.queue.base`; this module sits
above both and imports them downward, so ``base`` never needs to know which backends exist.
"""

from __future__ import annotations

from typing import Any

from trainguard.errors import UsageError
from trainguard.queue.base import QueueBackend
from trainguard.queue.ray_jobs import RayJobsBackend
from trainguard.queue.slurm import SlurmBackend

__all__ = ["BACKENDS", "get_backend"]

#: the names :func:`get_backend` accepts
BACKENDS = ("ray", "slurm")


def get_backend(name: str, **options: Any) -> QueueBackend:
    """The backend called ``name`` (``"ray"`` or ``"slurm"``), built with ``options``.

    ``ray``: :class:`~trainguard.queue.ray_jobs.RayJobsBackend` (``cluster=``, ``pending_timeout=``,
    ...); ``slurm``: :class:`~trainguard.queue.slurm.SlurmBackend` (``script_dir=``, ...).
    """
    if name == "ray":
        return RayJobsBackend(**options)
    if name == "slurm":
        return SlurmBackend(**options)
    raise UsageError(f"unknown queue backend {name!r}; expected one of {', '.join(BACKENDS)}")
