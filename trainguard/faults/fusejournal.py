"""The FUSE daemon's journal of a save: every file operation of the job's ranks, and a crash
right after one of them (the ``crash_points`` check, docs/crash-points.md).

Armed through the ``rules`` trigger of :mod:`trainguard.faults.fusefs`:

* ``record``: ``{"run": id}``: every operation that changes the file system
  (:data:`BOUNDARY_OPS`) is written as an ``op`` event: the rank (the ``RANK`` in the calling
  process's environment, 0 without one; with ``"ranks": {"<pid>": rank}``, only those processes
  and the ones they started), the file (relative to the mount, a temporary file's random name
  written as ``tmp*``, the writer's pid in it as ``{pid}``), the operation, its ordinal among
  that rank's operations of that kind on that file, and for a rename its destination. A
  *boundary* is ``(rank, file, op, ordinal)``: armed before the job starts, it names the same
  moment of a save in every run of the same job, whatever other files were written meanwhile. The counts start again when ``run`` changes (not
  when the rule is rewritten: the ``kill`` list below is added once the ranks are known).
* ``crash``: ``{"run": id, "at": {"rank", "path", "op", "ordinal"}, "kill": [pgid, ...]}``:
  counts as ``record`` does; right after the operation ``at`` names has been done, the caller's
  process group and every one in ``kill`` get SIGKILL (the caller dies inside its call, when the
  daemon answers), a ``crashed`` event is written, and every later operation that would change
  the file system fails with EIO: nothing after the boundary reaches the disk. With ``"mode":
  "power"`` and ``"snapshots": dir``, the crash is a power loss (:class:`PowerLoss`): what was not
  yet durable is undone first. With ``"before": true`` the crash strikes instead of that
  operation: it is never done (the caller gets EIO as it dies), a crash just before a save began.

Under either rule every file a rank opens for reading or for appending is written once as an
``opened`` event (``"mode": "read"`` or ``"append"``, named as a boundary names it): the files a
restart reads are the checkpoint, the ones opened to append are logs.

This module runs in the daemon only and imports nothing of trainguard's.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
import signal
import stat
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from trainguard.faults.fusestates import StateCopies

__all__ = ["BOUNDARY_OPS", "HoldRule", "Journal", "JournalRule", "PowerLoss", "Rules", "boundary_path"]

#: the operations that change the file system, each a boundary of a save
BOUNDARY_OPS = ("create", "write", "truncate", "fsync", "fdatasync", "fsyncdir", "rename", "link",
                "symlink", "unlink", "mkdir", "rmdir")
_MAX_OPS = 50_000  # op events written per arming (a save of many shards; the count goes on)
_MAX_OPENS = 5_000  # opened events written per arming (a file is written once per rank and mode)
#: a temporary name's random part: Python's tempfile (tmp + 8 of [a-z0-9_]), Rust's tempfile crate
#: (.tmp + 6 of [A-Za-z0-9]: safetensors' model.safetensors), a uuid, 32 hex digits
_RANDOM = re.compile(r"tmp[A-Za-z0-9_]{6,8}(?![A-Za-z0-9_])|"
                     r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}|[0-9a-f]{32}")


def boundary_path(path: str, pid: int = 0) -> str:
    """``path`` as a boundary names it: a temporary file's random part as ``*`` (``tmp*``) and
    the writing process's pid as ``{pid}`` (``ckpt.pt.6800.tmp``), so that the same file of the
    same save has one name in every run."""
    named = _RANDOM.sub(lambda m: "tmp*" if m.group().startswith("tmp") else "*", path)
    # a pid below 100 (a fresh pid namespace) would stand for too many step numbers
    return re.sub(rf"(?<![0-9]){pid}(?![0-9])", "{pid}", named) if pid >= 100 else named


@dataclass(frozen=True)
class JournalRule:
    """A ``record`` or ``crash`` rule of the trigger file, as the daemon reads it."""

    #: the arming's id (None: the trigger file's own key names it)
    run: object = None
    #: pid (as text) -> rank: only those processes and the ones they started (None: every
    #: process, its ``RANK``)
    ranks: dict[str, int] | None = None
    #: crash: the boundary ``(rank, file, op, ordinal)`` it strikes right after (or instead of)
    at: tuple[object, object, object, object] | None = None
    #: crash: it strikes instead of the boundary's operation
    before: bool = False
    #: crash: the process groups killed with the caller's
    kill: list[int] = field(default_factory=list)
    #: crash: a power loss, the snapshots of what was not yet durable kept here (None: a crash)
    snapshots: str | None = None
    #: record: a copy of the backing directory after each operation goes here (fusestates)
    states: str | None = None
    #: record: the bytes those copies may hold
    states_max: int = 0

    @classmethod
    def read(cls, spec: object) -> JournalRule | None:
        """The rule of a trigger file's ``record`` or ``crash`` value; None when it holds none."""
        if not isinstance(spec, dict) or not spec:
            return None
        at, ranks, kill = spec.get("at"), spec.get("ranks"), spec.get("kill") or []
        return cls(
            run=spec.get("run"),
            ranks={str(k): int(v) for k, v in ranks.items()} if isinstance(ranks, dict) else None,
            at=(at.get("rank"), at.get("path"), at.get("op"), at.get("ordinal")) if isinstance(at, dict) else None,
            before=bool(spec.get("before")),
            kill=[g for g in kill if isinstance(g, int)] if isinstance(kill, list) else [],
            snapshots=str(spec["snapshots"]) if spec.get("mode") == "power" and spec.get("snapshots") else None,
            states=str(spec["states"]) if spec.get("states") else None,
            states_max=int(spec.get("states_max") or 0),
        )


