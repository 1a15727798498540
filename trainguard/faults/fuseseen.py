"""What a restart observed of the checkpoint directory, written down by the FUSE daemon
(``checks.crash_points``, issue 49; docs/crash-points.md, "What a restart observed").

A ``rules`` trigger with ``"observe": file`` makes the daemon append one JSON line to ``file`` the
first time a call of the job reaches a path at a *level* (``{"seen": level, "path": path}``, the
path under the mount, as the job named it):

* ``read``: the file was opened to read (its bytes), or a link's target read;
* ``stat``: its attributes were returned to the program (``stat``, ``fstat``, ``access``; a
  lookup the daemon cannot place: a folder's attributes change with every entry made in it);
* ``name``: it was only looked up on the way to a call that returns no attribute (``open``,
  ``unlink``, ``rename``, ``mkdir``...: the program sees whether it is there and its kind);
* ``list``: the folder's entries were listed (names and kinds);
* ``tree``: the path was renamed or linked away: everything under it moves where it is read later;
* ``all``: something that depends on the whole directory (``statfs``), more than
  :data:`MOST_SEEN` lines, or a line that could not be written: nothing can be left out.

Each line holds its number (``n``): a reader that finds one missing takes it as ``all``.

A path the restart made itself (created, truncated, made a folder, renamed away or onto, deleted)
holds from then on what the restart put there, whatever the crash left: later calls on it, or
under a folder it made or renamed, are not written down (the rename's source was, as ``tree``).

A lookup serves the syscall the calling thread is blocked in (``/proc/<tid>/syscall``, x86-64
numbers): only those in :data:`_NAME_ONLY` make it ``name``; any other, or one that cannot be read,
is ``stat``.

This module runs in the daemon only and imports nothing of trainguard's.
"""

from __future__ import annotations

import json
import platform
import threading

__all__ = ["MOST_SEEN", "Observer", "lookup_level"]

#: lines written per arming; past it one ``all`` line (nothing can be left out)
MOST_SEEN = 20_000

#: x86-64 syscalls whose lookups return no attribute to the program: open, creat, openat,
#: openat2, unlink(at), rename(at, at2), mkdir(at), rmdir, link(at), symlink(at), chdir,
#: getdents64 (names and kinds), truncate, utimensat, chmod, fchmodat
_NAME_ONLY = frozenset({2, 85, 257, 437, 87, 263, 82, 264, 316, 83, 258, 84, 86, 265, 88, 266, 80, 217,
                        76, 280, 90, 268})
_X86_64 = platform.machine() == "x86_64"


def lookup_level(tid: int) -> str:
    """``name`` when thread ``tid`` waits in a syscall that returns no attribute, else ``stat``."""
    if not _X86_64:
        return "stat"
    try:
        with open(f"/proc/{tid}/syscall", encoding="ascii") as handle:
            number = int(handle.read().split()[0])
    except (OSError, ValueError, IndexError):
        return "stat"
    return "name" if number in _NAME_ONLY else "stat"


class Observer:
    """The lines of one ``observe`` file, each (level, path) once."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.key: object = None
        self.seen: set[tuple[str, str]] = set()
        self.own: set[str] = set()  # paths the run made itself: what they hold is its own doing
        self.lost = False  # a line could not be written

    def _new(self, key: object) -> None:
        if key != self.key:  # a new arming (the trigger file's key): a new run
            self.key, self.seen, self.own, self.lost = key, set(), set(), False

    def _owned(self, path: str) -> bool:
        path = path.rstrip("/") or "/"
        while True:
            if path in self.own:
                return True
            if path == "/":
                return False
            path = path.rsplit("/", 1)[0] or "/"

    def made(self, key: object, *paths: str) -> None:
        """The run of arming ``key`` made ``paths`` itself (or removed them, or moved them): from
        now on they hold its own doing."""
        with self.lock:
            self._new(key)
            self.own.update(p.rstrip("/") or "/" for p in paths if p)

    def add(self, key: object, file: str, level: str, path: str) -> None:
        """``path`` observed at ``level`` by the run of arming ``key``: a line in ``file``."""
        with self.lock:
            self._new(key)
            if level != "all" and self._owned(path or "/"):
                return
            key = (level, path or "/")
            if key in self.seen or ("all", "/") in self.seen:
                return
            if len(self.seen) >= MOST_SEEN:
                key = ("all", "/")
            self.seen.add(key)
            if self.lost:  # a line could not be written: nothing can be left out any more
                key = ("all", "/")
            try:
                with open(file, "a", encoding="utf-8") as out:
                    out.write(json.dumps({"seen": key[0], "path": key[1], "n": len(self.seen)}) + "\n")
            except OSError:
                self.lost = True
