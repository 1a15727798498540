"""trainguard's stdout when its reader goes away: ``trainguard check ... | head -1``.

The verdict lines are for whoever reads them; the checks, the report and the exit code do not
depend on anyone reading. When the reader closes the pipe, a write raises ``BrokenPipeError``
(Python ignores SIGPIPE); left alone it would end the session mid-check, as if trainguard's own
files could not be written. :func:`stdout_outliving_its_reader` holds ``sys.stdout`` in a stream
that, on the first broken pipe, points file descriptor 1 at ``/dev/null`` (so what is buffered,
and the interpreter's flush at exit, go nowhere quietly) and lets the run go on.
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
from collections.abc import Iterator
from typing import Any, TextIO

__all__ = ["StdoutOutlivingItsReader", "stdout_outliving_its_reader"]


class StdoutOutlivingItsReader:
    """A text stream over ``stream`` whose writes and flushes after the reader closed the pipe
    go nowhere instead of raising; every other attribute is ``stream``'s."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        #: True once a write found the pipe closed
        self.reader_gone = False

    def write(self, text: str) -> int:
        if not self.reader_gone:
            try:
                return self.stream.write(text)
            except BrokenPipeError:
                self._lose_the_reader()
        return len(text)

    def flush(self) -> None:
        if not self.reader_gone:
            try:
                self.stream.flush()
            except BrokenPipeError:
                self._lose_the_reader()

    def _lose_the_reader(self) -> None:
        self.reader_gone = True
        with contextlib.suppress(OSError, ValueError, io.UnsupportedOperation):
            fd = self.stream.fileno()
            devnull = os.open(os.devnull, os.O_WRONLY)
            try:
                os.dup2(devnull, fd)  # the buffered rest and the flush at exit: nowhere, quietly
            finally:
                os.close(devnull)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stream, name)


@contextlib.contextmanager
def stdout_outliving_its_reader() -> Iterator[StdoutOutlivingItsReader]:
    """``sys.stdout`` as a :class:`StdoutOutlivingItsReader` for the block (the stream it wraps
    is put back after it)."""
    original = sys.stdout
    wrapped = original if isinstance(original, StdoutOutlivingItsReader) else StdoutOutlivingItsReader(original)
    sys.stdout = wrapped  # type: ignore[assignment]
    try:
        yield wrapped
    finally:
        with contextlib.suppress(Exception):
            wrapped.flush()
        sys.stdout = original
