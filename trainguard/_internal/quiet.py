"""Quiet windows: this process's background work waits while a run whose lines are timed runs.

A rank's metric lines are stamped with the time trainguard reads them, by a thread of this
process, and a drill's step rates (and a timed run's step times) are computed from those stamps.
Any thread of this process that holds the GIL for long starves the readers: importing mlflow and
creating its sqlite store (about 20 s of CPU on a loaded machine), plotting, importing torch.
Beside two CPU hogs, the tracking writer's work made a toy job's 20 ms steps arrive 5 to 22
lines at a time, 0.1 to 0.8 s apart (46-58 % of the lines in bursts), and the step rate before a
fault could not be told; with the writer quiet the same runs read every line on its own.

:func:`measured` opens a window: it waits (bounded) for the background work already under way
to finish, then holds new work until the window closes. Background workers wrap each piece of
work in :func:`busy` (or :func:`begin` and :func:`end`: the tracking writer's queued run
creations, which a window lets through because a launch waits for its run), and ask
:func:`wait_while_measured` before starting the next one.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

__all__ = ["SETTLE_S", "begin", "busy", "end", "measured", "measuring", "wait_while_measured"]

#: how long :func:`measured` waits for background work under way to end before it opens anyway
SETTLE_S = 120.0

_cond = threading.Condition()
_windows = 0  # measured windows open (runs in flight whose lines are timed)
_busy: dict[int, str] = {}  # the work under way, by a token


@contextlib.contextmanager
def measured(settle_s: float = SETTLE_S) -> Iterator[list[str]]:
    """While the ``with`` block runs, background work waits. On entry, wait up to ``settle_s``
    for the work already under way to end; yields what was still running when that wait gave up
    (empty when it did not)."""
    global _windows
    with _cond:
        _windows += 1
    try:
        with _cond:
            _cond.wait_for(lambda: not _busy, settle_s)
            still = sorted(set(_busy.values()))
        yield still
    finally:
        with _cond:
            _windows -= 1
            _cond.notify_all()


def measuring() -> bool:
    """Whether a measured window is open."""
    with _cond:
        return _windows > 0


def wait_while_measured(timeout: float) -> bool:
    """Wait until no measured window is open or ``timeout`` seconds passed; True when none is."""
    with _cond:
        return _cond.wait_for(lambda: _windows == 0, timeout)


def begin(what: str) -> object:
    """Mark a piece of background work as under way until :func:`end` (:func:`measured` waits
    for it); returns its token."""
    token = object()
    with _cond:
        _busy[id(token)] = what
    return token


def end(token: object) -> None:
    """The work :func:`begin` returned ``token`` for is over (again: nothing)."""
    with _cond:
        if _busy.pop(id(token), None) is not None:
            _cond.notify_all()


@contextlib.contextmanager
def busy(what: str) -> Iterator[None]:
    """Mark a piece of background work as under way (:func:`measured` waits for it to end)."""
    token = begin(what)
    try:
        yield
    finally:
        end(token)
