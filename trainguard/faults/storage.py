"""``storage``: the checkpoint directory's storage misbehaves from step ``after_step`` on.

``params.kind`` says how (docs/faults-memory-and-disk.md):

* ``eio_write``: every write under the checkpoint directory fails with EIO;
* ``fsync``: fsync and fdatasync (of a file or the directory) fail with EIO;
* ``slow``: ``latency_ms`` added to every write (``op: write``) or fsync (``op: fsync``); the
  report gives the job's step times before and during, the checkpoint stall and the seconds the
  layer added (its share of the time);
* ``eio_read``: the run is stopped (SIGKILL to every rank) after step k, then every read of the
  newest complete checkpoint's files fails with EIO, for the resume (a bad sector under the
  latest checkpoint);
* ``corrupt``: the run is stopped (SIGKILL to every rank) after step k, then one bit of one byte
  of the newest complete checkpoint (its largest file, ``offset`` or the middle) is flipped on
  disk, then the job resumes.

Mechanism: a passthrough FUSE layer (:mod:`trainguard.faults.fusefs`, policy ``rules``) over the
checkpoint directory for every kind but ``corrupt``, which writes the flipped byte straight into
the backing file. The kernel forwards every call of every writer to the layer (torch.save's C++
writer, safetensors, ``cp``), which a Python-level hook cannot fail. Without root, /dev/fuse,
libfuse or mfusepy those kinds are skipped with the reason (there is no fallback: a Python-level
hook would miss torch.save's own writes). ``corrupt`` needs none of it.
"""

from __future__ import annotations

import dataclasses
import errno
import itertools
import os
import re
import signal
import stat
import statistics
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from trainguard.config.fault_params import FaultParams
from trainguard.config.faults import Expectation
from trainguard.evidence import UNSET, Evidence, Unset
from trainguard.faults.base import FaultContext, FaultEvidence, FaultUnavailable
from trainguard.faults.fusefs import JournalEvent, fuse_unavailable, journal
from trainguard.faults.fusemount import FuseFault
from trainguard.report import SkipReason
from trainguard.unit.checkpoints import latest_complete_checkpoint
from trainguard.unit.checkpoints.files import is_temp_name, step_in_name

if TYPE_CHECKING:  # pragma: no cover
    from trainguard.launch import Launcher, RunResult

__all__ = ["RESUME_KINDS", "STORAGE_KINDS", "SlowStep", "SlowStorage", "StorageEvidence", "StorageFault", "StruckCheckpoint",
           "fsync_fault_causes", "newest_checkpoint_files", "stop_all_ranks"]

STORAGE_KINDS = ("eio_write", "eio_read", "fsync", "slow", "corrupt")
#: kinds that stop the run after step k and strike the resume
RESUME_KINDS = ("eio_read", "corrupt")
#: the layer's rules per kind; ``fsync`` also records every file operation (the journal's
#: ``record`` rule): a job that never fsyncs meets no failing call, and only the record of what it
#: wrote shows why (:func:`fsync_fault_causes`)
_RULES: dict[str, dict[str, dict[str, int | str]]] = {"eio_write": {"errno": {"write": errno.EIO}},
                                                      "fsync": {"errno": {"fsync": errno.EIO}, "record": {"run": "storage-fsync"}}}
#: the journal's operations that put data in a file
_WRITE_OPS = ("create", "write", "truncate")


def newest_checkpoint_files(directory: Path, rank: int = 0, *, own_rank: bool = False
                            ) -> tuple[Path | None, int | None, list[Path]]:
    """The newest complete checkpoint under ``directory``: (its path, its step, its files, the
    largest first). A layout :func:`latest_complete_checkpoint` does not know (per-rank JSON files,
    say) is read by name: the highest step in a non-temporary file name, then the newest write;
    its files are those of that step (``rank``'s own first among equals; with ``own_rank``, of
    per-rank files, ``rank{rank}`` in the name, only ``rank``'s own)."""
    found = latest_complete_checkpoint(directory)
    if found is not None:
        # links are never struck: one may lead out of the checkpoint (the flip would land there)
        files = [found] if found.is_file() else [p for p in found.rglob("*") if _regular(p)]
        files = [p for p in files if _regular(p)]
        files.sort(key=lambda p: -p.stat().st_size)
        return found, step_in_name(found.name), files
    candidates: list[tuple[int, float, Path]] = []
    for root, _, names in os.walk(directory):
        for name in names:
            if is_temp_name(name) or name.endswith(".lock"):
                continue
            path = Path(root) / name
            try:
                st = path.lstat()
            except OSError:
                continue
            if not path.is_symlink() and st.st_size > 0:  # an empty file is a torn write
                candidates.append((step_in_name(name) or -1, st.st_mtime, path))
    mine = [c for c in candidates if re.search(rf"rank{rank}(?!\d)", c[2].name)]
    if own_rank and mine:
        candidates = mine
    if not candidates:
        return None, None, []
    step, _, newest = max(candidates, key=lambda c: (c[0], c[1]))
    same = [c[2] for c in candidates if c[0] == step] if step >= 0 else [newest]
    same.sort(key=lambda p: (-p.stat().st_size, f"rank{rank}" not in p.name, p.name))
    return newest, (step if step >= 0 else None), same


