"""Holding Ctrl-C and SIGTERM back across a few lines that must not be cut in two.

Python runs a signal's handler in the main thread between two bytecodes, so a KeyboardInterrupt
can be raised anywhere -- inside ``subprocess.Popen`` after the fork (the child runs, but no
Popen object is ever returned to tear it down), or between the start of a process and the line
that records it. :func:`signals_deferred` holds SIGINT and SIGTERM for the length of such a block
and delivers them, to the handlers that were in place, as soon as it ends: the interrupt still
happens, a few milliseconds later, with everything started recorded for the teardown.

:func:`restore_default_signals` is the other half of a process start: a child trainguard starts
for the job gets SIGINT and SIGQUIT at their default action, whatever trainguard itself has.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any

__all__ = ["DEFAULTED", "restore_default_signals", "signals_deferred"]

_HELD = (signal.SIGINT, signal.SIGTERM)

#: the signals a process trainguard starts for the job gets at their default action: a shell
#: starts a background job (`pytest ... &` in a script, without job control) with SIGINT and
#: SIGQUIT ignored, and an ignored signal stays ignored across fork and exec (subprocess's
#: ``restore_signals`` resets SIGPIPE, SIGXFZ and SIGXFSZ only) -- a rank that inherited it never
#: got a `kill_rank` drill's SIGINT
DEFAULTED = (signal.SIGINT, signal.SIGQUIT)


@contextlib.contextmanager
def signals_deferred() -> Iterator[None]:
    """Hold SIGINT and SIGTERM while the block runs, then deliver them (in the order they came).
    Off the main thread (where Python never runs a handler) it does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received: list[int] = []

    def hold(signum: int, frame: FrameType | None) -> None:
        received.append(signum)

    previous: dict[signal.Signals, Callable[[int, FrameType | None], Any] | int] = {}
    try:
        for sig in _HELD:
            handler = signal.getsignal(sig)
            if handler is None or handler is signal.SIG_IGN:  # set outside Python / ignored: kept
                continue
            previous[sig] = handler
            signal.signal(sig, hold)
        yield
    finally:
        for held, handler in previous.items():
            signal.signal(held, handler)
        for signum in dict.fromkeys(received):
            signal.raise_signal(signum)


def restore_default_signals() -> None:
    """Put :data:`DEFAULTED` (SIGINT, SIGQUIT) back to their default action in this process: a
    child's ``preexec_fn`` (after fork, before exec; the default action survives the exec). It
    only calls ``sigaction``, so it is safe in a child forked beside other threads."""
    for sig in DEFAULTED:
        signal.signal(sig, signal.SIG_DFL)
