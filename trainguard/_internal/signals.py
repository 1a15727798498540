"""Holding Ctrl-C and SIGTERM back across a few lines that must not be cut in two.

Python runs a signal's handler in the main thread between two bytecodes, so a KeyboardInterrupt
can be raised anywhere -- inside ``subprocess.Popen`` after the fork (the child runs, but no
Popen object is ever returned to tear it down), or between the start of a process and the line
that records it. :func:`signals_deferred` holds SIGINT and SIGTERM for the length of such a block
and delivers them, to the handlers that were in place, as soon as it ends: the interrupt still
happens, a few milliseconds later, with everything started recorded for the teardown.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any

__all__ = ["signals_deferred"]

_HELD = (signal.SIGINT, signal.SIGTERM)


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