@dataclass(frozen=True)
class HoldRule:
    """``hold``: the first ``op`` call of process ``pid`` (or one it started; any process when
    None) is held inside the daemon until the trigger changes, or ``max_s`` seconds pass."""

    op: str = "write"
    pid: int | None = None
    max_s: float = 120.0


@dataclass(frozen=True)
class Rules:
    """What an armed layer does (:mod:`trainguard.faults.fusefs`, the ``rules`` policy): read
    from the trigger file's JSON (:meth:`read`), or a fixed policy's errno per operation."""

    #: operation -> errno it fails with
    errno: dict[str, int] = field(default_factory=dict)
    #: operation -> milliseconds added before it is served
    latency_ms: dict[str, float] = field(default_factory=dict)
    hold: HoldRule | None = None
    #: only calls on these paths (and under them) are touched (empty: every path)
    paths: list[str] = field(default_factory=list)
    record: JournalRule | None = None
    crash: JournalRule | None = None
    #: where the calls of the job are written down by what they observed (:mod:`.fuseseen`)
    observe: str | None = None

    @property
    def journal(self) -> JournalRule | None:
        """The rule the journal counts by: ``crash``, else ``record``."""
        return self.crash or self.record

    @classmethod
    def read(cls, data: object) -> Rules:
        """The rules of a trigger file's JSON (a value of another shape than the module's
        docstring says is no rule)."""
        if not isinstance(data, dict):
            return cls()
        codes, delays, hold, paths = (data.get(k) for k in ("errno", "latency_ms", "hold", "paths"))
        return cls(
            errno={str(k): v for k, v in codes.items() if isinstance(v, int)} if isinstance(codes, dict) else {},
            latency_ms=({str(k): float(v) for k, v in delays.items() if isinstance(v, int | float)}
                        if isinstance(delays, dict) else {}),
            hold=(HoldRule(str(hold.get("op", "write")), hold.get("pid"), float(hold.get("max_s", 120.0)))
                  if isinstance(hold, dict) else None),
            paths=[str(p) for p in paths] if isinstance(paths, list) else [],
            record=JournalRule.read(data.get("record")),
            crash=JournalRule.read(data.get("crash")),
            observe=str(data["observe"]) if isinstance(data.get("observe"), str) else None,
        )


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