def fsync_fault_causes(events: list[JournalEvent]) -> list[str]:
    """Why a job completed although every fsync under its checkpoint directory failed, from the
    layer's events while the fault was on (the journal's ``op`` and ``opened`` events, the
    ``eio`` events of the failed calls), most likely first: fsync calls that failed and were let
    go; files written straight to their final name and never fsynced (in place); files renamed
    into place with no fsync first. A file opened to append is a log. Empty when the events show
    none of these (no journal: a layer without the ``record`` rule)."""
    failed = [e for e in events if e.event == "eio" and e.op == "fsync"]
    logs = {(e.rank, e.path) for e in events if e.event == "opened" and e.mode == "append"}
    written: dict[tuple[int | None, str], None] = {}  # in the order first written
    synced: set[tuple[int | None, str]] = set()
    renamed: dict[tuple[int | None, str], str | None] = {}
    for e in events:
        key = (e.rank, e.path)
        if e.event != "op" or key in logs:
            continue
        if e.op in _WRITE_OPS:
            written.setdefault(key)
        elif e.op in ("fsync", "fdatasync"):
            synced.add(key)
        elif e.op == "rename":
            renamed[key] = e.to
    tried = {e.path for e in failed}  # fsynced, or as good as: the job asked
    unsynced = [key for key in written if key not in synced and key[1] not in tried]
    in_place = [key for key in unsynced if key not in renamed]
    moved = [key for key in unsynced if key in renamed]
    causes = []
    if failed:
        causes.append(f"the error is caught and swallowed: {len(failed)} fsync call(s) under the checkpoint "
                      f"directory failed with EIO ({failed[0].path} first) and the job completed "
                      "(exit 0) as if its checkpoints were durable")
    if in_place:
        (rank, path), more = in_place[0], len(in_place) - 1
        causes.append("the checkpoint is written in place and never fsynced (no temp file + fsync + rename): "
                      f"under the fault rank {rank} wrote {path} straight to its final name"
                      + (f" (and {more} more file(s) alike)" if more else "")
                      + " and called no fsync, so the failing fsync never reached the job; a power loss "
                      "loses or tears what it wrote")
    if moved:
        (rank, path), more = moved[0], len(moved) - 1
        causes.append(f"the checkpoint is renamed into place with no fsync first: under the fault rank {rank} "
                      f"wrote {path} and renamed it to {renamed[(rank, path)]}"
                      + (f" (and {more} more file(s) alike)" if more else "")
                      + " without an fsync, so the failing fsync never reached the job; a power loss "
                      "publishes an empty or short file")
    return causes


def _regular(path: Path) -> bool:
    """A regular file that is not a link (lstat: the link itself, never where it leads)."""
    try:
        return stat.S_ISREG(path.lstat().st_mode)
    except OSError:
        return False


def stop_all_ranks(launcher: Launcher, timeout: float = 5.0) -> list[int]:
    """SIGKILL every running rank and wait (at most ``timeout``) until they are gone: the machine
    went away. The ranks it killed."""
    alive = [rp.rank for rp in launcher.ranks if rp.popen.poll() is None]
    for rank in alive:
        launcher.kill_rank(rank, signal.SIGKILL)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(rp.popen.poll() is None for rp in launcher.ranks):
        time.sleep(0.005)
    return alive


@dataclass
class StruckCheckpoint(Evidence):
    """The checkpoint an ``eio_read`` or ``corrupt`` fault struck: the newest complete one, its
    step and files (the largest first, 20 at most); for ``corrupt``, the byte it flipped."""

    checkpoint: str
    step: int | None
    files: list[str]
    file: str | Unset = UNSET
    offset: int | Unset = UNSET
    size: int | Unset = UNSET
    byte_before: str | Unset = UNSET
    byte_after: str | Unset = UNSET


