"""Fewer crash runs for the same answer (``checks.crash_points``, docs/crash-points.md, "Runs
inferred"): which boundaries of a save leave the same state when crashed, and which are decided
by bisection.

* **The same state.** The recording's journal is replayed on a model of the checkpoint
  directory (:class:`CrashState`): every entry's kind and content, a content being the journal
  event that last wrote it. A crash after boundary ``b`` leaves what every operation up to ``b``
  made (``mode: kill``), less what a power loss drops (``mode: power``: the daemon's
  :class:`~trainguard.faults.fusejournal.PowerLoss` undo log, replayed on the model). Boundaries
  whose crash leaves the same state (an ``fsync`` in kill mode changes nothing; in power mode a
  rename not yet made durable is undone) need one run: the others take its restart's outcome.
  Files the job appends to (logs) are left out of the state.
* **Bisection.** A file's ``create`` (or ``truncate``) and the writes after it, with no other
  boundary between them, are one segment: its first and last boundaries are run; when their
  restarts did the same (outcome and the step resumed from), the boundaries between them take
  that outcome; otherwise the middle is run and each half decided the same way. Where the
  outcome changes, the boundary it changes at is run, so the first unsafe boundary is found
  exactly, as long as a partly written file does what the two ends of its writing did.
* **A folder's filling** (kill mode). A folder the save makes (its ``mkdir``) and the boundaries
  after it that only add entries to it or write its files (the state a crash leaves grows under
  the folder and changes nowhere else: no entry removed, renamed or changed in kind) are one
  segment, bisected as a file's writes are, as long as a partly filled folder does what the two
  ends of its filling did (a restart that deletes an unfinished folder, or loads it, whatever it
  holds so far). A rename or removal in it ends the segment: the boundary after is run.

An inferred row is never the only evidence of a verdict's change point: the first boundary with
a new outcome is always one that was run.
"""

from __future__ import annotations

import dataclasses
import posixpath
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass, field

from trainguard.drills.crash_records import Boundary, BoundaryOutcome, CrashRow
from trainguard.evidence import UNSET
from trainguard.faults.fusefs import JournalEvent

__all__ = ["Agree", "CrashState", "Inference", "crash_states", "explore_inferred", "folder_segments",
           "write_segments"]

#: ``agree(i, j)``: whether the restart after the crash at boundary ``j`` (run) observed nothing
#: that differs in the state a crash at ``i`` leaves (:mod:`~trainguard.drills.crash_seen`)
Agree = Callable[[int, int], bool]
#: an entry of the model: its kind (``f`` file, ``d`` folder, ``l`` symbolic link), inode, content
_Entry = tuple[str, int, object]
_DATA = ("create", "write", "truncate")


def _dir(path: str) -> str:
    """The folder an entry is in, as the power-loss undo log names it."""
    return posixpath.dirname(path.rstrip("/")) or "/"


def _under(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip("/") + "/")


