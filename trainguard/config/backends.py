"""Which backend runs a job of each ``kind``: the one lookup of ``job.kind``.

``job.kind`` names an entry of :data:`BACKENDS` (a :class:`~trainguard._internal.registry.Registry`:
kind -> ``"module:Class"``, imported on first use, so naming the Ray Train backend here imports no
Ray code); :func:`backend_for` makes that kind's :class:`~trainguard.launch.backend.JobBackend`,
which every layer then asks how the job's ranks run (docs/backends.md). A backend outside
trainguard (or a test's) is added with :func:`register_backend` before its job file is loaded;
the job-file schema accepts every registered kind and names the others.
"""

from __future__ import annotations

from collections.abc import Callable

from trainguard._internal.registry import Registry
from trainguard.launch.backend import JobBackend

__all__ = ["BACKENDS", "backend_for", "known_kind", "register_backend", "unregister_backend"]

#: kind -> what makes its backend (a class, called with no arguments); ``command`` is the default
BACKENDS: Registry[Callable[[], JobBackend]] = Registry("job backend", {
    "command": "trainguard.launch.backend:CommandBackend",
    "ray_train": "trainguard.raytrain.backend:RayTrainBackend",
}, accepts=callable, a="a job backend class (launch.backend.JobBackend)")
_BUILT_IN = frozenset(BACKENDS)


def backend_for(kind: str) -> JobBackend:
    """A new backend for jobs of ``kind``. Making one starts nothing; the runner keeps its own
    for the runs it launches (and closes it), a caller that only asks a question may make one
    and drop it. KeyError for a kind no backend is registered for (the schema refuses it)."""
    if kind not in BACKENDS:
        raise KeyError(f"no backend is registered for job kind {kind!r}; registered: "
                       f"{', '.join(BACKENDS)}")
    return BACKENDS.get(kind)()


def known_kind(kind: str) -> str:
    """``kind`` when a backend is registered for it; else ValueError naming the known kinds (the
    job-file schema's check of ``job.kind``)."""
    if kind not in BACKENDS:
        raise ValueError(f"unknown job kind {kind!r}; expected one of {', '.join(BACKENDS)} (another "
                         "kind needs its backend registered first: docs/backends.md)")
    return kind


def register_backend(kind: str, make: Callable[[], JobBackend]) -> None:
    """Run jobs of ``kind`` (``job.kind: <kind>``) with the backend ``make()`` returns (a class
    implementing :class:`~trainguard.launch.backend.JobBackend`, usually a subclass of
    :class:`~trainguard.launch.backend.CommandBackend`). The built-in kinds cannot be replaced."""
    if kind in _BUILT_IN:
        raise ValueError(f"job kind {kind!r} is trainguard's own; register the backend under another name")
    if not kind.isidentifier():
        raise ValueError(f"job kind {kind!r}: use a name of letters, digits and _ (it is written as "
                         "`kind: <name>` in job files)")
    BACKENDS.unregister(kind)
    BACKENDS.register(kind, make)


def unregister_backend(kind: str) -> None:
    """Take a kind :func:`register_backend` added out again (a built-in kind stays)."""
    if kind not in _BUILT_IN:
        BACKENDS.unregister(kind)