@dataclass
class SlowStep(Evidence):
    step: int
    seconds: float


@dataclass
class SlowStorage(Evidence):
    """``slow``: the step times before and during the fault, the checkpoint stall and what the
    FUSE layer added (the slowest process's seconds, and all processes')."""

    latency_ms: float
    op: str
    step_time_before_s: float | None
    step_time_during_s: float | None
    slowest_step_during: SlowStep | None
    layer_delayed_calls: int
    layer_added_s: float
    layer_added_s_all_processes: float
    layer_processes: int
    layer_share_of_time: float
    window_s: float
    checkpoint_stall_s: float | Unset = UNSET
    stall_share_of_step_time: float | Unset = UNSET


@dataclass
class StorageEvidence(FaultEvidence):
    """What a ``storage`` fault did: how it reached the files, the rules its layer ran, what it
    struck and the calls that failed (or were slowed)."""

    kind: str
    mechanism: str | None
    #: the FUSE layer's rules (its list of struck paths left out)
    rules: dict[str, Any] | Unset = UNSET
    stopped_ranks: list[int] | Unset = UNSET
    target: StruckCheckpoint | Unset = UNSET
    eio_calls: int | Unset = UNSET
    eio_paths: list[str] | Unset = UNSET
    backing_dir: str | Unset = UNSET
    slow_storage: SlowStorage | Unset = UNSET
    problems: list[str] | Unset = UNSET