class PowerLoss:
    """What a power loss would drop, kept as an undo log, and dropped at the crash: one
    pessimistic crash state per boundary (not every subset of what was pending).

    * a file's data written (or truncated) since its last ``fsync``/``fdatasync`` goes back to
      what it held then (a copy is kept at the first change after each sync);
    * a directory entry made or removed since its directory's last ``fsync`` (a create, a
      rename, a link, an unlink, a mkdir, an rmdir) is undone; a rename counts as durable once
      its destination's directory is synced.
    """

    def __init__(self, backing: str, snapshots: str) -> None:
        self.backing, self.snapshots = backing, snapshots
        self.log: list[tuple[Any, ...]] = []
        self.pending: set[int] = set()
        self.copies = 0
        os.makedirs(snapshots, exist_ok=True)

    def _real(self, path: str) -> str:
        return os.path.join(self.backing, path.lstrip("/"))

    def _copy(self, path: str) -> str | None:
        real = self._real(path)
        try:
            if not stat.S_ISREG(os.lstat(real).st_mode):  # a link is never followed
                return None
        except OSError:
            return None
        self.copies += 1
        keep = os.path.join(self.snapshots, str(self.copies))
        shutil.copyfile(real, keep)
        return keep

    @staticmethod
    def _dir(path: str) -> str:
        return os.path.dirname(path.rstrip("/")) or "/"

    def _content(self, path: str) -> None:
        with contextlib.suppress(OSError):
            ino = os.stat(self._real(path)).st_ino
            if ino not in self.pending:
                self.pending.add(ino)
                self.log.append(("content", path, ino, self._copy(path)))

    def before(self, op: str, path: str, to: str | None) -> None:
        """Keep what an operation about to be done would need to be undone."""
        if op in ("write", "truncate"):
            self._content(path)
        elif op == "create":
            if os.path.exists(self._real(path)):
                self._content(path)
            else:
                self.log.append(("created", path, self._dir(path)))
        elif op == "unlink":
            self.log.append(("unlinked", path, self._copy(path), self._dir(path)))
        elif op == "rename" and to is not None:
            self.log.append(("renamed", path, to, self._copy(to), self._dir(to)))
        elif op in ("mkdir", "rmdir"):
            self.log.append((op, path, self._dir(path)))
        elif op in ("link", "symlink") and to is not None:
            self.log.append(("linked", to, self._dir(to)))

    def durable(self, op: str, path: str, ino: int | None) -> None:
        """An fsync made a file's data durable, a directory's fsync its entries."""
        if op in ("fsync", "fdatasync") and ino is not None:
            self.pending.discard(ino)
            self.log = [e for e in self.log if not (e[0] == "content" and e[2] == ino)]
        elif op == "fsyncdir":
            here = path.rstrip("/") or "/"
            self.log = [e for e in self.log if e[0] == "content" or e[-1] != here]

    def drop(self) -> int:
        """Undo what was not durable, newest first; how many changes were undone."""
        undone = 0
        for entry in reversed(self.log):
            kind, path = entry[0], self._real(entry[1])
            with contextlib.suppress(OSError):
                if kind in ("content", "unlinked"):
                    keep = entry[3] if kind == "content" else entry[2]
                    if os.path.islink(path):  # written back in place, never through a link
                        os.unlink(path)
                    if keep is None:
                        os.truncate(path, 0)
                    else:
                        shutil.copyfile(keep, path)
                elif kind in ("created", "linked"):
                    os.unlink(path)
                elif kind == "renamed":
                    os.rename(self._real(entry[2]), path)
                    if entry[3] is not None:
                        with contextlib.suppress(FileNotFoundError):
                            os.unlink(self._real(entry[2]))
                        shutil.copyfile(entry[3], self._real(entry[2]))
                elif kind == "mkdir":
                    shutil.rmtree(path)
                elif kind == "rmdir":
                    os.mkdir(path)
                undone += 1
        self.log, self.pending = [], set()
        return undone


