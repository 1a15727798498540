"""``checks.crash_points``: every crash point of one checkpoint save, explored
(docs/crash-points.md).

A FUSE layer (:mod:`trainguard.faults.fusefs`) lies over the checkpoint directory. One run of the
job records every file operation its ranks make (:mod:`trainguard.faults.fusejournal`), and a
restart of it with ``resume_args`` which files it opens: the save explored is the first burst
after step ``after_step`` that writes a file the restart reads, never a log
(:mod:`trainguard.drills.crash_saves`). Each of its operations is a *boundary*, named ``(rank,
file, op, ordinal)``. Then, for each boundary (all of them up to ``max_boundaries``; above
it every operation that is not a write, then writes spread over each file, the counts reported),
a fresh run of the job is crashed right after that boundary (SIGKILL to every rank from the
daemon; nothing after it reaches the disk) and restarted with ``resume_args``. A boundary whose
crash leaves the same state as one run, or a write between two writes of a file whose restarts
did the same, takes that outcome instead (:mod:`~trainguard.drills.crash_infer`); in kill mode a
crash run starts from a copy of the checkpoint before the save, not from step 1
(:mod:`~trainguard.drills.crash_start`). Each restart is judged against the uninterrupted run:

* ``safe``: it resumed from a checkpoint and matched the uninterrupted run from there, or it
  trained no step and what the crash left is the uninterrupted run's final checkpoint;
* ``crashed on load``: the restart failed (a torn file it could not read);
* ``trained nothing``: it exited 0 without a step, though steps were left after the save (or
  what the crash left is not the final checkpoint): Megatron's ``read_metadata`` exits so on a
  tracker it cannot read;
* ``torn``: it resumed and diverged from the uninterrupted run (it loaded a torn checkpoint);
  the first time a restart diverges with none matched before, a control tells this from a resume
  that is never exact: a kill just before the save began, resumed. When that diverges too, the
  restarts that diverged are ``loaded`` (not judged) and the check ends in an error unless
  another outcome is unsafe;
* ``began again``: it started from the first step although an earlier crash point resumed;
* ``went back``: it resumed from an older checkpoint than a crash at an earlier boundary of the
  same save did (the save destroyed a checkpoint that was complete);
* ``not reached``: the run never made that operation (the job's saves differ between runs).

The first unsafe boundary is named with its operation and the fix. ``mode: kill`` is a process
crash: what the kernel had accepted stays. ``mode: power`` is a power loss: at the crash the
daemon also drops what was not durable (:class:`~trainguard.faults.fusejournal.PowerLoss`: data
not fsynced, directory entries whose directory was not fsynced), one pessimistic state per
boundary.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import shutil
import time
from collections.abc import Hashable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, model_validator

from trainguard._internal.atomic import atomic_write_text
from trainguard.checks.context import CheckContext
from trainguard.checks.equivalence import compare_trajectories
from trainguard.config.checks import CheckSpec
from trainguard.config.problems import resume_problems
from trainguard.config.registry import Check, Run
from trainguard.drills.crash_fix import fix_for, top_folder
from trainguard.drills.crash_infer import Inference, crash_states
from trainguard.drills.crash_lanes import MOST_LANES, explore_in_lanes, inferred, lane_count
from trainguard.drills.crash_plan import crash_plan_words, plan_lanes
from trainguard.drills.crash_records import (
    Boundary,
    BoundaryNotReached,
    BoundaryOutcome,
    CrashPointsEvidence,
    CrashRow,
    CrashRule,
)
from trainguard.drills.crash_restore import RecordStates, keep_final, restore, states_of
from trainguard.drills.crash_saves import (
    feeds_restart,
    save_bursts,
    save_files,
    shape,
    unlike_reference,
)
from trainguard.drills.crash_seen import (
    Observed,
    View,
    agree,
    crash_views,
    observe,
    op_pids,
    read_observed,
)
from trainguard.drills.crash_start import (
    CopyAtStep,
    SaveStart,
    StepWatch,
    save_start,
    unlike_a_run_from_step_1,
)
from trainguard.drills.evidence import ReferenceNotUsable
from trainguard.evidence import NoEvidence
from trainguard.faults.fusefs import FuseLayer, JournalEvent, fuse_unavailable, journal
from trainguard.faults.fusemount import FuseMount
from trainguard.launch import MetricPoint, RunResult
from trainguard.launch.metrics import aligned_trajectories, first_step
from trainguard.launch.rundir import new_run_dir
from trainguard.report import CheckResult, SkipReason
from trainguard.run.pool import RunPool
from trainguard.run.request import RunRequest

__all__ = ["CRASH_POINTS", "CrashPointsCheck", "choose_boundaries", "run_crash_points"]

_NAME = "crash_points"


class CrashPointsCheck(CheckSpec):
    """``checks.crash_points``: the save after ``after_step``, crashed after each of its file
    operations in turn, each crash resumed and compared with the uninterrupted run."""

    steps: int = Field(20, ge=2)
    after_step: int = Field(ge=1)
    #: a save is a burst of file operations: each starting at most this long after the one
    #: before ended (keep it below the time between two saves)
    gap_s: float = Field(0.25, gt=0, le=60)
    max_boundaries: int = Field(16, ge=1, le=1000)
    #: ``kill``: a process crash (what the kernel accepted stays); ``power``: a power loss (data
    #: not fsynced and directory entries whose directory was not fsynced are dropped)
    mode: Literal["kill", "power"] = "kill"
    #: boundaries whose crash leaves the same state as one run, or between two writes of a file
    #: whose restarts did the same, take that outcome instead of a run of their own (false: every
    #: boundary explored is run)
    infer: bool = True
    #: kill mode: each crash run resumes from a copy of the checkpoint before the save, kept by
    #: the recording run, instead of training from step 1 (false: from step 1)
    from_save: bool = True
    #: kill mode: the recording run copies the directory after each operation of the save, up to
    #: this many MiB, and each boundary copied needs a restart only, no crash run (0: none)
    state_copies_mib: int = Field(256, ge=0)
    #: boundaries run side by side, each in a FUSE layer of its own (None: as many as the cores
    #: hold the job's ranks; 1: one after the other)
    lanes: int | None = Field(None, ge=1, le=MOST_LANES)
    rtol: float = Field(0.0, ge=0)
    atol: float = Field(0.0, ge=0)

    @model_validator(mode="after")
    def _room_after(self) -> CrashPointsCheck:
        if self.after_step >= self.steps:
            raise ValueError(f"after_step ({self.after_step}) must be smaller than steps ({self.steps}): the "
                             "save after it must happen, and steps after it be compared")
        return self


def choose_boundaries(found: list[Boundary], limit: int) -> list[Boundary]:
    """All of ``found`` up to ``limit``; above it every operation that is not a write first (in
    order), then writes spread evenly over the rest (the first and last of each file first)."""
    if len(found) <= limit:
        return list(found)
    chosen = [b for b in found if b.op != "write"][:limit]
    writes = [b for b in found if b.op == "write"]
    ends: list[Boundary] = []
    for path in dict.fromkeys(b.path for b in writes):
        mine = [b for b in writes if b.path == path]
        ends += [mine[0]] + ([mine[-1]] if len(mine) > 1 else [])
    rest = [b for b in writes if b not in ends]
    room = limit - len(chosen)
    picked = ends[:room]
    room -= len(picked)
    if room > 0 and rest:
        stride = len(rest) / room
        picked += [rest[int(i * stride)] for i in range(min(room, len(rest)))]
    keep = set(chosen) | set(picked)
    return [b for b in found if b in keep]


def _write_table(evidence: CrashPointsEvidence, work: Path, verdict: str) -> None:
    """``table.md``: one row per boundary (its operation, outcome, the step resumed from, why)."""
    def cell(text: Any) -> str:
        return str(text).replace("|", "\\|").replace("\n", " ")

    rows = [f"# crash_points ({evidence.mode} mode): the save after step {evidence.after_step}", "", cell(verdict),
            "", "| boundary | outcome | resumed from | detail |", "|---|---|---|---|"]
    for r in evidence.outcomes + ([evidence.control] if evidence.control else []):
        rows.append(f"| {cell(r.boundary)} | {cell(r.outcome)} | {cell(r.resumed_from_step)} | {cell(r.detail)} |")
    with contextlib.suppress(OSError):  # the verdict stands without its table
        evidence.table = str(atomic_write_text(work / "table.md", "\n".join(rows) + "\n"))


@dataclass
class SaveFound:
    """The save explored: its boundaries; whether a checkpoint was written before it (one a crash
    in this save must not lose); whether no later save followed it (the run's last); the files
    it left under their final names (logs aside)."""

    boundaries: list[Boundary]
    checkpoint_before: bool
    last: bool
    files: list[str] = field(default_factory=list)
    #: what a crash after each boundary leaves, from the journal (:func:`crash_states`)
    states: list[Hashable | None] = field(default_factory=list)
    #: where each crash run starts (:mod:`~trainguard.drills.crash_start`)
    start: SaveStart = field(default_factory=lambda: SaveStart(None, "step 1"))
    #: the state the recording left right after a boundary (:mod:`~trainguard.drills.crash_restore`)
    restored: dict[Boundary, Path] = field(default_factory=dict)
    #: the restart of the recording run, launched on a boundary's copy: the restart of the
    #: boundaries whose crash leaves that state
    reused: dict[Hashable, RunResult] = field(default_factory=dict)
    #: the recording run, its checkpoint directory as it ended: the uninterrupted run when the
    #: session kept none
    recorded: RunResult | None = None
    #: kill mode: what a crash after each boundary leaves, and what the restart of each run
    #: boundary observed (crash_seen); the recording's pids and what its restart observed
    views: list[View | None] = field(default_factory=list)
    seen: dict[Boundary, Observed | None] = field(default_factory=dict)
    pids: set[int] = field(default_factory=set)
    reused_seen: Observed | None = None


def _save_ops(events: list[JournalEvent], arrivals: list[tuple[int, float]], after_step: int,
              gap_s: float, reads: set[str] | None = None, appended: set[str] | None = None) -> SaveFound:
    """The first save that began after the line of step ``after_step`` arrived: a burst of
    operations (:func:`save_bursts`: a save whole, a slow fsync not splitting it, frequent saves
    apart) that writes a file a restart reads (``reads``, their :func:`shape`; None: any burst),
    never a log (``appended``)."""
    ops = [e for e in events if e.event == "op"]
    seen = [t for step, t in arrivals if step >= after_step]
    if not ops or not seen:
        return SaveFound([], False, False)
    bursts = save_bursts(ops, arrivals, gap_s)

    def feeds(e: JournalEvent) -> bool:
        return reads is None or feeds_restart(e.op, e.path, e.to, reads, appended or set())

    # the first burst after the line that starts a save: one that only finishes a folder an
    # earlier burst began (an async save's marker) belongs to that earlier save
    begun: set[str] = set()
    index = None
    for i, b in enumerate(bursts):
        tops = {top_folder(e.path) for e in b}
        if b[0].start > seen[0] and not tops <= begun and any(feeds(e) for e in b):
            index = i
            break
        begun |= {top_folder(e.path) for e in b if "/" in e.path.strip("/") or e.op == "mkdir"}
    # a checkpoint before it: data written to what a restart reads (a directory made at start-up
    # or a log is none)
    wrote = any(e.op in ("write", "rename", "link") and feeds(e) for b in bursts[:index] for e in b)
    if index is None:
        return SaveFound([], wrote, False)
    # a save into a folder of its own goes on in later bursts when it finishes in the background
    # (an async save whose files are written while the next steps run, its marker committed at
    # the next save): every later operation that builds that folder belongs to it
    folders = {top_folder(e.path) for e in bursts[index] if "/" in e.path.strip("/")}
    later = [e for b in bursts[index + 1:] for e in b
             if folders and top_folder(e.path) in folders and e.op not in ("unlink", "rmdir")]
    taken = {id(e) for e in later}
    after = [e for b in bursts[index + 1:] for e in b if id(e) not in taken]
    save = [Boundary(int(e.rank or 0), e.path, e.op, e.ordinal, e.to) for e in bursts[index] + later]
    return SaveFound(save, wrote, not any(feeds(e) for e in after))


def run_crash_points(ctx: CheckContext[CrashPointsCheck]) -> CheckResult:
    """Record the save of the run, crash after each boundary of it, resume and compare with the
    uninterrupted run (its launches are its declared runs, admitted by the pool)."""
    started = time.monotonic()
    why = fuse_unavailable()
    if why is not None:
        return CheckResult(_NAME, "skipped", f"{why}: crash_points records and crashes the job's saves in a "
                           "FUSE layer over its checkpoint directory (root, /dev/fuse, libfuse3, mfusepy)",
                           NoEvidence(), time.monotonic() - started, skip_reason=SkipReason.NEEDS_ROOT)
    spec, job_file = ctx.spec, ctx.job_file
    # the uninterrupted run: the session's, when one is kept; else the recording run (crash_reference)
    reference = ctx.kept_reference()
    if reference is not None and not reference.ok:
        return CheckResult(_NAME, "error", f"the uninterrupted run did not complete: {reference.reason}",
                           ReferenceNotUsable(str(reference.run_dir)), time.monotonic() - started)
    work = new_run_dir(job_file.state_dir, job_file.job.name, "crash-points", keep=ctx.settings.keep_runs)
    evidence = CrashPointsEvidence(mode=spec.mode, after_step=spec.after_step, work_dir=str(work))
    fuse = FuseMount()
    why = fuse.mount(work / "backing", work / "mnt", policy="rules", state_dir=work)
    if why is not None:
        return CheckResult(_NAME, "skipped", why, evidence, time.monotonic() - started,
                           skip_reason=SkipReason.UNAVAILABLE)
    layer = fuse.layer
    assert layer is not None  # mounted
    try:
        result = _explore(ctx, reference, layer, evidence, started)
        if evidence.outcomes:
            _write_table(evidence, work, f"{result.status.upper()}: {result.summary}")
        # the report's record as it stands now (the unmount's row below is the work dir's alone)
        return dataclasses.replace(result, evidence=copy.deepcopy(evidence))
    finally:
        fuse.unmount()


def _opened(events: list[JournalEvent], mode: str) -> set[str]:
    return {e.path for e in events if e.event == "opened" and e.mode == mode}


def _record(pool: RunPool, spec: CrashPointsCheck, request: Any, metric: str, layer: FuseLayer,
            evidence: CrashPointsEvidence, as_reference: bool) -> SaveFound | str:
    """The recording run, then its restart (the files it opens are the checkpoint): the save
    explored, or why there is none."""
    copy = (CopyAtStep(layer.backing, layer.trigger.parent / "before-save", spec.after_step)
            if spec.from_save and spec.mode == "kill" else None)
    states = RecordStates(layer, layer.trigger.parent / "states", spec.after_step, spec.state_copies_mib * (spec.mode == "kill"))
    watch = StepWatch(layer, metric, "record", {"run": "record"}, *([copy] if copy else []), states)
    recorded = pool.run(request, label="crash-points-record", checkpoint_dir=layer.point, on_metric=watch)
    evidence.runs += 1
    layer.disarm()
    lines = layer.read_events()
    events = journal(lines)
    if not recorded.ok:
        return f"the recording run did not complete: {recorded.reason}"
    final = keep_final(layer.backing, layer.trigger.parent / "final") if as_reference else None
    # restarted on the state the first save after after_step left, where copied: its restart is that boundary's
    # too (crash_restore); on its last boundary explored when its last is not, else (opened nothing) on its last
    first_save = _save_ops([e for e in events if e.path not in _opened(events, "append")], watch.arrivals,
                           spec.after_step, spec.gap_s).boundaries
    chosen = choose_boundaries(first_save, spec.max_boundaries)
    picks = [states_of(events, b, states.folder) for b in ([chosen[-1:]] if first_save[-1:] and first_save[-1]
                                                             not in chosen else []) + [first_save[-1:]]]
    for n, candidate in enumerate([c for c in picks if c and picks[-1]] or picks[-1:]):
        if candidate:
            restore(next(iter(candidate.values())), layer.backing)
        mark = len(layer.read_events())
        seen = observe(layer, "record", record=f"restart-{n}")  # a run of its own: its opens written again
        restarted = pool.run(request, label="crash-points-restart-record", resume=True, checkpoint_dir=layer.point)
        evidence.runs += 1
        layer.disarm()
        opens = [e for e in journal(layer.read_events()[mark:]) if e.event == "opened"]
        appended = _opened(events, "append") | _opened(opens, "append")
        reads = _opened(opens, "read") - appended
        if reads:
            break
    evidence.reads, evidence.appended = sorted(reads)[:50], sorted(appended)[:50]
    if not reads:
        return ("a restart of the recording run (resume_args) opened no file under the checkpoint directory to "
                f"read ({restarted.outcome}), so no save can be told from a log: does the job load its "
                "checkpoint from {checkpoint_dir} when resumed?")
    save = _save_ops(events, watch.arrivals, spec.after_step, spec.gap_s, {shape(r) for r in reads}, appended)
    if not save.boundaries:
        return (f"no save of the files a restart reads ({', '.join(sorted(reads)[:3])}) began after trainguard "
                f"read step {spec.after_step}: does the job save during the run, to {{checkpoint_dir}}, with "
                "steps left after after_step?")
    first = save.boundaries[0]
    began = next((e.start for e in events if first.made(e)), None)
    evidence.save_after_step = max((step for step, t in watch.arrivals if began is not None and t <= began), default=None)
    evidence.last_save = save.last
    save.files = save_files(((b.op, b.path, b.to) for b in save.boundaries), appended)
    save.states = crash_states(events, save.boundaries, spec.mode, appended)
    save.restored = states_of(events, save.boundaries, states.folder)
    if spec.mode == "kill" and spec.infer:  # what a restart observes decides too (crash_seen)
        where = {(b.rank, b.path, b.op, b.ordinal): i for i, b in enumerate(save.boundaries)}
        save.views, save.pids = crash_views(events, len(where), where), op_pids(events)
        save.reused_seen = read_observed(seen, save.pids, whole=_beyond(restarted, metric, save.last))
    at = {b: state for b, state in zip(save.boundaries, save.states, strict=True)}
    # many ranks' saves too: the copy stands for its state as every copy does (docs: "Many ranks")
    save.reused = {at[b]: restarted for b in candidate if at.get(b) is not None}
    save.recorded = None if final is None else dataclasses.replace(recorded, checkpoint_dir=final)
    save.start = (save_start(copy, events, first, save.checkpoint_before, spec.mode) if spec.from_save
                  else SaveStart(None, "step 1 (from_save: false)"))
    return save


@dataclass(frozen=True)
class _CrashRuns:
    """What each crash run and its restart are launched with and judged against: the save explored and the uninterrupted run."""

    pool: RunPool
    spec: CrashPointsCheck
    request: RunRequest
    reference: RunResult
    metric: str
    base: int  # the reference's first step
    layer: FuseLayer
    save: SaveFound


def _explore(ctx: CheckContext[CrashPointsCheck], kept: RunResult | None, layer: FuseLayer,
             evidence: CrashPointsEvidence, started: float) -> CheckResult:
    spec = ctx.spec
    save = _record(ctx.pool, spec, ctx.request, ctx.metric, layer, evidence, kept is None)
    if isinstance(save, str):
        return CheckResult(_NAME, "error", save, evidence, time.monotonic() - started)
    reference = kept or save.recorded
    assert reference is not None  # kept, or the recording run as the reference
    evidence.reference = "the session's" if kept is not None else "the recording run's"
    base = first_step(reference.points, ctx.metric)
    runs = _CrashRuns(ctx.pool, spec, ctx.request, reference, ctx.metric, base, layer, save)
    found, had_checkpoint = save.boundaries, save.checkpoint_before
    chosen = choose_boundaries(found, spec.max_boundaries)
    evidence.boundaries_found, evidence.boundaries_explored = len(found), len(chosen)
    for b in found:
        evidence.by_op[b.op] = evidence.by_op.get(b.op, 0) + 1
    renamed = {b.path for b in found if b.op == "rename"}
    resumed_before: int | None = base - 1 if had_checkpoint else None
    unsafe: tuple[Boundary, BoundaryOutcome] | None = None
    decided = _decide(runs, chosen, evidence)
    for number, boundary in enumerate(chosen):
        row = decided.rows[number]
        if isinstance(row, BoundaryOutcome):
            _in_context(row, runs, resumed_before)
        first_doubt = row.outcome == "torn" and not any(r.outcome == "safe" for r in evidence.outcomes)
        if (first_doubt or row.outcome == "began again") and evidence.control is None:
            evidence.control, launched = _crash_and_resume(len(chosen), runs, found[0], control=True)
            evidence.runs += launched
        control = evidence.control
        if isinstance(row, BoundaryOutcome):
            _doubted(row, control, first_doubt, base)
        evidence.outcomes.append(row)
        if row.outcome in ("safe", "loaded") and row.resumed_from_step is not None:
            resumed_before = max(resumed_before if resumed_before is not None else -1, row.resumed_from_step)
        elif unsafe is None and isinstance(row, BoundaryOutcome) and row.outcome not in ("safe", "loaded"):
            unsafe = (boundary, row)
    evidence.start = save.start.words()
    duration = time.monotonic() - started
    explored = (f"{len(chosen)} of {len(found)} boundaries of the save after step {spec.after_step} "
                f"({', '.join(f'{n} {op}' for op, n in evidence.by_op.items())})")
    seen = f", {evidence.inferred_observed} of them from what a restart observed" if evidence.inferred_observed else ""
    ran = f"{evidence.runs} runs" + (f", {evidence.inferred} boundaries inferred (no run of their own{seen})"
                                     if evidence.inferred else "")
    if unsafe is not None:
        boundary, row = unsafe
        evidence.first_unsafe = row
        evidence.fix = fix_for(boundary, row, renamed, spec.mode, found)
        return CheckResult(_NAME, "failed", f"{explored} explored in {ran}; first unsafe: "
                           f"{row.boundary}: {row.outcome} ({row.detail}). Fix: {evidence.fix}",
                           evidence, duration)
    loaded = [r for r in evidence.outcomes if r.outcome == "loaded"]
    if loaded:
        return CheckResult(_NAME, "error", f"{explored} explored in {ran}: no crash point failed "
                           f"to load, began again or went back, but {len(loaded)} restarts diverged and so did "
                           f"a restart after a kill just before the save ({evidence.control and evidence.control.detail}):"
                           " the job's resume is not exact, so a torn checkpoint that loads cannot be found. Make "
                           "the resume exact first (trainguard check --only resume says what it loses)",
                           evidence, duration)
    missed = [r for r in evidence.outcomes if r.outcome == "not reached"]
    if len(missed) * 4 > len(evidence.outcomes):  # more than a quarter unexplored: no verdict
        return CheckResult(_NAME, "error", f"{explored}: {len(missed)} crash runs never reached their boundary, "
                           f"first {missed[0].boundary} (the job's saves differ from run to run: a file "
                           "named by the time or a random part trainguard does not recognise?)",
                           evidence, duration)
    note = f"; {len(missed)} not reached" if missed else ""
    return CheckResult(_NAME, "passed", f"{explored} explored in {ran}: a crash after each "
                       f"resumed and matched the uninterrupted run{note}", evidence, duration)


def _first_steps(points: list[MetricPoint], metric: str) -> dict[int, int]:
    """The first step each rank printed ``metric`` for."""
    firsts: dict[int, int] = {}
    for p in points:
        if p.name == metric:
            firsts[p.rank] = min(firsts.get(p.rank, p.step), p.step)
    return firsts


def _ranks_print_alike(points: list[MetricPoint], metric: str) -> bool:
    """Whether more than one rank printed ``metric``, each for the same steps (then ranks that
    begin a restart at different steps resumed from different checkpoints)."""
    steps: dict[int, set[int]] = {}
    for p in points:
        if p.name == metric:
            steps.setdefault(p.rank, set()).add(p.step)
    return len(steps) > 1 and all(v == next(iter(steps.values())) for v in steps.values())


def _last_words(result: RunResult) -> str:
    """The last line a run printed: on rank 0's stdout (its log's last 4 KiB), else on stderr."""
    lines: list[str] = []
    with contextlib.suppress(OSError), open(result.run_dir / "rank0.stdout.log", "rb") as log:
        log.seek(max(0, log.seek(0, 2) - 4096))
        lines = log.read(4096).decode("utf-8", "replace").splitlines()
    lines += result.stderr_tail.splitlines() if not any(ln.strip() for ln in lines) else []
    return next((ln.strip()[:200] for ln in reversed(lines) if ln.strip()), "")


def _doubted(row: BoundaryOutcome, control: CrashRow | None, first_doubt: bool, base: int) -> None:
    """``row`` read beside the control (a kill just before the save, resumed): a restart that
    began again as the control's did is safe (no checkpoint was complete before the save); the
    first divergence, when the control diverged too, is ``loaded`` (not judged)."""
    if row.outcome == "began again" and control is not None and (
            control.resumed_from_step is not None and control.resumed_from_step < base):
        row.outcome, row.detail = "safe", (f"began again at step {base}, as the restart after a kill just "
                                           "before the save did: no checkpoint was complete before the save")
    if first_doubt and control is not None and control.outcome != "safe":
        row.outcome, row.detail = "loaded", (
            f"{row.detail.split(': it loaded')[0]}; so did the restart after a kill just before the save "
            f"began ({control.detail}): the job's resume does not match the uninterrupted run, so a torn "
            "checkpoint that loads cannot be told from it")


def _trained_nothing(row: BoundaryOutcome, runs: _CrashRuns, resumed: RunResult) -> BoundaryOutcome:
    """A restart that exited 0 without a step: safe only when the save was the run's last and
    what the crash left is the uninterrupted run's final checkpoint."""
    spec, reference, layer, save = runs.spec, runs.reference, runs.layer, runs.save
    said = _last_words(resumed)
    said = f" (its last words: {said})" if said else ""
    row.resumed_from_step = None
    if not save.last:
        row.outcome, row.detail = "trained nothing", (
            f"the restart exited 0 without training a step{said}, though the uninterrupted run saved again "
            f"after this save and trained to step {spec.steps}")
        return row
    differences, compared = ([], 0) if reference.checkpoint_dir is None else unlike_reference(
        layer.backing, reference.checkpoint_dir, save.files)
    if differences or not compared:
        why = "; ".join(differences[:3]) or "no file of the save was left to compare"
        row.outcome, row.detail = "trained nothing", (
            f"the restart exited 0 without training a step{said}, but what the crash left is not the "
            f"uninterrupted run's final checkpoint: {why}")
        return row
    row.outcome, row.resumed_from_step = "safe", spec.steps
    row.detail = (f"the restart exited 0 with no step left to train: what the crash left is the "
                  f"uninterrupted run's final checkpoint ({compared} files equal)")
    return row


