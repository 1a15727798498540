"""The FUSE daemon's journal of a save: every file operation of the job's ranks, and a crash
right after one of them (the ``crash_points`` check, docs/crash-points.md).

Armed through the ``rules`` trigger of :mod:`trainguard.faults.fusefs`:

* ``record``: ``{"run": id}``: every operation that changes the file system
  (:data:`BOUNDARY_OPS`) is written as an ``op`` event: the rank (the ``RANK`` in the calling
  process's environment, 0 without one; with ``"ranks": {"<pid>": rank}``, only those processes
  and the ones they started), the file (relative to the mount, a temporary file's random name
  written as ``tmp*``), the operation, its ordinal among that rank's operations of that kind on
  that file, and for a rename its destination. A *boundary* is ``(rank, file, op, ordinal)``: armed
  before the job starts, it names the same moment of a save in every run of the same job,
  whatever other files were written meanwhile. The counts start again when ``run`` changes (not
  when the rule is rewritten: the ``kill`` list below is added once the ranks are known).
* ``crash``: ``{"run": id, "at": {"rank", "path", "op", "ordinal"}, "kill": [pgid, ...]}``:
  counts as ``record`` does; right after the operation ``at`` names has been done, the caller's
  process group and every one in ``kill`` get SIGKILL (the caller dies inside its call, when the
  daemon answers), a ``crashed`` event is written, and every later operation that would change
  the file system fails with EIO: nothing after the boundary reaches the disk.

This module runs in the daemon only and imports nothing of trainguard's.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import signal
import threading
import time
from typing import Any

__all__ = ["BOUNDARY_OPS", "Journal", "boundary_path"]

#: the operations that change the file system, each a boundary of a save
BOUNDARY_OPS = ("create", "write", "truncate", "fsync", "fdatasync", "fsyncdir", "rename", "link",
                "symlink", "unlink", "mkdir", "rmdir")
_MAX_OPS = 50_000  # op events written per arming (a save of many shards; the count goes on)
#: a temporary name's random part: Python's tempfile (tmp + 8 of [a-z0-9_]), a uuid, 32 hex digits
_RANDOM = re.compile(r"tmp[a-z0-9_]{8}|[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}|[0-9a-f]{32}")


def boundary_path(path: str) -> str:
    """``path`` as a boundary names it: a temporary file's random part as ``*`` (``tmp*``), so
    that the same file of the same save has one name in every run."""
    return _RANDOM.sub(lambda m: "tmp*" if m.group().startswith("tmp") else "*", path)


def _env_rank(pid: int) -> int:
    """The ``RANK`` in process ``pid``'s environment (0 without one: a one-process job)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as env:
            for item in env.read().split(b"\0"):
                if item.startswith(b"RANK="):
                    return int(item[5:])
    except (OSError, ValueError):
        pass
    return 0


def _parent(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as status:
            return next(int(ln.split()[1]) for ln in status if ln.startswith("PPid:"))
    except (OSError, ValueError, StopIteration):
        return 0


class Journal:
    """The ``record`` and ``crash`` rules, applied around the passthrough's calls."""

    def __init__(self, events: str) -> None:
        self.events = events
        self.lock = threading.Lock()
        self.key: Any = None
        self.counts: dict[tuple[int, str, str], int] = {}
        self.written = 0
        self.crashed = False
        self.ranks_of: dict[int, int | None] = {}

    def _reset(self, key: Any) -> None:
        if self.key != key:
            self.key, self.counts, self.written, self.crashed, self.ranks_of = key, {}, 0, False, {}

    def _rank(self, pid: int, ranks: dict[str, Any] | None) -> int | None:
        if pid in self.ranks_of:
            return self.ranks_of[pid]
        if ranks is None:
            self.ranks_of[pid] = _env_rank(pid)
            return self.ranks_of[pid]
        found, walk = None, pid
        for _ in range(16):
            if str(walk) in ranks:
                found = int(ranks[str(walk)])
                break
            walk = _parent(walk)
            if walk <= 1:
                break
        self.ranks_of[pid] = found
        return found

    def _emit(self, line: dict[str, Any]) -> None:
        with contextlib.suppress(OSError), open(self.events, "a", encoding="utf-8") as out:
            out.write(json.dumps(line) + "\n")

    @staticmethod
    def _run(key: Any, rules: dict[str, Any]) -> Any:
        spec = rules.get("crash") or rules.get("record")
        return spec.get("run", key) if isinstance(spec, dict) else key

    def before(self, key: Any, rules: dict[str, Any]) -> int | None:
        """The errno a call that would change the file system gets (after a crash: EIO)."""
        with self.lock:
            self._reset(self._run(key, rules))
            return errno.EIO if self.crashed and rules.get("crash") else None

    def after(self, key: Any, rules: dict[str, Any], op: str, path: str, pid: int, **extra: Any) -> None:
        """Count the operation just done; crash right after it when it is the boundary."""
        spec = rules.get("crash") or rules.get("record")
        if not isinstance(spec, dict):
            return
        ranks = spec.get("ranks")
        with self.lock:
            self._reset(self._run(key, rules))
            if self.crashed:
                return
            rank = self._rank(pid, ranks)
            if rank is None:
                return
            name = boundary_path(path)
            counted = (rank, name, op)
            self.counts[counted] = ordinal = self.counts.get(counted, 0) + 1
            if self.written < _MAX_OPS:
                self.written += 1
                if "to" in extra:
                    extra["to"] = boundary_path(str(extra["to"]))
                self._emit({"event": "op", "op": op, "path": name, "rank": rank, "ordinal": ordinal,
                            "pid": pid, "t": time.time(), **extra})
            crash = rules.get("crash")
            at = crash.get("at") if isinstance(crash, dict) else None
            if not isinstance(at, dict) or (at.get("rank"), at.get("path"), at.get("op"), at.get("ordinal")) != (
                    rank, name, op, ordinal):
                return
            self.crashed = True
            assert isinstance(crash, dict)
            groups = list(crash.get("kill") or [])
            with contextlib.suppress(OSError):
                groups.insert(0, os.getpgid(pid))
            for group in groups:
                with contextlib.suppress(ProcessLookupError, PermissionError, OSError, ValueError):
                    os.killpg(int(group), signal.SIGKILL)
            self._emit({"event": "crashed", "op": op, "path": name, "rank": rank, "ordinal": ordinal,
                        "t": time.time()})
