"""The judges of storage drills that strike the resume, and of ``kill_during_save``.

``storage`` with ``kind: corrupt`` or ``kind: eio_read``: the run is stopped after step k, the
newest complete checkpoint is struck (a byte flipped, or its reads failing with EIO), and the job
resumes. It must never resume silently from the struck checkpoint:

* ``fail_clean``: a resume run (the fault in place) exits non-zero with an error on stderr (a
  line that is not a metric line, a progress bar, a warning or trainguard's own:
  :mod:`trainguard.launch.reported`) within ``deadline``, without training from the struck
  checkpoint;
* ``recover``: trainguard restarts the job (at most ``max_restarts`` times); it completes having
  fallen back to an older good checkpoint (resumed from a step older than the struck one) and
  matches the uninterrupted run from there.

A resume that starts right after the struck checkpoint's step and trains on has loaded it: the
drill fails and names the flipped file (or the file whose reads failed).

``kill_during_save``: ``recover`` or ``fail_clean`` as for any fault, once the fault really
caught a checkpoint write (else an error verdict: nothing was tested); the report adds the held
write, the latest complete checkpoint at the kill and the step the resume started after.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from pathlib import Path

from trainguard.config import DrillSpec
from trainguard.drills.dispatch import judge_for
from trainguard.drills.evidence import (
    DrillEvidence,
    FailCleanEvidence,
    RecoverEvidence,
    SaveUnderKill,
    StorageRestart,
    StorageResumeEvidence,
)
from trainguard.drills.expectations import JudgeEntry
from trainguard.drills.judges import (
    DrillContext,
    Judge,
    Judgement,
    attempt_evidence,
    common_evidence,
    judge_injected,
    trajectory_diff,
)
from trainguard.evidence import UNSET, NoEvidence, known
from trainguard.faults.base import Fault
from trainguard.faults.hook import rank_stderr
from trainguard.faults.kill_during_save import HeldWrite, LatestComplete
from trainguard.faults.storage import StorageFault, StruckCheckpoint
from trainguard.launch import RunResult
from trainguard.launch.reported import reported_line
from trainguard.unit.checkpoints.files import is_temp_name

__all__ = ["STORAGE_CAUSES", "judge_kill_during_save", "judge_storage_resume", "storage_judge"]

STORAGE_CAUSES = {
    "silent": "no integrity check on load: the checkpoint carries no checksum (or the loader never "
              "compares it), so a flipped byte is trained on",
    "no_fallback": "the loader takes only the newest checkpoint: on a bad one it fails instead of "
                   "falling back to the previous good one",
    "scratch": "a load error is caught and the job starts from step 0, silently dropping its progress",
}


def storage_judge(spec: DrillSpec, fault: Fault) -> JudgeEntry | None:
    """The judge of a storage drill that strikes the resume, or of kill_during_save; None for
    the others (the expectation's own judge). Each finishes at once (none waits as fail_clean's
    own does)."""
    own = judge_for(spec.expectation)
    if spec.fault == "kill_during_save":
        return own.but_judged_by(judge_kill_during_save)
    if spec.fault == "storage" and fault.params.raw("kind") in ("corrupt", "eio_read") \
            and spec.expectation in ("fail_clean", "recover"):
        return own.but_judged_by(judge_storage_resume)
    if spec.fault == "storage":
        return own.but_judged_by(_storage_named(own.judge))
    return None


def _storage_named(judge: Judge) -> Judge:
    """The expectation's own judge, its summary naming the storage kind (and for ``slow``, the
    checkpoint stall and what the layer added)."""

    def run(c: DrillContext) -> Judgement:
        status, summary, evidence = judge(c)
        kind = c.fault.params.raw("kind")
        summary = summary.replace("storage on rank", f"storage {kind} on rank", 1)
        slow = c.fault.slow if isinstance(c.fault, StorageFault) else None
        if slow is not None and known(slow.checkpoint_stall_s) is not None and slow.slowest_step_during is not None \
                and slow.step_time_before_s is not None:
            summary += (f"; checkpoint stall {slow.checkpoint_stall_s:.2f} s (step {slow.slowest_step_during.step}"
                        f", median step {slow.step_time_before_s:.3f} s before), the layer added "
                        f"{slow.layer_added_s:.2f} s ({slow.layer_share_of_time:.0%} of the "
                        f"{slow.window_s:.1f} s under the fault)")
        return Judgement(status, summary, evidence)

    return run


_RANK_IN_NAME = re.compile(r"rank[_-]?(\d+)(?!\d)", re.I)


def _resumed_by_rank(result: RunResult, metric: str) -> dict[int, int]:
    out: dict[int, int] = {}
    for p in result.points:
        if p.name == metric:
            out[p.rank] = min(out.get(p.rank, p.step), p.step)
    return {rank: first - 1 for rank, first in out.items()}


def _resumed_from(result: RunResult, metric: str) -> int | None:
    steps = [p.step for p in result.points if p.name == metric]
    return min(steps) - 1 if steps else None


@dataclass(frozen=True)
class _Strike:
    """What a storage drill struck, as its judge reads it."""

    #: the step of the struck checkpoint (None when the fault could not tell)
    step: int | None
    #: the struck file the report names
    named: str
    #: the verdict's opening: the fault, what was struck and the checkpoint's step
    what: str
    #: the ranks that load the struck files (per-rank files: ``rank3`` in the name); empty when
    #: every rank loads them (one checkpoint for every rank)
    owners: frozenset[int]

    def resumed_after(self, result: RunResult, metric: str) -> int | None:
        """The step a rank that loads the struck file resumed after, when it loaded it (ranks
        without a barrier may resume from different steps: one that lagged had no newer file)."""
        found = [resumed for rank, resumed in _resumed_by_rank(result, metric).items()
                 if (not self.owners or rank in self.owners) and resumed > 0
                 and (self.step is None or resumed >= self.step)]
        return max(found) if found else None

    def failed(self, evidence: StorageResumeEvidence, problems: list[str], causes: list[str]) -> Judgement:
        """The failed verdict: the strike, then each problem; the likely causes ``causes`` (all
        of them when the evidence names none)."""
        evidence.likely_causes = causes or list(STORAGE_CAUSES.values())
        return Judgement("failed", f"{self.what}; " + "; ".join(problems), evidence)


def _strike(c: DrillContext, kind: str, target: StruckCheckpoint) -> _Strike:
    """The strike a ``corrupt`` or ``eio_read`` fault reports in ``target``."""
    step = target.step
    named = known(target.file) or (target.files or [target.checkpoint])[0]
    how = (f"byte {known(target.offset)} of {named} flipped ({known(target.byte_before)} -> "
           f"{known(target.byte_after)})" if kind == "corrupt"
           else f"reads of {target.checkpoint} failing with EIO")
    what = f"storage {kind} after step {c.info.injected_step}: run stopped, {how} (checkpoint of step {step})"
    struck_files = [str(target.file)] if kind == "corrupt" else list(target.files)
    owners = {int(m.group(1)) for f in struck_files for m in [_RANK_IN_NAME.search(Path(f).name)] if m}
    if len(owners) != len(struck_files):
        owners = set()  # one checkpoint for every rank
    return _Strike(step=step, named=named, what=what, owners=frozenset(owners))


@judge_injected(StorageResumeEvidence)
def judge_storage_resume(c: DrillContext, evidence: StorageResumeEvidence) -> Judgement:
    """A storage drill that struck the checkpoint the job resumes from: the resume failed loudly
    (``fail_clean``), or the restarted job fell back to an older good checkpoint (``recover``);
    never trained on from the struck one."""
    kind = str(c.fault.params.raw("kind"))
    target = c.fault.target if isinstance(c.fault, StorageFault) and c.fault.target is not None else None
    evidence.struck = NoEvidence() if target is None else dataclasses.replace(target)
    if target is None or not target.checkpoint or (kind == "corrupt" and target.offset is UNSET):
        why = "; ".join(getattr(c.fault, "problems", [])) or "no checkpoint was struck"
        return Judgement("error", f"storage {kind} after step {c.info.injected_step}: {why}", evidence)
    strike = _strike(c, kind, target)
    if c.spec.expectation == "fail_clean":
        return _judge_resume_fails(c, evidence, kind, strike)
    return _judge_fallback(c, evidence, strike)


def _judge_resume_fails(c: DrillContext, evidence: StorageResumeEvidence, kind: str, strike: _Strike) -> Judgement:
    """fail_clean: a resume run with the fault in place exits non-zero with an error on stderr
    within the deadline, without training on from the struck checkpoint."""
    spec, fault = c.spec, c.fault
    problems: list[str] = []
    causes: list[str] = []
    rearm = getattr(fault, "arm", None)
    if kind == "eio_read" and callable(rearm):
        rearm()  # the resume run reads through the failing layer
    try:
        resume = c.runner.run(c.request, label=f"drill-{spec.name}-resume", resume=True,
                              checkpoint_dir=c.checkpoint_dir)
    finally:
        fault.clear()
    evidence.resume_run = attempt_evidence(resume, fault)
    evidence.fault_evidence = fault.evidence().to_dict()  # with the resume's EIO calls
    resumed = _resumed_from(resume, c.metric)
    evidence.resumed_from_step = resumed
    failed_rank = resume.failed_rank if resume.failed_rank is not None else 0
    text = rank_stderr(resume, failed_rank)
    error = reported_line(text, c.metric_lines)
    evidence.resume_error = error
    struck_at = strike.resumed_after(resume, c.metric)
    if struck_at is not None:
        evidence.struck_resumed_from_step = struck_at
        problems.append(f"the resume loaded the struck checkpoint ({strike.named}) and trained on after "
                        f"step {struck_at}"
                        + ("" if resume.ok else f" before failing ({resume.reason})"))
        causes = [STORAGE_CAUSES["silent"], STORAGE_CAUSES["no_fallback"]]
    elif resume.ok and resumed == 0:
        problems.append("the resume started again from step 1 and completed: the struck checkpoint "
                        "was dropped silently with all progress")
        causes = [STORAGE_CAUSES["scratch"]]
    elif resume.ok:
        problems.append(f"the resume fell back to the checkpoint of step {resumed} and completed; "
                        "expected it to fail loudly (for a job that falls back, use `expect: recover`)")
    elif resume.outcome != "failed":
        problems.append(f"the resume run ended as {resume.outcome}: {resume.reason}")
    elif resume.duration_s > spec.deadline_s:
        problems.append(f"the resume failed only after {resume.duration_s:.1f} s (deadline {spec.deadline_s:g} s)")
    elif error is None:
        problems.append("the resume exited non-zero but wrote no error to stderr (nothing but metric "
                        "lines, progress bars, warnings or trainguard's own lines)")
    if problems:
        return strike.failed(evidence, problems, causes)
    return Judgement("passed", f"{strike.what}; the resume failed loudly in {resume.duration_s:.1f} s: "
            f"{(error or '')[:200]}", evidence)


def _judge_fallback(c: DrillContext, evidence: StorageResumeEvidence, strike: _Strike) -> Judgement:
    """recover: trainguard restarted the job with the fault in place; it must have fallen back
    to a checkpoint older than the struck one and match the uninterrupted run from there."""
    spec, fault, run = c.spec, c.fault, c.run
    problems: list[str] = []
    causes: list[str] = []
    resumes: list[StorageRestart] = []
    for attempt in run.attempts[1:]:
        resumed = _resumed_from(attempt, c.metric)
        resumes.append(StorageRestart(resumed_from_step=resumed, outcome=attempt.outcome,
                                      classified=None if attempt.ok else fault.classify(attempt)))
        if strike.resumed_after(attempt, c.metric) is not None:
            problems.append(f"restart {len(resumes)} loaded the struck checkpoint ({strike.named}) and trained "
                            f"on after step {resumed}")
            causes = [STORAGE_CAUSES["silent"], STORAGE_CAUSES["no_fallback"]]
        elif resumed == 0:
            problems.append(f"restart {len(resumes)} began again at step 1: all progress dropped "
                            "instead of falling back to an older checkpoint")
            causes = [STORAGE_CAUSES["scratch"], STORAGE_CAUSES["no_fallback"]]
    evidence.resumes = resumes
    final = run.final
    if not run.restarts:
        problems.append("trainguard did not restart the job (max_restarts 0?)")
    elif not final.ok and not problems:
        problems.append(f"did not recover: every restart failed ({fault.classify(final)}); the job "
                        "does not fall back to an older checkpoint (if failing loudly is what it "
                        "should do, use `expect: fail_clean`)")
        causes = [STORAGE_CAUSES["no_fallback"]]
    last_resume = resumes[-1].resumed_from_step if resumes else None
    evidence.resumed_from_step = last_resume
    if final.ok and last_resume is not None and not problems:
        diff = trajectory_diff(c, final.points, range(last_resume + 1, spec.steps + 1))
        evidence.trajectory = diff.as_evidence()
        if not diff.ok:
            problems.append(f"{c.metric} of the run resumed from step {last_resume} does not match the "
                            f"uninterrupted run (first divergent step {diff.first_divergent_step})")
        step = strike.step
        if spec.max_lost_steps is not None and step is not None and step - last_resume > spec.max_lost_steps:
            problems.append(f"{step - last_resume} steps lost falling back (max_lost_steps {spec.max_lost_steps})")
    if problems:
        return strike.failed(evidence, problems, causes)
    return Judgement("passed", f"{strike.what}; the job fell back to the checkpoint of step {last_resume}, older than "
            f"the struck one, and matches the uninterrupted run from there", evidence)


def judge_kill_during_save(c: DrillContext) -> Judgement:
    held: HeldWrite | None = getattr(c.fault, "held", None)
    if c.fault.injected_at is not None and held is None:
        evidence = common_evidence(c, DrillEvidence)
        why = getattr(c.fault, "no_write", None) or "no write under the checkpoint directory was seen"
        return Judgement("error", f"kill_during_save on rank {c.spec.rank}: {why}, so no save was caught and "
                "nothing was tested: give the drill more steps after after_step (a checkpoint must "
                "fall among them) or a longer params.wait", evidence)
    status, summary, evidence = judge_for(c.spec.expectation).judge(c)
    if held is None:
        return Judgement(status, summary, evidence)
    latest: LatestComplete | None = getattr(c.fault, "latest_complete", None)
    resumed = known(evidence.resumed_from_step) if isinstance(evidence, FailCleanEvidence) else None
    restarts = known(evidence.resumes) if isinstance(evidence, RecoverEvidence) else None
    if resumed is None and restarts:
        resumed = restarts[0].resumed_from_step
    save = SaveUnderKill(held_write=held, latest_complete_at_kill=latest or NoEvidence(),
                         kill_to_exit_s=getattr(c.fault, "kill_to_exit_s", None), resumed_from_step=resumed)
    if len(c.run.attempts) > 1:  # where the killed rank itself started again
        mine = [p.step for p in c.run.attempts[1].points if p.name == c.metric and p.rank == c.spec.rank]
        save.killed_rank_resumed_from_step = min(mine) - 1 if mine else None
        complete = None if latest is None else latest.step
        if mine and complete is not None and min(mine) - 1 > complete and status == "passed":
            status = "failed"
            summary += (f"; rank {c.spec.rank} resumed after step {min(mine) - 1}, newer than its last "
                        f"complete checkpoint (step {complete}): it loaded the write the kill cut short")
    recovery = known(evidence.fault_to_first_step_after_restart_s) if isinstance(evidence, RecoverEvidence) else None
    if recovery is not None and held.held_after_s is not None:  # the kill came once held
        save.kill_to_first_step_after_resume_s = round(recovery - float(held.held_after_s), 3)
    evidence.save = save
    where = f"killed while writing {held.path}"
    summary = re.sub(r"^kill_during_save on rank (\d+)", rf"kill_during_save on rank \1 ({where})", summary)
    if status == "failed":
        inplace = ("the checkpoint is written in place (no temp file + fsync + rename): the kill "
                   f"left {held.path} torn, the newest file, and the resume loads it")
        pointer = ("the 'latest' pointer (a symlink, marker file or index) is updated before the data "
                   "is durable: it names a checkpoint the kill left unwritten")
        held_dir, _, held_name = str(held.path or "").strip("/").rpartition("/")
        # a file of a checkpoint directory (DCP's shards) that the resume loaded although it was
        # not complete when the kill came: its files are new, its commit came too early
        dir_name = held_dir.rsplit("/", 1)[-1]
        loaded_it = any(dir_name in f"{a.reason}\n{a.stderr_tail}" for a in c.run.attempts[1:])
        early_commit = bool(held_dir) and (loaded_it or (resumed is not None and latest is not None
                                                          and latest.step is not None and resumed > latest.step))
        if early_commit:
            pointer = (f"the checkpoint {held_dir} was marked complete (a marker file, a 'latest' pointer) "
                       "before every rank's data was durable: an async save's marker written when the "
                       "save is issued, not when it completes; the kill left it unwritten and the resume loaded it")
        ranked = [pointer, inplace] if is_temp_name(held_name) or early_commit else [inplace, pointer]
        evidence.likely_causes = [*ranked, *[x for x in known(evidence.likely_causes) or [] if "in place" not in x]]
    return Judgement(status, summary, evidence)