@dataclass
class CrashState:
    """The checkpoint directory as the journal's operations leave it, and (``power``) the undo
    log of what is not durable yet, kept as the daemon keeps it."""

    power: bool
    names: dict[str, _Entry] = field(default_factory=dict)
    pending: set[int] = field(default_factory=set)
    log: list[tuple[object, ...]] = field(default_factory=list)
    count: int = 0

    def _new(self) -> int:
        self.count += 1
        return self.count

    def _move(self, names: dict[str, _Entry], src: str, dst: str) -> None:
        moved = {p: v for p, v in names.items() if _under(p, src)}
        for p in [p for p in names if _under(p, dst)]:
            del names[p]
        for p, v in moved.items():
            del names[p]
            names[dst + p[len(src):]] = v

    def apply(self, e: JournalEvent) -> None:
        """One operation of the journal, done (in power mode, logged first and its syncs kept)."""
        if self.power:
            self._before(e)
        op, path, n = e.op, e.path, self.names
        if op == "create":
            n[path] = ("f", self._new(), "")
        elif op in ("write", "truncate"):
            kind, ino, _ = n.get(path) or ("f", self._new(), "")
            n[path] = (kind, ino, self._new())  # a content no other operation makes
        elif op == "mkdir":
            n[path] = ("d", self._new(), None)
        elif op in ("unlink", "rmdir"):
            n.pop(path, None)
        elif op == "rename" and e.to:
            self._move(n, path, e.to)
        elif op == "link" and e.to and path in n:
            n[e.to] = n[path]
        elif op == "symlink":
            n[path] = ("l", self._new(), self.count)
        if self.power:
            self._durable(e)

    def _snapshot(self, path: str) -> object:
        entry = self.names.get(path)
        return entry[2] if entry is not None and entry[0] == "f" else None

    def _content(self, path: str) -> None:
        entry = self.names.get(path)
        if entry is not None and entry[1] not in self.pending:
            self.pending.add(entry[1])
            self.log.append(("content", path, entry[1], self._snapshot(path)))

    def _before(self, e: JournalEvent) -> None:
        op, path = e.op, e.path
        if op in ("write", "truncate") or (op == "create" and path in self.names):
            self._content(path)
        elif op == "create":
            self.log.append(("created", path, _dir(path)))
        elif op == "unlink":
            self.log.append(("unlinked", path, self._snapshot(path), _dir(path)))
        elif op == "rename" and e.to:
            self.log.append(("renamed", path, e.to, self._snapshot(e.to), _dir(e.to)))
        elif op in ("mkdir", "rmdir"):
            self.log.append((op, path, _dir(path)))
        elif op in ("link", "symlink"):
            made = e.to if op == "link" and e.to else path
            self.log.append(("linked", made, _dir(made)))

    def _durable(self, e: JournalEvent) -> None:
        if e.op in ("fsync", "fdatasync") and e.path in self.names:
            ino = self.names[e.path][1]
            self.pending.discard(ino)
            self.log = [x for x in self.log if not (x[0] == "content" and x[2] == ino)]
        elif e.op == "fsyncdir":
            here = e.path.rstrip("/") or "/"
            self.log = [x for x in self.log if x[0] == "content" or x[-1] != here]

    def _has_folder(self, names: dict[str, _Entry], path: str) -> bool:
        parent = _dir(path)
        return parent == "/" or names.get(parent, ("",))[0] == "d"

    def _undo(self, names: dict[str, _Entry], entry: tuple[object, ...]) -> None:
        kind, path = str(entry[0]), str(entry[1])
        here = names.get(path)
        if kind in ("content", "unlinked"):
            keep = entry[3] if kind == "content" else entry[2]
            if keep is None:  # truncated to nothing, if it is there
                if here is not None and here[0] == "f":
                    names[path] = ("f", here[1], "")
            elif (here is None or here[0] != "d") and self._has_folder(names, path):
                names[path] = ("f", here[1] if here is not None and here[0] == "f" else self._new(), keep)
        elif kind in ("created", "linked"):
            if here is not None and here[0] != "d":
                del names[path]
        elif kind == "renamed":
            to = str(entry[2])
            if to in names and self._has_folder(names, path) and names.get(path, ("",))[0] != "d":
                self._move(names, to, path)
                if entry[3] is not None:
                    names[to] = ("f", self._new(), entry[3])
        elif kind == "mkdir":
            for p in [p for p in names if _under(p, path)]:
                del names[p]
        elif kind == "rmdir" and here is None and self._has_folder(names, path):
            names[path] = ("d", self._new(), None)

    def crashed(self, leave_out: set[str]) -> Hashable:
        """What a crash now leaves (in power mode, after the undo of what was not durable), each
        entry by its kind and content; ``leave_out`` (logs) aside."""
        names = dict(self.names)
        if self.power:
            for entry in reversed(self.log):
                self._undo(names, entry)
        return frozenset((p, v[0], v[2]) for p, v in names.items() if p not in leave_out)


def crash_states(events: list[JournalEvent], boundaries: list[Boundary], mode: str,
                 leave_out: set[str]) -> list[Hashable | None]:
    """For each boundary, what a crash right after it leaves (:meth:`CrashState.crashed`), from
    the recording's journal; None for a boundary the journal does not hold."""
    where = {(b.rank, b.path, b.op, b.ordinal): i for i, b in enumerate(boundaries)}
    states: list[Hashable | None] = [None] * len(boundaries)
    model = CrashState(power=mode == "power")
    for e in events:
        if e.event != "op":
            continue
        model.apply(e)
        i = where.get((int(e.rank or 0), e.path, e.op, e.ordinal))
        if i is not None and states[i] is None:
            states[i] = model.crashed(leave_out)
    return states


