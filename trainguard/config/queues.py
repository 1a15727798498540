"""Which queue backend a promoted job is submitted to: ``gate.queue`` -> its class.

:data:`QUEUES` is a :class:`~trainguard._internal.registry.Registry` of ``"module:Class"``
lines, imported on first use: the job-file schema accepts every registered name without
importing a queue, ``trainguard.queue.backends.get_backend`` builds one by name, and the gate's
``--submit`` and ``trainguard submit`` hand the spec to the class's ``submit_and_follow``
(docs/queue.md). A queue outside trainguard is one more ``QUEUES.register(name, "module:Class")``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

from trainguard._internal.registry import Registry

__all__ = ["QUEUES", "QueueClass"]


class QueueClass(Protocol):
    """A queue backend's class as this layer sees it (:class:`trainguard.queue.base.QueueBackend`
    implementations)."""

    def __call__(self, **options: Any) -> Any:
        """The backend, built with ``options`` (``script_dir=``, ``cluster=``, ...)."""
        ...

    def submit_and_follow(self, spec: Any, *, state_dir: Path, wait_s: float) -> Any:
        """Submit ``spec`` (a :class:`~trainguard.queue.base.SubmissionSpec`) as the gate does,
        follow it up to ``wait_s`` seconds, and return the
        :class:`~trainguard.queue.base.Submission` (``state_dir``: the job file's ``.trainguard``)."""
        ...


#: queue name (``gate.queue``, ``trainguard submit --queue``) -> its backend class
QUEUES: Registry[QueueClass] = Registry("queue backend", {
    "ray": "trainguard.raytrain.ray_jobs:RayJobsBackend",
    "slurm": "trainguard.queue.slurm:SlurmBackend",
}, accepts=lambda value: callable(getattr(value, "submit_and_follow", None)),
    a="a queue backend class (queue.base.QueueBackend, with submit_and_follow)")
