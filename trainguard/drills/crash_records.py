"""The records of ``checks.crash_points`` (:mod:`trainguard.drills.crash_points`): a boundary of
the save explored, the FUSE journal's events it is found in and the rules the daemon is armed
with, and the report's record (:class:`CrashPointsEvidence`) with one row per boundary.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, TypedDict

from trainguard.evidence import UNSET, Evidence, Unset
from trainguard.faults.fusefs import JournalEvent

__all__ = ["Boundary", "BoundaryNotReached", "BoundaryOutcome", "BoundaryRule", "CrashOutcome", "CrashPointsEvidence",
           "CrashRow", "CrashRule"]


@dataclass(frozen=True)
class Boundary:
    """One file operation of the save: ``op`` (create, write, fsync, rename, ...) number
    ``ordinal`` of that kind by rank ``rank`` on ``path`` (relative to the checkpoint directory)."""

    rank: int
    path: str
    op: str
    ordinal: int
    to: str | None = None

    def words(self) -> str:
        number = f" #{self.ordinal}" if self.op == "write" or self.ordinal > 1 else ""
        what = f"{self.op}{number} of {self.path}"
        if self.to:
            what += f" -> {self.to}"
        return f"rank {self.rank}: after {what}"

    def as_rule(self) -> BoundaryRule:
        return {"rank": self.rank, "path": self.path, "op": self.op, "ordinal": self.ordinal}

    def made(self, event: JournalEvent) -> bool:
        """Whether ``event`` is this operation being made."""
        return (event.event == "op" and (event.rank, event.path, event.op, event.ordinal)
                == (self.rank, self.path, self.op, self.ordinal))


class BoundaryRule(TypedDict):
    """A boundary as the FUSE daemon's crash rule names it (``at``)."""

    rank: int
    path: str
    op: str
    ordinal: int


class CrashRule(TypedDict, total=False):
    """What the FUSE daemon is armed with for one run (:meth:`FuseLayer.arm`): which run it is,
    and for a crash run the boundary, a kill before it instead (the control), power-loss mode
    and where its copies go, the ranks' process groups to kill."""

    run: str
    at: BoundaryRule
    before: bool
    mode: str
    snapshots: str
    kill: list[int]


#: what the restart after a crash did (the module's docstring says each)
CrashOutcome = Literal["safe", "crashed on load", "trained nothing", "torn", "began again", "went back", "loaded"]


@dataclass
class BoundaryOutcome(Evidence):
    """One boundary explored (or the control: a kill before the save) and what the restart after
    the crash did."""

    #: the operation in words (:meth:`Boundary.words`)
    boundary: str
    op: str
    path: str
    rank: int
    ordinal: int
    #: power mode: the changes the crash dropped as not durable (None: the daemon did not say)
    undone: int | Unset | None = field(default=UNSET, kw_only=True)
    resumed_from_step: int | None
    #: rank -> the step it resumed from, when the ranks resumed from different steps
    ranks_resumed_from: dict[str, int] | Unset = field(default=UNSET, kw_only=True)
    outcome: CrashOutcome
    detail: str
    #: not run: the outcome was taken from the crashes named (the same state left, or between
    #: two writes of one file whose restarts did the same; docs/crash-points.md)
    inferred_from: str | Unset = field(default=UNSET, kw_only=True)


@dataclass
class BoundaryNotReached(Evidence):
    """A boundary the crash run never made (the job's saves differ between runs)."""

    boundary: str
    op: str
    path: str
    rank: int
    ordinal: int
    outcome: Literal["not reached"]
    resumed_from_step: None
    detail: str


#: a row of the outcomes (one not reached first: its keys are in another order)
CrashRow = BoundaryNotReached | BoundaryOutcome


@dataclass
class CrashPointsEvidence(Evidence):
    """The save's boundaries and what a crash after each did."""

    mode: str
    after_step: int
    #: the uninterrupted run compared with: "the session's" (kept by an earlier check) or "the
    #: recording run's" (none was kept: one launch less)
    reference: str = ""
    #: the newest step whose line had been read when the save began
    save_after_step: int | None = None
    boundaries_found: int = 0
    boundaries_explored: int = 0
    #: boundaries found per operation kind
    by_op: dict[str, int] = field(default_factory=dict)
    #: one row per explored boundary: its words, outcome, resumed_from_step, detail
    outcomes: list[CrashRow] = field(default_factory=list)
    first_unsafe: BoundaryOutcome | None = None
    fix: str | None = None
    runs: int = 0
    #: boundaries whose outcome was inferred, not run (``inferred_from`` on their rows)
    inferred: int = 0
    #: of those, the boundaries whose outcome came from what a run boundary's restart observed:
    #: the files it read, the names it looked up, the folders it listed (``inferred_from`` says which)
    inferred_observed: int = 0
    #: how many boundaries were run side by side at most, each in a FUSE layer of its own
    lanes: int = 1
    #: where the crash runs started: at the save (from a copy of the checkpoint before it) or at
    #: step 1, and why
    start: str = ""
    work_dir: str = ""
    #: the files a restart of the recording run opened to read (the checkpoint the save writes)
    reads: list[str] = field(default_factory=list)
    #: files the job opened to append (logs: never the save, never compared)
    appended: list[str] = field(default_factory=list)
    #: whether no later save of the files a restart reads followed the one explored
    last_save: bool = False
    #: a kill just before the save began, resumed: run when a crash's restart diverged and none
    #: matched before it, to tell a torn checkpoint from a resume that is never exact
    control: CrashRow | None = None
    #: the outcomes as a Markdown table, for people (``table.md`` in the work directory)
    table: str | None = None