def write_segments(chosen: list[Boundary]) -> list[tuple[int, int]]:
    """``(first, last)`` indices of each run of at least three boundaries in ``chosen`` that
    writes one file of one rank: a ``create`` or ``truncate`` or a write, then writes only."""
    segments: list[tuple[int, int]] = []
    i = 0
    while i < len(chosen):
        b = chosen[i]
        j = i
        if b.op in _DATA:
            while j + 1 < len(chosen) and chosen[j + 1].op == "write" and (
                    chosen[j + 1].rank, chosen[j + 1].path) == (b.rank, b.path):
                j += 1
        if j - i >= 2:
            segments.append((i, j))
        i = j + 1
    return segments


def _fills(before: dict[str, tuple[str, object]], after: dict[str, tuple[str, object]], folder: str) -> bool:
    """Whether ``after`` is ``before`` with entries added under ``folder`` or files under it
    written: nothing removed, nothing changed in kind, nothing changed elsewhere."""
    under = folder + "/"
    if any(after.get(path, ("",))[0] != kind for path, (kind, _) in before.items()):
        return False
    return all(path.startswith(under) for path, value in after.items() if before.get(path) != value)


def folder_segments(chosen: list[Boundary], states: list[Hashable | None]) -> list[tuple[int, int]]:
    """``(first, last)`` indices of each run of at least three boundaries in ``chosen`` that
    fills one folder (kill-mode ``states``, :func:`crash_states`): the folder's ``mkdir``, then
    boundaries whose crash leaves the state before with entries added under it or its files
    written (the module's docstring)."""
    def entries(state: Hashable | None) -> dict[str, tuple[str, object]] | None:
        return None if state is None else {p: (kind, content) for p, kind, content in state}  # type: ignore[attr-defined]

    segments: list[tuple[int, int]] = []
    i = 0
    while i < len(chosen):
        folder, before = chosen[i].path.rstrip("/"), entries(states[i])
        j = i
        if chosen[i].op == "mkdir" and folder and before is not None and before.get(folder, ("",))[0] == "d":
            while j + 1 < len(chosen):
                after = entries(states[j + 1])
                if after is None or not _fills(before, after, folder):
                    break
                before, j = after, j + 1
        if j - i >= 2:
            segments.append((i, j))
        i = j + 1
    return segments


def _alike(a: CrashRow, b: CrashRow) -> bool:
    """Whether two restarts did the same: the outcome, the step resumed from, each rank's."""
    if not isinstance(a, BoundaryOutcome) or not isinstance(b, BoundaryOutcome):
        return False
    return (a.outcome, a.resumed_from_step, a.ranks_resumed_from) == (b.outcome, b.resumed_from_step,
                                                                       b.ranks_resumed_from)


@dataclass
class Inference:
    """The rows of a save's boundaries, some run, some inferred: ``inferred`` maps a boundary's
    index to why (the words the evidence keeps); ``waiting``: boundaries not decided yet, because a
    run they depend on is not made yet (:func:`explore_inferred` with runs still to make)."""

    rows: dict[int, CrashRow] = field(default_factory=dict)
    inferred: dict[int, str] = field(default_factory=dict)
    waiting: set[int] = field(default_factory=set)
    #: the inferred boundaries whose outcome came from what a run's restart observed
    observed: set[int] = field(default_factory=set)

    def take(self, i: int, boundary: Boundary, source: CrashRow, why: str) -> None:
        assert isinstance(source, BoundaryOutcome)
        self.rows[i] = dataclasses.replace(source, boundary=boundary.words(), op=boundary.op, path=boundary.path,
                                           rank=boundary.rank, ordinal=boundary.ordinal,
                                           undone=UNSET,
                                           inferred_from=why)
        self.inferred[i] = why