def _beyond(result: RunResult, metric: str, last: bool) -> bool:
    """Whether more than a restart observed decides its row: it did not end on its own (a timeout), or trained nothing after the last save (the files judge)."""
    return result.outcome not in ("ok", "failed") or (last and not any(p.name == metric for p in result.points))


def _restart(runs: _CrashRuns, number: int, boundary: Boundary | None, pids: set[int]) -> RunResult:
    """The restart with the resume arguments on what the crash left; in kill mode, what it
    observed kept for ``boundary`` (None: the control's, kept for none), the state's temporary
    names holding ``pids`` (crash_seen); everything where more decides its row (:func:`_beyond`)."""
    file = observe(runs.layer, number) if boundary is not None and runs.save.views else None
    resumed = runs.pool.run(runs.request, label="crash-points-resume", resume=True, checkpoint_dir=runs.layer.point)
    if file is not None and boundary is not None:
        runs.layer.disarm()
        runs.save.seen[boundary] = read_observed(file, pids, whole=_beyond(resumed, runs.metric, runs.save.last))
    return resumed


def _crash_and_resume(number: int, runs: _CrashRuns, boundary: Boundary, *,
                      control: bool = False) -> tuple[CrashRow, int]:
    """A fresh run crashed right after ``boundary`` (``control``: a kill instead of it, just
    before the save began, in either mode), restarted with the resume arguments, judged; and
    how many runs it launched."""
    pool, spec, request, metric, layer = runs.pool, runs.spec, runs.request, runs.metric, runs.layer
    words = f"rank {boundary.rank}: a kill before the save's first operation" if control else boundary.words()
    start = runs.save.start
    keep = None if control else start.keep  # once: another lane may give the copy up meanwhile
    at = start.shifted(boundary) if keep is not None else None
    copied = None if control else runs.save.restored.get(boundary)
    restore(copied or (keep if at is not None else None), layer.backing)
    if copied is not None:  # the state the recording left right after the boundary: a restart on it
        runs.save.start.count(from_states=1)
        state = runs.save.states[runs.save.boundaries.index(boundary)] if runs.save.states else None
        reused = runs.save.reused.pop(state, None) if state is not None else None
        resumed = reused or _restart(runs, number, boundary, runs.save.pids)
        if reused is not None:  # launched on this copy earlier: what it left is compared as it was
            restore(copied, layer.backing)
            runs.save.seen[boundary] = runs.save.reused_seen
        return _judge_restart(BoundaryOutcome(words, boundary.op, boundary.path, boundary.rank, boundary.ordinal,
                                              None, "torn", ""), runs, resumed, control), int(reused is None)
    with contextlib.suppress(FileNotFoundError):
        layer.events.unlink()
    # a run of its own to the daemon (its counts start again): the same crash made again from
    # step 1 is another run
    rule: CrashRule = {"run": f"crash-{number}" + ("-at-save" if at is not None else ""), "at": (at or boundary).as_rule()}
    if control:
        rule["before"] = True
    elif spec.mode == "power":
        rule["mode"], rule["snapshots"] = "power", str(layer.trigger.parent / "power-copies" / str(number))
    watch = StepWatch(layer, metric, "crash", rule)
    crashed_run = pool.run(request, label="crash-points-control" if control else "crash-points-crash",
                           resume=at is not None, checkpoint_dir=layer.point, on_metric=watch)
    made = journal(layer.read_events())
    crashed = [e for e in made if e.event == "crashed"]
    layer.disarm()
    if at is not None:  # started at the save: used only when it did what a run from step 1 would
        why = "never reached its boundary" if not crashed else unlike_a_run_from_step_1(
            crashed_run.points, runs.reference.points, runs.metric, runs.base, spec.rtol, spec.atol)
        if why is not None:
            start.give_up(f"{why} ({boundary.words()})")
            row, launched = _crash_and_resume(number, runs, boundary)
            return row, launched + 1
        start.count(used=1)
    if not crashed:
        return BoundaryNotReached(words, boundary.op, boundary.path, boundary.rank, boundary.ordinal, "not reached",
                                  None, f"the crash run never made that operation ({crashed_run.outcome})"), 1
    row = BoundaryOutcome(words, boundary.op, boundary.path, boundary.rank, boundary.ordinal, None, "torn", "")
    if spec.mode == "power" and not control:  # the copies the undo needed
        shutil.rmtree(layer.trigger.parent / "power-copies" / str(number), ignore_errors=True)
        row.undone = crashed[0].undone
    resumed = _restart(runs, number, None if control else boundary, op_pids(made) | runs.save.pids)
    return _judge_restart(row, runs, resumed, control), 2


