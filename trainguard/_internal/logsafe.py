"""The logging module's registry of loggers, safe to walk while another thread adds to it.

trainguard imports torch and mlflow in background threads (the runner's warm import of torch,
the tracking writer), and those imports create loggers. pytest's logging plugin walks
``logging.Logger.manager.loggerDict`` at the start of every test phase without a lock; a logger
added meanwhile fails the phase with ``RuntimeError: dictionary changed size during iteration``
(seen in a pytest-xdist worker beside two CPU hogs). :func:`safe_logger_registry` replaces the
registry with a dict whose views are copies taken in one step (a C-level copy of a dict holds
the GIL throughout), so a walk sees the loggers as they were when it began.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from typing import Any

__all__ = ["safe_logger_registry"]

_lock = threading.Lock()


class _SnapshotDict(dict):  # type: ignore[type-arg]
    """A dict whose ``keys``/``values``/``items``/iteration walk a copy."""

    def values(self) -> Any:
        return list(dict.values(self))

    def keys(self) -> Any:
        return list(dict.keys(self))

    def items(self) -> Any:
        return list(dict.items(self))

    def __iter__(self) -> Any:
        return iter(list(dict.keys(self)))


def safe_logger_registry() -> None:
    """Make ``logging.Logger.manager.loggerDict`` a :class:`_SnapshotDict` (once; the loggers
    and everything the logging module does with them unchanged)."""
    manager = logging.Logger.manager
    # logging's own registry lock, held while getLogger adds a logger
    registry_lock = getattr(logging, "_lock", None) or contextlib.nullcontext()
    with _lock, registry_lock:
        if not isinstance(manager.loggerDict, _SnapshotDict):
            manager.loggerDict = _SnapshotDict(manager.loggerDict)
