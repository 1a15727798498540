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
import json
import os
import shutil
import stat
import time

__all__ = ["StateCopies", "materialize"]

#: a file of a copy held as a reference: ``["same", m]`` (copy ``m``'s file) or ``["delta", m,
#: offset, size]`` (copy ``m``'s file, the copy's ``.delta`` bytes written at ``offset``, cut or
#: grown to ``size``)
_Ref = list[str | int]


class StateCopies:
    """The copies of one recording run's backing directory, one after each operation."""

    def __init__(self, backing: str, folder: str, limit: int) -> None:
        self.backing, self.folder, self.limit = backing, folder, limit
        self.made = 0
        self.bytes = 0
        self.full = False
        #: each file of the copy before: the copy that holds it as a file, or a reference, and its size
        self._where: dict[str, tuple[int, bool, int]] = {}

    def copy(self, changed: tuple[str, ...], write: tuple[int, int] | None = None) -> tuple[int, float] | None:
        """Copy the backing directory (``changed``: the operation's paths; ``write``: the offset and
        length of the write it was): the copy's number and the seconds it took, or None once the
        limit is reached."""
        if self.full:
            return None
        began = time.monotonic()
        number = self.made
        into = os.path.join(self.folder, str(number))
        touched = {p.lstrip("/") for p in changed}
        now: dict[str, tuple[int, bool, int]] = {}
        refs: dict[str, _Ref] = {}
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
                    rel = os.path.normpath(os.path.join(rel_root, name))
                    now[rel] = self._one(rel, into, number, touched, write, refs)
                    if self.bytes > self.limit:
                        raise OverflowError
            if refs:
                with open(into + ".refs", "w", encoding="utf-8") as out:
                    json.dump(refs, out)
        except FileNotFoundError:  # another rank renamed or deleted a file meanwhile: no copy this time
            self._drop(into)
            return None
        except (OSError, OverflowError, shutil.Error):
            self._drop(into)
            self.full = True
            return None
        self._where, self.made = now, number + 1
        return number, time.monotonic() - began

    @staticmethod
    def _drop(into: str) -> None:
        shutil.rmtree(into, ignore_errors=True)
        for extra in (into + ".refs", into + ".delta"):
            with contextlib.suppress(OSError):
                os.unlink(extra)

    def _one(self, rel: str, into: str, number: int, touched: set[str], write: tuple[int, int] | None,
             refs: dict[str, _Ref]) -> tuple[int, bool, int]:
        """Copy ``rel`` into copy ``number``: (the copy that holds it, whether as a file, its size)."""
        src, dst = os.path.join(self.backing, rel), os.path.join(into, rel)
        st = os.lstat(src)
        if os.path.islink(src):
            os.symlink(os.readlink(src), dst)
            return number, True, 0
        if not stat.S_ISREG(st.st_mode):  # a FIFO or device: reading it could block; crash runs instead
            raise shutil.Error(f"{rel} is not a regular file")
        before = self._where.get(rel)
        if before is not None and rel not in touched:  # as the copy before holds it
            held, as_file, size = before
            if as_file:
                with contextlib.suppress(OSError):
                    os.link(os.path.join(self.folder, str(held), rel), dst)
                    return number, True, size
            refs[rel] = ["same", held]
            return held, False, size
        if before is not None and write is not None and touched == {rel} and st.st_size == max(before[2], sum(write)):
            offset, length = write  # the bytes written, on the copy before's file
            with open(src, "rb") as handle:
                handle.seek(offset)
                data = handle.read(length)
            if len(data) == length:
                with open(into + ".delta", "wb") as out:
                    out.write(data)
                refs[rel] = ["delta", before[0], offset, st.st_size]
                self.bytes += length
                return number, False, st.st_size
        shutil.copy2(src, dst)
        self.bytes += st.st_size
        return number, True, st.st_size


def _refs(folder: str, number: int) -> dict[str, _Ref]:
    try:
        with open(os.path.join(folder, f"{number}.refs"), encoding="utf-8") as handle:
            data = json.load(handle)
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def materialize(copy: str, into: str) -> None:
    """Copy ``copy`` (a state copy, ``<folder>/<n>``) into ``into``: its files, and those it holds
    as references resolved (the file they name, each write since replayed in order)."""
    shutil.copytree(copy, into, symlinks=True, dirs_exist_ok=True)
    folder, name = os.path.split(copy.rstrip("/"))
    if not name.isdigit():  # not a state copy: nothing held as a reference
        return
    number = int(name)
    for rel in _refs(folder, number):
        writes: list[tuple[int, int, int]] = []  # (copy, offset, size) newest first
        held = number
        for _ in range(1_000_000):
            ref = _refs(folder, held).get(rel)
            if not isinstance(ref, list) or len(ref) < 2:
                break
            if ref[0] == "delta" and len(ref) >= 4:
                writes.append((held, int(ref[2]), int(ref[3])))
            held = int(ref[1])
        dst = os.path.join(into, rel)
        shutil.copyfile(os.path.join(folder, str(held), rel), dst)
        with open(dst, "r+b") as out:
            for made, offset, size in reversed(writes):
                with open(os.path.join(folder, f"{made}.delta"), "rb") as delta:
                    out.seek(offset)
                    out.write(delta.read())
                out.truncate(size)
