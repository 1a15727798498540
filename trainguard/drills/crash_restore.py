"""Restarts from the states the recording run left, not after crash runs (``checks.crash_points``,
issue 49; docs/crash-points.md, "Restarts from the recorded states").

In kill mode a crash right after a boundary leaves what every operation up to it made: the
backing directory as it was when that operation returned. Once trainguard reads the line of
``after_step``, the recording run's daemon copies the directory after each operation
(:mod:`trainguard.faults.fusestates`, :class:`RecordStates` arms it), up to ``state_copies_mib``.
A boundary with such a copy needs no crash run: the copy is put back and the restart launched on
it, one launch instead of two. A boundary without one (the copies were full, or it came before
the daemon read the rule) is crashed in a run of its own, as before. The copies are the
recording's, so every boundary that has one was reached.

The recording run is also the uninterrupted run every restart is compared with, when the session
kept none (it ran from step 1 to the end, untouched: the layer only writes down and copies): one
launch less. Its checkpoint directory as it ended is kept (:func:`keep_final`) for a restart with
nothing left to train.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from trainguard.drills.crash_records import Boundary
from trainguard.faults.fusefs import FuseLayer, JournalEvent
from trainguard.faults.fusestates import materialize

__all__ = ["RecordStates", "keep_final", "restore", "states_of"]


@dataclass
class RecordStates:
    """Arms the recording run's ``record`` rule with ``states`` once the line of ``after_step``
    is read (``mib`` 0: never)."""

    layer: FuseLayer
    folder: Path
    after_step: int
    mib: int
    armed: bool = False

    def __call__(self, step: int) -> None:
        if self.armed or self.mib <= 0 or step < self.after_step:
            return
        self.armed = True
        shutil.rmtree(self.folder, ignore_errors=True)
        self.layer.arm({"record": {"run": "record", "states": str(self.folder),
                                   "states_max": self.mib * 1024 * 1024}})


def states_of(events: list[JournalEvent], boundaries: list[Boundary], folder: Path) -> dict[Boundary, Path]:
    """The copy the daemon made right after each boundary of the save, where it made one."""
    wanted = {(b.rank, b.path, b.op, b.ordinal): b for b in boundaries}
    found: dict[Boundary, Path] = {}
    for e in events:
        if e.event != "op" or e.state is None:
            continue
        b = wanted.get((int(e.rank or 0), e.path, e.op, e.ordinal))
        if b is not None and (folder / str(e.state)).is_dir():
            found[b] = folder / str(e.state)
    return found


def restore(copy: Path | None, backing: Path) -> None:
    """Empty the backing directory and put ``copy`` (when given) back in it, file by file: the
    restart writes into it, the copy stays as it was."""
    for entry in list(backing.iterdir()) if backing.is_dir() else []:
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)
    if copy is not None:  # a state copy's files held as references resolved (fusestates)
        materialize(str(copy), str(backing))


def keep_final(backing: Path, keep: Path) -> Path:
    """A copy of the recording run's checkpoint directory as it ended, before anything restarts on
    it: where the recording run is the uninterrupted run, a restart with nothing left to train is
    compared with it (the final checkpoint)."""
    shutil.rmtree(keep, ignore_errors=True)
    shutil.copytree(backing, keep, symlinks=True)
    return keep
