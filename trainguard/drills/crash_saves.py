"""Which burst of a job's file operations is its checkpoint's save, and whether what a crash in
that save left is the uninterrupted run's final checkpoint (``checks.crash_points``,
docs/crash-points.md).

A save writes the files a restart reads: the FUSE layer sees the restart open them
(:mod:`trainguard.faults.fusejournal`'s ``opened`` events), and a file of the same *shape* (its
name with every number as ``#``: ``/iter_0000010/model.json`` and ``/iter_0000020/model.json``)
written by a burst makes that burst a save. A file opened to append is a log, never the
checkpoint, whatever its name.

A restart that trains no step has resumed only if what the crash left is the uninterrupted
run's final checkpoint: every file the save wrote, under its final name, is compared with the
uninterrupted run's (byte for byte, or value by value for a checkpoint trainguard reads, paths
and times aside). A file not compared (over the read limit, not a regular file) is never equal.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from pathlib import Path

from trainguard._internal.readers import (
    OverLimit,
    Unreadable,
    active_limits,
    open_regular,
    shown_name,
)
from trainguard.faults.fusefs import JournalEvent
from trainguard.unit.checkpoints import compare_checkpoint_dirs
from trainguard.unit.checkpoints.files import FILE_SUFFIXES

__all__ = ["feeds_restart", "save_bursts", "save_files", "shape", "unlike_reference"]

_NUMBER = re.compile(r"\d+")
#: what a restart's reads are matched with: the file written (a rename's or link's destination)
_WRITES = ("create", "write", "truncate", "mkdir", "symlink", "rename", "link")
_CHUNK = 1 << 20


def shape(path: str) -> str:
    """``path`` with every number as ``#``: the same file of every save."""
    return _NUMBER.sub("#", path)


#: operations this close follow each other at once: one save, whatever line was read between them,
#: unless one begins a file (:data:`_BEGINS`) of a shape the save began already
_SAME_SAVE_S, _BEGINS = 0.02, ("create", "truncate", "mkdir")


def save_bursts(ops: list[JournalEvent], arrivals: list[tuple[int, float]], gap_s: float) -> list[list[JournalEvent]]:
    """Operations in bursts: each starting at most ``gap_s`` after the one before ended and with
    no step line read between them (unless they follow each other within 20 ms and the later
    does not begin again a file of the shape of one the burst began: a tiny job's next save). A
    top folder made of the shape of one the burst made or wrote in (not one it only deleted from),
    under another name, begins a burst too (``/step_000015`` after ``/step_000010``: an async
    save's writes in the background, never far apart, running into the next save)."""
    bursts: list[list[JournalEvent]] = []
    begun: set[tuple[int | None, str]] = set()  # (rank, shape) of what the last burst made or truncated
    folders: dict[str, str] = {}  # shape -> name of the top folders the last burst made or wrote in
    lines = sorted(t for _, t in arrivals)
    for e in ops:
        start, end = e.start, bursts[-1][-1].t if bursts else 0.0  # (written after the daemon's copy, if any)
        again = e.op in _BEGINS and (e.rank, shape(e.path)) in begun
        top = e.op == "mkdir" and "/" not in e.path.strip("/")
        # a step line read between two operations of one rank parts saves closer than gap_s, unless
        # they follow each other at once (a line read late, in the middle of a save); between two
        # ranks' operations it does not: rank 0 may print its next step while rank 1 still saves
        if not bursts or start - end > gap_s or ((start - end > _SAME_SAVE_S or again) and e.rank == bursts[-1][-1].rank
                                                 and any(end < t < start for t in lines)) or (
                top and folders.get(shape(e.path), "/" + e.path.strip("/")) != "/" + e.path.strip("/")):
            bursts.append([])
            begun, folders = set(), {}
        bursts[-1].append(e)
        if e.op in _BEGINS:
            begun.add((e.rank, shape(e.path)))
        if top or ("/" in e.path.strip("/") and e.op not in ("unlink", "rmdir")):  # (pruning is no save's)
            name = "/" + e.path.strip("/").split("/", 1)[0]
            folders.setdefault(shape(name), name)
    return bursts