class StorageFault(FuseFault):
    """EIO on write, read or fsync, added latency, or a flipped byte under the checkpoint dir."""

    kind: ClassVar[str] = "storage"
    strikes_every_rank: ClassVar[bool] = True
    expectations: ClassVar[tuple[Expectation, ...]] = (Expectation.FAIL_CLEAN, Expectation.RECOVER, Expectation.CONTINUE)
    kind_expectations: ClassVar[Mapping[str, tuple[Expectation, ...]]] = {
        "slow": (Expectation.CONTINUE,),
        **dict.fromkeys(("corrupt", "eio_read", "eio_write", "fsync"), (Expectation.FAIL_CLEAN, Expectation.RECOVER)),
    }
    defaults: ClassVar[FaultParams] = FaultParams({"kind": None, "latency_ms": None, "op": None, "offset": None})

    def __init__(self, params: FaultParams | None = None, **kwargs: Any) -> None:
        super().__init__(params, **kwargs)
        self.backing: Path | None = None
        self.mechanism: str | None = None
        self.rules: dict[str, Any] | None = None
        self.stopped_ranks: list[int] = []
        self.target: StruckCheckpoint | None = None  # eio_read / corrupt: the checkpoint struck
        self.armed_wall: float | None = None
        self.cleared_wall: float | None = None
        self.elapsed_offset: float | None = None  # time.time() - launcher.elapsed()
        self.slow: SlowStorage | None = None

    @classmethod
    def validate(cls, params: FaultParams) -> list[tuple[str, str]]:
        problems = super().validate(params)
        kind = params.raw("kind")
        if kind not in STORAGE_KINDS:
            problems.append(("kind", f"expected one of {', '.join(STORAGE_KINDS)}, got "
                             f"{str(kind)[:40]!r}; e.g. `params: {{kind: eio_write}}`"))
            return problems
        for key in ("latency_ms", "op"):
            if kind != "slow" and params.raw(key) is not None:
                problems.append((key, "applies to `kind: slow` only; remove it or set `kind: slow`"))
        if kind == "slow":
            latency = params.raw("latency_ms")
            if (isinstance(latency, bool) or not isinstance(latency, (int, float))
                    or not 0 < latency <= 60000):  # NaN fails the comparison; ints never overflow it
                problems.append(("latency_ms", "expected the milliseconds added to each call, more "
                                 "than 0 and at most 60000, e.g. `latency_ms: 200`"))
            if params.raw("op", "write") not in (None, "write", "fsync"):
                problems.append(("op", f"expected write or fsync, got {str(params.raw('op'))[:40]!r}"))
        offset = params.raw("offset")
        if offset is not None and kind != "corrupt":
            problems.append(("offset", "applies to `kind: corrupt` only; remove it"))
        elif offset is not None and (isinstance(offset, bool) or not isinstance(offset, int) or offset < 0):
            problems.append(("offset", "expected the byte offset in the checkpoint's largest file "
                             "(a whole number >= 0), or leave it out for the middle of the file"))
        return problems

    @property
    def storage_kind(self) -> str:
        return self.params.text("kind")

    # -- life cycle --------------------------------------------------------------------------

    def setup(self, ctx: FaultContext) -> None:
        self.backing = ctx.checkpoint_dir
        if self.storage_kind == "corrupt":
            self.mechanism = "direct: the byte is flipped in the checkpoint file on disk"
            return
        why = self.mount_over_checkpoints(ctx, "storage-fuse", policy="rules", unavailable=fuse_unavailable())
        if why is None:
            self.mechanism = "fuse: a passthrough FUSE layer over the checkpoint directory"
            return
        raise FaultUnavailable(
            f"{why}; storage kind {self.storage_kind} needs a FUSE layer over the checkpoint "
            "directory (root, /dev/fuse, libfuse3 and mfusepy): a Python-level hook would miss "
            "torch.save's own writes", needs=SkipReason.NEEDS_ROOT)

    def inject(self, launcher: Launcher) -> None:
        self.injected_at = launcher.elapsed()
        self.elapsed_offset = time.time() - self.injected_at
        kind = self.storage_kind
        if kind in RESUME_KINDS:
            self.stopped_ranks = stop_all_ranks(launcher)
            self.strike_latest()
            return
        self.arm_on_the_run()

    def arm_on_the_run(self) -> None:
        """Arm the layer with the rules of a kind that strikes the running job (``eio_write``,
        ``fsync``, ``slow``)."""
        if self.storage_kind == "slow":
            on = self.params.optional_text("op") or "write"
            self.rules = {"latency_ms": {on: float(self.params.number("latency_ms"))}}
        else:
            self.rules = dict(_RULES[self.storage_kind])
        self.arm()

    def arm(self) -> None:
        """(Re-)arm the layer's rules: the resume judge re-arms an ``eio_read`` drill's rules for
        its own resume run after :meth:`clear`."""
        if self.layer is not None and self.rules is not None:
            self.layer.arm(self.rules)
            self.armed_wall = self.armed_wall or time.time()

    def strike_latest(self) -> None:
        """eio_read / corrupt, once the ranks are dead: strike the newest complete checkpoint
        (arm reads of its files to fail, or flip one bit of its largest file); ``target`` says
        which, ``problems`` why nothing was struck."""
        assert self.backing is not None
        found, step, files = newest_checkpoint_files(self.backing, self.rank)
        if found is None or not files:
            self.problems.append(f"no complete checkpoint under {self.backing} when the run was "
                                 "stopped: nothing to strike (does the job checkpoint before after_step?)")
            return
        target = self.target = StruckCheckpoint(str(found), step, [str(p) for p in files[:20]])
        if self.storage_kind == "eio_read":
            self.rules = {"errno": {"read": errno.EIO},
                          "paths": ["/" + p.relative_to(self.backing).as_posix() for p in files]}
            self.arm()
            return
        largest = files[0]
        size = largest.stat().st_size
        if size == 0:
            self.problems.append(f"{largest} is empty: no byte to flip")
            return
        given = self.params.raw("offset")
        offset = size // 2 if given is None else min(self.params.integer("offset"), size - 1)
        try:  # O_NOFOLLOW: a file swapped for a link since it was chosen is not written through
            fd = os.open(largest, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError as exc:
            self.problems.append(f"{largest} cannot be opened to flip a byte ({exc.strerror}); not struck")
            return
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            self.problems.append(f"{largest} is not a regular file; not struck")
            return
        with os.fdopen(fd, "r+b") as handle:
            handle.seek(offset)
            before = handle.read(1)
            after = bytes([before[0] ^ 0x01])
            handle.seek(offset)
            handle.write(after)
            handle.flush()
            os.fsync(handle.fileno())
        target.file, target.offset, target.size = str(largest), offset, size
        target.byte_before, target.byte_after = before.hex(), after.hex()

    def clear(self) -> None:
        if self.layer is not None:
            self.layer.disarm()
            if self.armed_wall is not None and self.cleared_wall is None:
                self.cleared_wall = time.time()

    # -- reporting ---------------------------------------------------------------------------

    def layer_events(self, *names: str) -> list[dict[str, Any]]:
        if self.layer is None:
            return []
        return [e for e in self.layer.read_events() if not names or e.get("event") in names]

    def evidence(self) -> StorageEvidence:
        out = StorageEvidence(*self.struck(), kind=self.storage_kind, mechanism=self.mechanism,
                              stopped_ranks=self.stopped_ranks or UNSET, problems=list(self.problems) or UNSET)
        if self.rules is not None:
            out.rules = {k: v for k, v in self.rules.items() if k not in ("paths", "record")}
        if self.target is not None:
            out.target = dataclasses.replace(self.target)  # a copy, as the report holds it now
        eio = self.layer_events("eio")
        if self.layer is not None:
            out.eio_calls = len(eio)
            out.eio_paths = sorted({f"{e.get('path')} ({e.get('op')})" for e in eio})[:10]
            out.backing_dir = str(self.layer.backing)
        if self.slow is not None:
            out.slow_storage = self.slow
        return out

    def likely_causes(self, result: RunResult) -> list[str]:
        """``fsync``, when the job completed despite it: what the layer saw it do under the
        fault (:func:`fsync_fault_causes`)."""
        if self.storage_kind != "fsync" or not result.ok:
            return []
        return fsync_fault_causes(journal(self.layer_events()))

    def classify(self, result: RunResult) -> str:
        from trainguard.faults.hook import rank_stderr

        for rank in [self.rank, *[r for r in range(result.world_size) if r != self.rank]]:
            text = rank_stderr(result, rank)
            line = next((ln.strip() for ln in reversed(text.splitlines())
                         if "Input/output error" in ln or "[Errno 5]" in ln), None)
            if line is not None:
                return f"EIO on rank {rank}: {line[:200]}"
        killed = {e.rank for e in result.exits if e.signal == "SIGKILL"}
        if self.stopped_ranks and killed and killed <= set(self.stopped_ranks):
            return (f"stopped by the drill (SIGKILL to rank(s) {', '.join(map(str, self.stopped_ranks))}) "
                    f"to strike the checkpoint of step {None if self.target is None else self.target.step}")
        if result.ok:
            return f"handled by the job (it completed despite {self.storage_kind})"
        return result.reason or result.outcome

    def verify_continue(self, result: RunResult) -> list[str]:
        """slow: the step times before and during, the checkpoint stall and the layer's seconds."""
        if self.storage_kind != "slow" or self.injected_at is None:
            return []
        delayed = self.layer_events("delayed")
        offset = self.elapsed_offset or 0.0
        start = self.injected_at
        end = (self.cleared_wall - offset) if self.cleared_wall is not None else result.duration_s
        ranks = sorted({p.rank for p in result.points})
        watched = self.rank if self.rank in ranks else (ranks[0] if ranks else self.rank)
        names = [p.name for p in result.points if p.rank == watched]
        metric = "loss" if "loss" in names else (names[0] if names else "loss")
        points = sorted((p for p in result.points if p.rank == watched and p.name == metric),
                        key=lambda p: p.step)
        gaps = [(b.step, b.t - a.t, b.t) for a, b in itertools.pairwise(points) if b.step == a.step + 1]
        before = [g for _, g, t in gaps if t <= start][1:]  # the first gap pays start-up
        during = [(s, g) for s, g, t in gaps if start < t <= end]
        typical = statistics.median(before) if before else None
        per_pid: dict[Any, float] = {}
        for e in delayed:
            if start <= float(e.get("t", 0.0)) - offset <= end:
                per_pid[e.get("pid")] = per_pid.get(e.get("pid"), 0.0) + float(e.get("added_s", 0.0))
        added = max(per_pid.values(), default=0.0)  # the ranks wait in parallel: the slowest one's
        window = max(end - start, 1e-9)
        out = SlowStorage(
            latency_ms=self.params.number("latency_ms"), op=self.params.optional_text("op") or "write",
            step_time_before_s=None if typical is None else round(typical, 4),
            step_time_during_s=round(statistics.median([g for _, g in during]), 4) if during else None,
            slowest_step_during=None,
            layer_delayed_calls=len(delayed),
            layer_added_s=round(added, 3),
            layer_added_s_all_processes=round(sum(per_pid.values()), 3),
            layer_processes=len(per_pid),
            layer_share_of_time=round(added / window, 3),
            window_s=round(window, 3),
        )
        if during:
            step, worst = max(during, key=lambda sg: sg[1])
            out.slowest_step_during = SlowStep(step, round(worst, 4))
            if typical is not None:
                out.checkpoint_stall_s = round(max(0.0, worst - typical), 4)
                stalls = [max(0.0, g - typical) for _, g in during]
                out.stall_share_of_step_time = round(sum(stalls) / max(sum(g for _, g in during), 1e-9), 3)
        self.slow = out
        return []
