"""Outcomes inferred from what a restart observed (``checks.crash_points``, issue 49;
docs/crash-points.md, "What a restart observed").

Two crash states that differ only in what the restart never observes give the restart the same
inputs, so a job that does the same for the same inputs does the same after both. The daemon
writes down what each restart observed of the checkpoint directory
(:mod:`trainguard.faults.fuseseen`: the files it read, the attributes returned to it, the names it
only looked up, the folders it listed); the recording's journal says what each boundary's crash
leaves (:func:`crash_views`). A boundary whose state agrees with a run boundary's on everything
that boundary's restart observed takes its outcome (:func:`agree`). By induction over the
restart's calls: the first call whose answer differed would be one the run's restart made, on a
path it observed, where both states agree.

What is compared, per level: ``read`` and ``stat``: the entry's kind and content (a folder: its
version, bumped by every entry made, removed or renamed in it); ``name``: the kind only (or its
absence); ``list``: the folder's version; ``tree``: everything under the path; ``all``: nothing is
inferred. Names are compared as the journal names them: the pid of the run that left the state as
``{pid}`` (a restart's own temporary files, named with its own pid, are in neither state).
Kill mode only: a power loss's undo is not modelled here.
"""

from __future__ import annotations

import json
import posixpath
from dataclasses import dataclass, field
from pathlib import Path

from trainguard.drills.crash_infer import CrashState
from trainguard.faults.fusefs import FuseLayer, JournalEvent
from trainguard.faults.fusejournal import boundary_path

__all__ = ["Observed", "View", "agree", "crash_views", "observe", "op_pids", "read_observed"]

#: the observe file read at most (bytes): past it, ``all``
_MOST_BYTES = 8 * 1024 * 1024
_ENTRY_OPS = ("create", "mkdir", "unlink", "rmdir", "link", "symlink", "rename")


@dataclass(frozen=True)
class Observed:
    """What one restart observed: (level, path under the mount) pairs, and the pids of the run
    that left the state it restarted on (its temporary names hold them)."""

    seen: frozenset[tuple[str, str]]
    pids: frozenset[int] = frozenset()

    @property
    def everything(self) -> bool:
        return ("all", "/") in self.seen

    def named(self) -> list[tuple[str, str]]:
        """(level, path as the journal names it), each path under every pid it may hold."""
        out = set()
        for level, path in self.seen:
            out.add((level, boundary_path(path)))
            out |= {(level, boundary_path(path, pid)) for pid in self.pids}
        return sorted(out)


def read_observed(path: Path, pids: set[int], whole: bool = False) -> Observed | None:
    """The observe file the daemon wrote (None: none was written, nothing is inferred from it);
    ``whole``: the judge read more than the restart did (everything)."""
    try:
        with open(path, "rb") as handle:
            data = handle.read(_MOST_BYTES + 1)
    except OSError:
        return None
    seen: set[tuple[str, str]] = set()
    numbers: list[object] = []
    for line in data.decode("utf-8", "replace").splitlines():
        try:
            item = json.loads(line)
        except ValueError:
            item = None
        if isinstance(item, dict) and isinstance(item.get("seen"), str) and isinstance(item.get("path"), str):
            seen.add((item["seen"], item["path"]))
            numbers.append(item.get("n"))
        else:  # a line not whole: what it said is not known
            numbers.append(None)
    if len(data) > _MOST_BYTES or whole or numbers != list(range(1, len(numbers) + 1)):
        seen.add(("all", "/"))
    return Observed(frozenset(seen), frozenset(p for p in pids if p >= 100))


def observe(layer: FuseLayer, name: object, record: str | None = None) -> Path:
    """Arm ``layer`` to write down what the next run observes (``record``: and its operations,
    the ``record`` rule's run): the file it is written to (emptied first)."""
    file = layer.trigger.parent / "seen" / f"{name}.jsonl"
    file.parent.mkdir(parents=True, exist_ok=True)
    file.unlink(missing_ok=True)
    layer.arm({"observe": str(file), **({"record": {"run": record}} if record else {})})
    return file


def op_pids(events: list[JournalEvent]) -> set[int]:
    """The processes that made the journal's operations (their pids name temporary files)."""
    return {int(e.pid) for e in events if e.event == "op" and isinstance(e.pid, int)}


@dataclass(frozen=True)
class View:
    """The checkpoint directory a crash leaves, as the journal's model has it: each entry's kind
    and content, each folder's version (``epoch`` counts folders renamed or removed)."""

    entries: dict[str, tuple[str, object]]
    versions: dict[str, int] = field(default_factory=dict)
    epoch: int = 0

    def _folder(self, path: str) -> tuple[int, int]:
        return self.epoch, self.versions.get(path, 0)

    def project(self, level: str, path: str) -> object:
        """What an observation at ``level`` of ``path`` showed in this state."""
        path = path.rstrip("/") or "/"
        if level == "tree":
            under = path.rstrip("/") + "/"
            return (self._folder(path), self.entries.get(path), sorted(
                (p, v, self._folder(p) if v[0] == "d" else None) for p, v in self.entries.items()
                if p.startswith(under)))
        entry = ("d", None) if path == "/" else self.entries.get(path)
        if entry is None:
            return None
        if level == "name":
            return entry[0]
        return ("d", self._folder(path)) if entry[0] == "d" else entry


def agree(a: View, b: View, observed: Observed) -> bool:
    """Whether states ``a`` and ``b`` show the same on everything ``observed``."""
    if observed.everything:
        return False
    return all(a.project(level, path) == b.project(level, path) for level, path in observed.named())


def _parent(path: str) -> str:
    return posixpath.dirname(path.rstrip("/")) or "/"


def crash_views(events: list[JournalEvent], count: int, where: dict[tuple[int, str, str, int], int]) -> list[View | None]:
    """For each of ``count`` boundaries (``where``: (rank, path, op, ordinal) -> index), the state
    a crash right after it leaves (kill mode), from the recording's journal: logs included (a
    restart may read them)."""
    views: list[View | None] = [None] * count
    model = CrashState(power=False)
    versions: dict[str, int] = {}
    epoch = 0
    for e in events:
        if e.event != "op":
            continue
        if e.op in _ENTRY_OPS:
            moved = [p for p in (e.path, e.to) if p and model.names.get(p, ("",))[0] == "d"]
            if moved and e.op in ("rename", "rmdir"):
                epoch += 1  # a folder renamed or removed: every version is another
            for p in (e.path, e.to) if e.op in ("rename", "link") else (e.path,):
                if p:
                    versions[_parent(p)] = versions.get(_parent(p), 0) + 1
        model.apply(e)
        i = where.get((int(e.rank or 0), e.path, e.op, e.ordinal))
        if i is not None and views[i] is None:
            views[i] = View({p: (v[0], v[2]) for p, v in model.names.items()}, dict(versions), epoch)
    return views
