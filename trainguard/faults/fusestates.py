"""What a kill after each operation would leave, copied by the FUSE daemon while the recording run
makes it (``checks.crash_points``, issue 49; docs/crash-points.md, "Restarts from the recorded
states").

A ``record`` rule with ``"states": dir`` makes the daemon copy its backing directory into
``dir/<n>`` right after each operation it journals (the ``n``-th copy; the op event says
``"state": n``), while the caller still waits in its call: the copy is what a kill right after
that operation leaves (everything the kernel accepted stays). A file that did not change since
the copy before (its size, modification time and inode alike, and not the file of the
operation) is a hard link to that copy's file, so each copy costs the bytes that changed. Once
the copies hold ``states_max`` bytes no more are made (the op events then carry no ``state``):
those boundaries are crashed in runs of their own, as before. A copy during which another rank
renamed or deleted a file is dropped (that operation's boundary is crashed in a run of its own).

This module runs in the daemon only and imports nothing of trainguard's.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import time

__all__ = ["StateCopies"]

_Stat = tuple[int, int, int]  # size, mtime_ns, inode


class StateCopies:
    """The copies of one recording run's backing directory, one after each operation."""

    def __init__(self, backing: str, folder: str, limit: int) -> None:
        self.backing, self.folder, self.limit = backing, folder, limit
        self.made = 0
        self.bytes = 0
        self.full = False
        self._before: dict[str, _Stat] = {}  # the previous copy's files: what they were when copied

    def copy(self, changed: tuple[str, ...]) -> tuple[int, float] | None:
        """Copy the backing directory (``changed``: the operation's paths, copied whatever their
        stat says): the copy's number and the seconds it took, or None once the limit is reached."""
        if self.full:
            return None
        began = time.monotonic()
        number = self.made
        into = os.path.join(self.folder, str(number))
        previous = os.path.join(self.folder, str(number - 1))
        touched = {p.lstrip("/") for p in changed}
        now: dict[str, _Stat] = {}
        try:
            os.makedirs(into)
            for root, dirs, files in os.walk(self.backing):
                rel_root = os.path.relpath(root, self.backing)
                for name in dirs:
                    src = os.path.join(root, name)
                    if os.path.islink(src):
                        os.symlink(os.readlink(src), os.path.join(into, rel_root, name))
                    else:
                        os.makedirs(os.path.join(into, rel_root, name), exist_ok=True)
                for name in files:
                    self._one(os.path.normpath(os.path.join(rel_root, name)), into, previous, touched, now)
                    if self.bytes > self.limit:
                        raise OverflowError
        except FileNotFoundError:  # another rank renamed or deleted a file meanwhile: no copy this time
            shutil.rmtree(into, ignore_errors=True)
            return None
        except (OSError, OverflowError, shutil.Error):
            shutil.rmtree(into, ignore_errors=True)
            self.full = True
            return None
        self._before, self.made = now, number + 1
        return number, time.monotonic() - began

    def _one(self, rel: str, into: str, previous: str, touched: set[str], now: dict[str, _Stat]) -> None:
        src, dst = os.path.join(self.backing, rel), os.path.join(into, rel)
        st = os.lstat(src)
        if os.path.islink(src):
            os.symlink(os.readlink(src), dst)
            return
        if not stat.S_ISREG(st.st_mode):  # a FIFO or device: reading it could block; crash runs instead
            raise shutil.Error(f"{rel} is not a regular file")
        key = (st.st_size, st.st_mtime_ns, st.st_ino)
        if rel not in touched and self._before.get(rel) == key:
            with contextlib.suppress(OSError):
                os.link(os.path.join(previous, rel), dst)
                now[rel] = key
                return
        shutil.copy2(src, dst)
        self.bytes += st.st_size
        now[rel] = key
