"""One rank stream read line by line, and proof that every line printed so far was read.

A thread per stream runs :meth:`LinePump.run`: it reads the rank's pipe, cuts it into lines of
at most ``max_line`` bytes and hands each to a callback (the launcher logs it and stamps it with
the time it was read). :meth:`LinePump.caught_up` is how :meth:`~trainguard.launch.Launcher.frozen`
knows, with the ranks stopped, that every byte they printed before the stop has been read and
handed on, so each of those lines carries a time before the ranks went on: the pump, woken,
finds its pipe empty (or at its end) after the question was asked, with nothing of its own
unhandled. A time read off a loaded machine's clock cannot say that: a thread scheduled late
stamps a line printed before the stop with a time after it.
"""

from __future__ import annotations

import contextlib
import os
import select
import threading
from collections.abc import Callable
from typing import IO

from trainguard.launch.ranklog import RankLog

__all__ = ["LinePump"]

#: bytes read from the pipe at a time
_CHUNK = 64 * 1024


class LinePump:
    """Reads ``pipe`` to its end, writing every byte to ``log`` and calling ``on_line`` with each
    line (decoded, its line end cut; a line longer than ``max_line`` bytes comes in pieces, an
    unterminated last line as it is). Closes both at the end."""

    def __init__(self, pipe: IO[bytes], log: RankLog, on_line: Callable[[str], None], max_line: int) -> None:
        self._pipe = pipe
        self._log = log
        self._fd = pipe.fileno()
        self._on_line = on_line
        self._max_line = max_line
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        self._answer = threading.Condition()
        self._asked = 0  # questions asked by caught_up
        self._answered = 0  # every question up to this one answered
        self._done = False
        #: the bytes read after the last line end: a line printed in two writes (``print``'s text,
        #: then its end) of a writer stopped between them
        self._partial = b""

    def partial(self) -> str:
        """The unterminated rest read so far (meaningful once :meth:`caught_up` answered with the
        writers stopped): never handed on as a line, as its end may still come."""
        return self._partial.decode("utf-8", errors="replace")

    def run(self) -> None:
        """Read until the pipe ends (the thread's target)."""
        pending = b""
        try:
            poller = select.poll()
            poller.register(self._fd, select.POLLIN)
            poller.register(self._wake_r, select.POLLIN)
            while True:
                ready = {fd for fd, _ in poller.poll()}
                if self._wake_r in ready:
                    os.read(self._wake_r, 4096)
                if self._fd in ready:
                    chunk = os.read(self._fd, _CHUNK)
                    if not chunk:
                        break
                    pending = self._lines(pending + chunk)
                    self._partial = pending
                asked = self._asked  # before looking: a question asked later needs a later look
                if not _readable(self._fd):
                    self._answer_up_to(asked)
            if pending:
                self._line(pending)
        finally:
            self._log.close()
            self._pipe.close()
            with self._answer:  # a question asked from now on is answered by the end itself
                self._done = True
                self._answer.notify_all()
                os.close(self._wake_r)
                os.close(self._wake_w)

    def _lines(self, data: bytes) -> bytes:
        """Hand on every whole line of ``data``; the unterminated rest."""
        start = 0
        while True:
            newline = data.find(b"\n", start, start + self._max_line)
            if newline >= 0:
                end = newline + 1
            elif len(data) - start >= self._max_line:
                end = start + self._max_line
            else:
                return data[start:]
            self._line(data[start:end])
            start = end

    def _line(self, raw: bytes) -> None:
        self._log.write(raw)
        self._on_line(raw.decode("utf-8", errors="replace").rstrip("\r\n"))

    def _answer_up_to(self, asked: int) -> None:
        with self._answer:
            if asked > self._answered:
                self._answered = asked
                self._answer.notify_all()

    def caught_up(self, timeout: float) -> bool:
        """Wait until every byte written to the pipe before this call was read and handed on
        (True), or ``timeout`` seconds passed (False: the pump is busy, e.g. waiting on a full
        queue of lines). Only meaningful while the writers are stopped."""
        with self._answer:
            if self._done:
                return True
            self._asked += 1
            asked = self._asked
            with contextlib.suppress(BlockingIOError):  # full of earlier questions: woken already
                os.write(self._wake_w, b"?")
            return self._answer.wait_for(lambda: self._answered >= asked or self._done, timeout)


def _readable(fd: int) -> bool:
    """Whether a read of ``fd`` would return at once (bytes waiting, or the end)."""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(0))
