"""One rank stream's log file: bounded, and never the reason a rank blocks.

The launcher hands every line a rank prints to :meth:`RankLog.write` before parsing it. Two
things must not follow from a rank's output:

* **a full disk stops the output thread**, the rank then blocks writing to its full pipe and
  the run reads as a hang. A failing write (ENOSPC, EROFS, ...) is recorded once
  (:attr:`RankLog.error`), later lines are only counted (:attr:`RankLog.lost`) and the thread
  goes on draining the pipe; the launcher says in the run's reason that the run directory's
  disk is full;
* **a rank that prints gigabytes fills the disk.** With a ``limit``, the file keeps the first
  half of it, then a rolling last half: two segment files of up to half the limit written in
  turn (so at most 1.5 times the limit is on disk while the rank runs), and when the log is
  closed the last half joined behind a marker line saying how many bytes were dropped
  (:attr:`RankLog.dropped`); the kept tail starts at a line.
"""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any, NotRequired, TypedDict

from trainguard._internal.atomic import os_error_text

__all__ = ["LogSummary", "RankLog", "disk_full_at", "log_evidence", "truncation_marker"]

#: how many bytes of the kept tail are copied (or searched for a line start) at a time
_COPY = 1 << 20

def truncation_marker(dropped: int, head: int, tail: int) -> bytes:
    """The line that stands where a capped log dropped bytes."""
    return (f"\n[trainguard: {dropped} bytes of this log dropped here; it keeps the first {head} "
            f"and the last {tail} bytes (setting rank_log_mb, TRAINGUARD_RANK_LOG_MB)]\n").encode()


class LogSummary(TypedDict):
    """What the report says about one rank's log (``logs_truncated``, ``logs_not_written``):
    bytes printed, dropped by the cap, lost to a failing disk and why."""

    path: str
    bytes: int
    dropped_bytes: NotRequired[int]
    write_error: NotRequired[str]
    lost_bytes: NotRequired[int]