def feeds_restart(op: str, path: str, to: str | None, reads: set[str], appended: set[str]) -> bool:
    """Whether an operation writes a file a restart reads (``reads``, as :func:`shape` names
    them), or makes the folder of one; a file opened to append (``appended``) is a log."""
    if op not in _WRITES:
        return False
    target = to if op in ("rename", "link") and to else path
    if target in appended:
        return False
    named = shape(target)
    if named in reads:
        return True
    return op == "mkdir" and any(r.startswith(named.rstrip("/") + "/") for r in reads)


def save_files(ops: Iterable[tuple[str, str, str | None]], appended: set[str]) -> list[str]:
    """The files (and folders) a save of ``(op, path, to)`` left under their final names: a
    rename's destination, a file written and never renamed, a folder it made; logs (opened to
    append) and names with a part that differs between runs (``tmp*``, ``{pid}``) aside."""
    ops = list(ops)
    renamed = {path for op, path, _ in ops if op == "rename"}
    names: dict[str, None] = {}
    for op, path, to in ops:
        if op in ("rename", "link") and to:
            names[to] = None
        elif op in ("create", "write", "truncate", "mkdir") and path not in renamed:
            names[path] = None
    return [n for n in names if n not in appended and "*" not in n and "{pid}" not in n and n.strip("/")]


def _files_under(root: Path) -> list[str]:
    """The files under a folder, relative to it, as many as the read limit lists."""
    found: list[str] = []
    for here, dirs, files in os.walk(root):
        dirs.sort()
        found += sorted(os.path.relpath(os.path.join(here, f), root) for f in files)
        if len(found) > active_limits().max_files:
            raise OverLimit(f"{shown_name(root.name)} holds over {active_limits().max_files} files "
                            "(setting read_max_files)")
    return found


def _same_bytes(actual: Path, expected: Path, roots: tuple[Path, Path]) -> bool:
    with open_regular(actual, root=roots[0]) as a, open_regular(expected, root=roots[1]) as e:
        while True:
            chunk = a.read(_CHUNK)
            if chunk != e.read(_CHUNK):
                return False
            if not chunk:
                return True


def _file_unlike(name: str, actual: Path, expected: Path, roots: tuple[Path, Path]) -> str | None:
    """Why the crash's file ``name`` is not the uninterrupted run's, or None when it is."""
    try:
        if _same_bytes(actual, expected, roots):
            return None
    except Unreadable as exc:  # over the limit or not a regular file: never equal
        return f"{name} not compared ({exc})"
    if actual.suffix not in FILE_SUFFIXES:
        return f"{name} differs from the uninterrupted run's"
    state = compare_checkpoint_dirs(actual, expected, labels=("crashed", "uninterrupted"))
    if state.compared and state.ok:
        return None
    return f"{name} differs from the uninterrupted run's ({state.summary() or state.reason})"


def _missing(name: str, crash_has_it: bool) -> str:
    return f"the {'uninterrupted run' if crash_has_it else 'crash'} left no {name}"


def unlike_reference(actual_root: Path, expected_root: Path, names: list[str]) -> tuple[list[str], int]:
    """Where the files ``names`` (under ``actual_root``: what the crash and the restart left)
    differ from the uninterrupted run's (under ``expected_root``), in words; and how many files
    were compared. A name in neither is passed over; a folder is compared file by file."""
    differences: list[str] = []
    compared = 0
    for name in names:
        actual, expected = actual_root / name.lstrip("/"), expected_root / name.lstrip("/")
        if not actual.exists() and not expected.exists():
            continue
        if not actual.exists() or not expected.exists():
            differences.append(_missing(name, actual.exists()))
            continue
        try:
            pairs = [""] if not (actual.is_dir() or expected.is_dir()) else sorted(
                set(_files_under(actual)) | set(_files_under(expected)))
        except OverLimit as exc:
            differences.append(f"{name} not compared ({exc})")
            continue
        for rel in pairs:
            where = f"{name.rstrip('/')}/{rel}" if rel else name
            a, e = (actual / rel, expected / rel) if rel else (actual, expected)
            if not os.path.lexists(a) or not os.path.lexists(e):
                differences.append(_missing(where, os.path.lexists(a)))
                continue
            compared += 1
            why = _file_unlike(where, a, e, (actual_root, expected_root))
            if why is not None:
                differences.append(why)
    return differences, compared