class _Exploration:
    """The state of :func:`explore_inferred`: the rows so far, the first run of each state."""

    def __init__(self, chosen: list[Boundary], states: list[Hashable | None],
                 run: Callable[[int], CrashRow | None], agree: Agree | None = None) -> None:
        self.chosen, self.states, self.run, self.agree = chosen, states, run, agree
        self.done = Inference()
        self.seen: dict[Hashable, int] = {}
        self.maybe: set[Hashable] = set()  # states whose first run may be one not made yet

    def undecided(self, i: int) -> None:
        self.done.waiting.add(i)
        if self.states[i] is not None and self.states[i] not in self.seen:
            self.maybe.add(self.states[i])

    def get(self, i: int) -> CrashRow | None:
        done, state = self.done, self.states[i]
        if i in done.waiting:
            return None
        if i not in done.rows:
            rep = self.seen.get(state) if state is not None else None
            if rep is not None:
                done.take(i, self.chosen[i], done.rows[rep], f"the same state as the crash {self.chosen[rep].words()}")
                return done.rows[i]
            seen = self._observed(i)
            if seen is not None:
                return seen if isinstance(seen, BoundaryOutcome) else None
            row = None if state is not None and state in self.maybe else self.run(i)
            if row is None:
                self.undecided(i)
                return None
            done.rows[i] = row
            if isinstance(row, BoundaryOutcome) and state is not None:
                self.seen.setdefault(state, i)
        return done.rows[i]

    def _observed(self, i: int) -> CrashRow | bool | None:
        """``i``'s row taken from the first boundary before it that was run and whose restart
        observed nothing that differs in ``i``'s state (crash_seen); False: ``i`` waits (a
        boundary before it waits for a run, whose restart may be that one); None: not inferred so.
        The boundaries before ``i`` taken are those decided when ``i`` is reached (every one, but
        between a bisected segment's ends), none waiting: the same rows whatever order the runs
        are made in (the lanes)."""
        done = self.done
        if self.agree is None or self.states[i] is None:
            return None
        if any(k in done.waiting for k in range(i)):
            self.undecided(i)
            return False
        for j in range(i):
            if j in done.rows and j not in done.inferred and isinstance(done.rows[j], BoundaryOutcome) and self.agree(i, j):
                done.take(i, self.chosen[i], done.rows[j], f"the restart after the crash {self.chosen[j].words()} "
                          "observed nothing this state holds otherwise (what it read, listed and looked up)")
                done.observed.add(i)
                return done.rows[i]
        return None

    def bisect(self, lo: int, hi: int) -> None:
        a, b = self.get(lo), self.get(hi)
        if hi - lo < 2:
            return
        between = [j for j in range(lo + 1, hi) if j not in self.done.rows]
        if hi in self.done.observed:  # both ends as the first restart observed them: so is each between
            return
        if a is None or b is None:  # not known yet: what lies between is decided once it is
            for j in between:
                self.undecided(j)
        elif _alike(a, b):
            for j in between:
                self.done.take(j, self.chosen[j], a, f"between the crashes {self.chosen[lo].words()} and "
                               f"{self.chosen[hi].words()}, whose restarts did the same")
        else:
            mid = (lo + hi) // 2
            self.bisect(lo, mid)
            self.bisect(mid, hi)


def explore_inferred(chosen: list[Boundary], states: Iterable[Hashable | None],
                     run: Callable[[int], CrashRow | None], agree: Agree | None = None,
                     folders: bool = False) -> Inference:
    """Every boundary of ``chosen`` decided: run (``run(i)``: the crash after ``chosen[i]`` and
    its restart, judged without the rows before it) or inferred (the module's docstring).

    ``run(i)`` may return None: that run is not made yet (:mod:`~trainguard.drills.crash_lanes`
    asks which runs the exploration makes for certain, to make them side by side). What depends
    on it is left ``waiting``: a boundary between two writes whose restarts are not both known, one
    whose state a run not made yet may have left first. Every other run asked for is one the
    exploration makes whatever the runs not made yet find. ``folders``: ``states`` are kill
    mode's, and a folder's filling is bisected too (:func:`folder_segments`)."""
    exploration = _Exploration(chosen, list(states), run, agree)
    starts = dict(write_segments(chosen))
    if folders:
        starts.update(folder_segments(chosen, exploration.states))
    for i in range(len(chosen)):
        if i in starts:
            exploration.bisect(i, starts[i])
        exploration.get(i)
    return exploration.done