class RankLog:
    """Appends one stream of one rank to ``path``; ``limit`` bytes at most (None: no cap)."""

    def __init__(self, path: Path, limit: int | None = None) -> None:
        self.path = path
        self.limit = limit if limit else None
        self.head_limit = (self.limit + 1) // 2 if self.limit else 0
        #: the most the kept tail holds; each of the two tail segments holds about this much
        self.tail_limit = self.limit - self.head_limit if self.limit else 0
        #: bytes the rank printed on this stream
        self.total = 0
        #: bytes in the head (the file itself)
        self.head = 0
        #: bytes left out by the cap (known once closed)
        self.dropped = 0
        #: the first failed write, in words (``No space left on device (ENOSPC)``)
        self.error: str | None = None
        #: bytes not written because of :attr:`error`
        self.lost = 0
        self._segments: list[tuple[Path, IO[bytes]]] = []
        self._segment_size = 0
        self._file: IO[bytes] | None = None
        try:
            self._file = open(path, "ab")  # noqa: SIM115 -- closed by close()
        except OSError as exc:
            self.error = os_error_text(exc)

    @property
    def truncated(self) -> bool:
        return self.dropped > 0

    def write(self, raw: bytes) -> None:
        """Keep ``raw`` (head, tail segment or nothing); never raises an OSError."""
        self.total += len(raw)
        if self.error is not None or self._file is None:
            self.lost += len(raw)
            return
        try:
            if self.limit is None or (self.head + len(raw) <= self.head_limit and not self._segments):
                self._file.write(raw)
                self._file.flush()  # read while the rank runs (hang evidence, people)
                self.head += len(raw)
                return
            if not self._segments and self.head < self.head_limit:  # fill the head exactly
                room = self.head_limit - self.head
                self._file.write(raw[:room])
                self._file.flush()
                self.head += room
                raw = raw[room:]
            self._to_tail(raw)
        except OSError as exc:
            self.error = os_error_text(exc)
            self.lost += len(raw)

    def _to_tail(self, raw: bytes) -> None:
        if not self._segments or self._segment_size + len(raw) > max(1, self.tail_limit):
            self._rotate()
        self._segments[-1][1].write(raw)
        self._segment_size += len(raw)

    def _rotate(self) -> None:
        """Start a new tail segment; the one before the last is no longer needed."""
        if len(self._segments) == 2:
            old_path, old = self._segments.pop(0)
            old.close()
            self._segments.append((old_path, open(old_path, "wb")))  # noqa: SIM115
        else:
            seg = self.path.with_name(f"{self.path.name}.tail{len(self._segments)}")
            self._segments.append((seg, open(seg, "wb")))  # noqa: SIM115
        self._segment_size = 0

    def close(self) -> None:
        """Join the kept tail behind the marker and remove the segments; never raises."""
        segments, self._segments = self._segments, []
        for _, handle in segments:
            with contextlib.suppress(OSError):
                handle.close()
        if self._file is not None:
            try:
                tail = self._tail(segments)
                kept = sum(size for _, _, size in tail)
                self.dropped = max(0, self.total - self.lost - self.head - kept)
                if self.dropped:
                    self._file.write(truncation_marker(self.dropped, self.head, kept))
                for seg, offset, size in tail:  # copied in pieces: the memory stays small
                    with open(seg, "rb") as src:
                        src.seek(offset)
                        while size > 0 and (chunk := src.read(min(_COPY, size))):
                            self._file.write(chunk)
                            size -= len(chunk)
                self._file.flush()
            except OSError as exc:
                self.error = self.error or os_error_text(exc)
            with contextlib.suppress(OSError):
                self._file.close()
            self._file = None
        for seg, _ in segments:
            with contextlib.suppress(OSError):
                os.unlink(seg)

    def _tail(self, segments: list[tuple[Path, IO[bytes]]]) -> list[tuple[Path, int, int]]:
        """``(segment, offset, size)`` of the last ``tail_limit`` bytes of the segments (oldest
        first), starting at a line."""
        if not segments:
            return []
        newest = segments[-1][0]
        newest_size = newest.stat().st_size
        if len(segments) == 1 or newest_size >= self.tail_limit:
            return [(newest, 0, newest_size)]
        older = segments[0][0]
        older_size = older.stat().st_size
        offset = max(0, older_size - (self.tail_limit - newest_size))
        with open(older, "rb") as src:
            src.seek(offset)
            cut = src.read(min(_COPY, older_size - offset)).find(b"\n")
        if cut >= 0:
            offset += cut + 1
        return [(older, offset, older_size - offset), (newest, 0, newest_size)]

    def summary(self) -> LogSummary:
        """What the report says about this log: bytes printed, kept, dropped by the cap, lost to
        a failing disk."""
        out: LogSummary = {"path": str(self.path), "bytes": self.total}
        if self.dropped:
            out["dropped_bytes"] = self.dropped
        if self.error is not None:
            out["write_error"] = self.error
            out["lost_bytes"] = self.lost
        return out


def disk_full_at(path: Path) -> str | None:
    """``No space left on device (ENOSPC)`` when the file system holding ``path`` has no free
    block left; None otherwise (or when it cannot be asked)."""
    try:
        stats = os.statvfs(path)
    except OSError:
        return None
    if stats.f_bavail == 0 and stats.f_blocks > 0:
        return os_error_text(OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)))
    return None


def log_evidence(
    logs: Sequence[RankLog], run_dir: Path, outcome: str | None, reason: str, evidence: dict[str, Any]
) -> str:
    """Record capped logs (``logs_truncated``) and a full or failing disk under the run
    directory (``run_dir_disk``) in a run's ``evidence``; return its reason, saying so when the
    disk, not the job, may be why the run did not finish."""
    ordered = sorted(logs, key=lambda log: log.path.name)
    capped = [log.summary() for log in ordered if log.truncated]
    if capped:
        evidence["logs_truncated"] = capped
    failed = [log for log in ordered if log.error is not None]
    ended_badly = outcome not in (None, "ok", "stopped")
    full = disk_full_at(run_dir) if ended_badly else None
    if not failed and full is None:
        return reason
    why = failed[0].error if failed else full
    note = (f"the run directory {run_dir} is on a full or failing disk ({why}): "
            + (f"{len(failed)} rank log(s) could not be written" if failed else "no space is left")
            + "; free space there")
    evidence["run_dir_disk"] = {"path": str(run_dir), "error": why, "note": note,
                                "logs_not_written": [log.summary() for log in failed]}
    if not ended_badly:
        return reason
    return f"{reason}; {note}" if reason else note