def _decide(runs: _CrashRuns, chosen: list[Boundary], evidence: CrashPointsEvidence) -> Inference:
    """A row for each boundary of ``chosen``, judged without the rows before it: run, or with
    ``infer``, inferred where :mod:`~trainguard.drills.crash_infer` can; the runs that do not depend
    on each other made side by side (:mod:`~trainguard.drills.crash_lanes`)."""
    def run(number: int, layer: FuseLayer) -> tuple[CrashRow, int]:
        with runs.pool.checking(_NAME):
            return _crash_and_resume(number, dataclasses.replace(runs, layer=layer), chosen[number])

    where = {b: i for i, b in enumerate(runs.save.boundaries)}
    states = [runs.save.states[where[b]] if runs.save.states else None for b in chosen] if runs.spec.infer else None
    views = [runs.save.views[where[b]] for b in chosen] if runs.save.views else []

    def agrees(i: int, j: int) -> bool:  # j's restart observed nothing that differs in i's state
        seen, a, b = runs.save.seen.get(chosen[j]), views[i], views[j]
        return seen is not None and a is not None and b is not None and agree(a, b, seen)

    count = lane_count(runs.spec.lanes, runs.request.world_size, runs.pool.background())
    decide = inferred(chosen, states, agrees if views else None, folders=runs.spec.mode == "kill")
    decided, launched, lanes = explore_in_lanes(decide, run, runs.layer, count, runs.pool.stop_beside)
    evidence.runs, evidence.lanes, evidence.inferred = evidence.runs + launched, lanes.used, len(decided.inferred)
    evidence.inferred_observed = len(decided.observed)
    return decided