class Journal:
    """The ``record`` and ``crash`` rules, applied around the passthrough's calls."""

    def __init__(self, events: str, backing: str = "") -> None:
        self.events = events
        self.backing = backing
        self.power: PowerLoss | None = None
        self.states: StateCopies | None = None
        self.lock = threading.Lock()
        self.key: object = None
        self.counts: dict[tuple[int, str, str], int] = {}
        self.written = 0
        self.crashed = False
        self.ranks_of: dict[int, int | None] = {}
        self.opens: set[tuple[int, str, str]] = set()

    def _reset(self, key: object, rules: Rules) -> None:
        if self.key != key:
            self.key, self.counts, self.written, self.crashed, self.ranks_of = key, {}, 0, False, {}
            self.opens, self.states = set(), None
            crash = rules.crash
            self.power = (PowerLoss(self.backing, crash.snapshots) if crash is not None
                          and crash.snapshots is not None and self.backing else None)

    def _rank(self, pid: int, ranks: dict[str, int] | None) -> int | None:
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
    def _run(key: object, rules: Rules) -> object:
        spec = rules.journal
        return key if spec is None or spec.run is None else spec.run

    def before(self, key: object, rules: Rules, op: str = "", path: str = "",
               to: str | None = None, pid: int = 0) -> int | None:
        """The errno a call that would change the file system gets (after a crash: EIO; the
        boundary of a ``"before": true`` crash rule: EIO, the crash struck instead of the call); in
        power-loss mode, what undoing it would need is kept first."""
        with self.lock:
            self._reset(self._run(key, rules), rules)
            crash = rules.crash
            if self.crashed and crash is not None:
                return errno.EIO
            if crash is not None and crash.before and op and pid:
                rank = self._rank(pid, crash.ranks)
                name = boundary_path(path, pid)
                ordinal = self.counts.get((rank, name, op), 0) + 1 if rank is not None else 0
                if rank is not None and self._at(crash, rank, name, op, ordinal):
                    self._strike(crash, pid, op, name, rank, ordinal, before=True)
                    return errno.EIO
            if self.power is not None and op:
                self.power.before(op, path, to)
            return None

    @staticmethod
    def _at(crash: JournalRule, rank: int, name: str, op: str, ordinal: int) -> bool:
        return crash.at == (rank, name, op, ordinal)

    def _strike(self, crash: JournalRule, pid: int, op: str, name: str, rank: int, ordinal: int, *,
                before: bool = False) -> None:
        """SIGKILL to the caller's process group and every one in ``kill``; in power-loss mode
        what was not durable is dropped; a ``crashed`` event written."""
        self.crashed = True
        groups = list(crash.kill)
        with contextlib.suppress(OSError):
            groups.insert(0, os.getpgid(pid))
        for group in groups:
            with contextlib.suppress(ProcessLookupError, PermissionError, OSError, ValueError):
                os.killpg(int(group), signal.SIGKILL)
        dropped = self.power.drop() if self.power is not None else None
        self._emit({"event": "crashed", "op": op, "path": name, "rank": rank, "ordinal": ordinal,
                    "t": time.time(), **({"before": True} if before else {}),
                    **({"undone": dropped} if dropped is not None else {})})

    def _copy(self, rules: Rules, path: str, to: object,
              write: tuple[int, int] | None = None) -> tuple[int, float] | None:
        """A ``record`` rule with ``states``: the backing directory copied as this operation left
        it (:mod:`trainguard.faults.fusestates`)."""
        spec = rules.record
        if rules.crash is not None or spec is None or spec.states is None or not self.backing:
            return None
        if self.states is None or self.states.folder != spec.states:
            self.states = StateCopies(self.backing, spec.states, spec.states_max)
        return self.states.copy((path, str(to)) if to else (path,), write)

    def opened(self, key: object, rules: Rules, path: str, pid: int, mode: str) -> None:
        """A file opened by ``pid`` to ``read`` or to ``append`` (``mode``): an ``opened`` event,
        the first time that rank opens that file so."""
        spec = rules.journal
        if spec is None:
            return
        with self.lock:
            self._reset(self._run(key, rules), rules)
            rank = self._rank(pid, spec.ranks)
            if rank is None:
                return
            seen = (rank, boundary_path(path, pid), mode)
            if seen in self.opens or len(self.opens) >= _MAX_OPENS:
                return
            self.opens.add(seen)
            self._emit({"event": "opened", "path": seen[1], "rank": rank, "mode": mode, "pid": pid,
                        "t": time.time()})

    def after(self, key: object, rules: Rules, op: str, path: str, pid: int, **extra: Any) -> None:
        """Count the operation just done; crash right after it when it is the boundary."""
        spec = rules.journal
        if spec is None:
            return
        ranks = spec.ranks
        with self.lock:
            self._reset(self._run(key, rules), rules)
            if self.crashed:
                return
            if self.power is not None and op in ("fsync", "fdatasync", "fsyncdir"):
                self.power.durable(op, path, extra.pop("ino", None))
            extra.pop("ino", None)
            rank = self._rank(pid, ranks)
            if rank is None:
                return
            name = boundary_path(path, pid)
            counted = (rank, name, op)
            self.counts[counted] = ordinal = self.counts.get(counted, 0) + 1
            if self.written < _MAX_OPS:
                self.written += 1
                write = (int(extra["offset"]), int(extra["bytes"])) if op == "write" and "offset" in extra else None
                copied = self._copy(rules, path, extra.get("to"), write)
                if copied is not None:
                    extra["state"], extra["copy_s"] = copied
                if "to" in extra:
                    extra["to"] = boundary_path(str(extra["to"]), pid)
                self._emit({"event": "op", "op": op, "path": name, "rank": rank, "ordinal": ordinal,
                            "pid": pid, "t": time.time(), **extra})
            crash = rules.crash
            if crash is not None and not crash.before and self._at(crash, rank, name, op, ordinal):
                self._strike(crash, pid, op, name, rank, ordinal)
