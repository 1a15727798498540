"""Picking a production queue backend by name (``ray`` or ``slurm``) and building it.

The backends import the submission types from :mod:`trainguard.queue.base`; this module names
each by a ``module:attr`` line resolved on first use, so ``base`` never needs to know which
backends exist, and the Ray Jobs backend, which is Ray's, lives in ``raytrain/`` above this layer.
"""

from __future__ import annotations

import importlib
from typing import Any

from trainguard.errors import UsageError
from trainguard.queue.base import QueueBackend

__all__ = ["BACKENDS", "backend_class", "get_backend"]

#: the names :func:`get_backend` accepts -> the class of each, resolved on first use
_CLASSES = {"ray": "trainguard.raytrain.ray_jobs:RayJobsBackend", "slurm": "trainguard.queue.slurm:SlurmBackend"}
#: the names :func:`get_backend` accepts
BACKENDS = tuple(_CLASSES)


def backend_class(name: str) -> Any:
    """The class of the backend called ``name``; UsageError naming the known ones."""
    if name not in _CLASSES:
        raise UsageError(f"unknown queue backend {name!r}; expected one of {', '.join(BACKENDS)}")
    module, _, attribute = _CLASSES[name].partition(":")
    return getattr(importlib.import_module(module), attribute)


def get_backend(name: str, **options: Any) -> QueueBackend:
    """The backend called ``name`` (``"ray"`` or ``"slurm"``), built with ``options``.

    ``ray``: :class:`~trainguard.raytrain.ray_jobs.RayJobsBackend` (``cluster=``,
    ``pending_timeout=``, ...); ``slurm``: :class:`~trainguard.queue.slurm.SlurmBackend`
    (``script_dir=``, ...).
    """
    return backend_class(name)(**options)  # type: ignore[no-any-return]