def _in_context(row: BoundaryOutcome, runs: _CrashRuns, resumed_before: int | None) -> None:
    """``row`` read beside the boundaries before it: a restart that resumed (safe or torn, all
    ranks alike) from before the save's first step though a checkpoint was there began again;
    one older than an earlier boundary's went back."""
    resumed_from = row.resumed_from_step
    if row.outcome not in ("safe", "torn") or row.ranks_resumed_from or resumed_from is None or resumed_before is None:
        return
    if resumed_from < runs.base:
        row.outcome, row.detail = "began again", (
            f"the restart began at step {runs.base}: the save left no checkpoint to resume from, though there was "
            "one before it" + (" (a power loss also drops a checkpoint that was never fsynced)"
                               if runs.spec.mode == "power" else ""))
    elif resumed_from < resumed_before:
        row.outcome, row.detail = "went back", (
            f"resumed from step {resumed_from}, older than the step {resumed_before} a crash at an earlier "
            "boundary resumed from: the save destroyed a complete checkpoint")


def _judge_restart(row: BoundaryOutcome, runs: _CrashRuns, resumed: RunResult, control: bool) -> BoundaryOutcome:
    """What the restart after the crash did, set on ``row`` (module docstring: the outcomes),
    the rows before it aside (:func:`_in_context` reads it beside them)."""
    spec, reference, metric = runs.spec, runs.reference, runs.metric
    steps = sorted({p.step for p in resumed.points if p.name == metric})
    resumed_from = row.resumed_from_step = steps[0] - 1 if steps else None
    if not resumed.ok:
        last = next((ln.strip() for ln in reversed(resumed.stderr_tail.splitlines()) if ln.strip()), "")
        row.outcome, row.detail = "crashed on load", (f"the restart failed: {resumed.reason}"
                                                      + (f" ({last[:200]})" if last else ""))
        return row
    if resumed_from is None:  # exited 0 without a step: finished only if the crash left the final checkpoint
        return _trained_nothing(row, runs, resumed)
    firsts = _first_steps(resumed.points, metric)
    if len(set(firsts.values())) > 1 and _ranks_print_alike(reference.points, metric):
        row.ranks_resumed_from = {str(r): s - 1 for r, s in sorted(firsts.items())}
        row.outcome, row.detail = "torn", ("the ranks resumed from different steps (" + ", ".join(
            f"rank {r} from {s - 1}" for r, s in sorted(firsts.items())) + "): the save was complete on "
            "some ranks only")
        return row
    actual, expected = aligned_trajectories(resumed.points, reference.points, metric)
    diff = compare_trajectories(actual, expected, metric=metric, steps=range(resumed_from + 1, spec.steps + 1),
                                rtol=spec.rtol, atol=spec.atol)
    if not diff.ok:
        where = (f"diverges at step {diff.first_divergent_step}" if diff.first_divergent_step is not None
                 else f"misses steps {diff.missing_in_actual[:5]}")
        row.outcome, row.detail = "torn", (f"resumed from step {resumed_from} and {metric} {where}"
                                           + ("" if control else ": it loaded a checkpoint the crash left half written"))
        return row
    row.outcome, row.detail = "safe", f"resumed from step {resumed_from} and matched"
    return row


#: crash_points: every crash point of one save (docs/crash-points.md)
CRASH_POINTS: Check[CrashPointsCheck] = Check(
    _NAME, CrashPointsCheck, run=run_crash_points,
    # every launch it may make, so the plan's worst case is right: a crash and a resume per boundary
    runs=lambda spec, ctx: ([Run("reference", reference=True), Run("record the save"),
                             Run("restart the recorded run: the files a resume reads"),
                             *(Run(f"{what} {i}") for i in range(1, spec.max_boundaries + 1)
                               for what in ("crash after boundary", "resume after crash")),
                             Run("a kill before the save, if a restart diverges"), Run("resume after the kill"),
                             Run("a crash from the copy before the save, made again from step 1")],
                            f"a crash after each boundary of the save (at most {spec.max_boundaries}) must "
                            "resume and match the reference; " + crash_plan_words(spec.max_boundaries, spec.mode, spec.infer,
                                ctx.job_file.state_dir, plan_lanes(spec.lanes, ctx.job_file))),
    requires=lambda spec, facts: resume_problems(facts, f"checks.{_NAME}"),
    gate_default=False,
    evidence=(CrashPointsEvidence, ReferenceNotUsable),
)
