"""The resume check (registered here): the uninterrupted run, then a chain of cycles -- a run
killed after each step of ``checks.resume.chain`` and resumed from the checkpoint the kill before
left, the last one resumed to the end -- each judged against the uninterrupted run
(:mod:`trainguard.checks.resume_judge`). A single kill (``after_step``) is a chain of one cut:
its checkpoint may be one kept from the uninterrupted run, and its resumed run is judged with the
diagnosis of a failed resume.

A bug that shows only on the second resume -- state a resume restores and the next save leaves
out (a counter loaded once and never written again), a checkpoint that resumes only from a fresh
start -- passes a single kill. The cycle that fails and its cut are named: ``cycle 2 (resumed
from step 10, killed after step 27)``.
"""

from __future__ import annotations

import time
from pathlib import Path

from trainguard.checks.context import CheckContext
from trainguard.checks.diagnosis import ResumeFacts, diagnose_resume, read_inventory
from trainguard.checks.equivalence_records import (
    ChainEvidence,
    KillUntested,
    NoCheckpointLeft,
    ResumeEvidence,
    RunFailure,
)
from trainguard.checks.interruption import Interruption, interrupt, kill_after
from trainguard.checks.resume_judge import ResumeRuns, judge_cycle, judge_resume, reference_failed
from trainguard.checks.smoke import no_checkpoint_before_end
from trainguard.config import ResumeCheck
from trainguard.config.problems import metric_problems, resume_problems
from trainguard.config.registry import Check, Resumes, Run
from trainguard.evidence import RunDidNotComplete
from trainguard.report import CheckResult
from trainguard.unit.checkpoints import describe_candidates, latest_complete_checkpoint

__all__ = ["RESUME", "run_resume_check"]


def run_resume_check(ctx: CheckContext[ResumeCheck]) -> CheckResult:
    """The uninterrupted run; then cycle by cycle, the first cut made and each later run resumed
    from the cut before, killed after the next step of ``spec.cuts`` or run to the end, each
    judged as it ends (:func:`judge_cycle`); the verdict from them all (:func:`judge_resume`)."""
    started, reproduce = time.monotonic(), _reproduce(ctx)
    runs = ResumeRuns(ctx.job_file, ctx.spec, ctx.metric, ctx.tolerance, ctx.request, ctx.reference(), started,
                      reproduce, recorded=ctx.recorded)
    if not runs.reference.ok:
        return reference_failed(runs)
    for number, cut in enumerate([*runs.spec.cuts, None], start=1):
        stopped = _cycle(ctx, runs, number, cut)
        if stopped is not None:
            return stopped
        if runs.problems:  # a chain's cycle parted from the uninterrupted run: the later ones are not run
            break
    return judge_resume(runs)


def _cycle(ctx: CheckContext[ResumeCheck], runs: ResumeRuns, number: int, cut: int | None) -> CheckResult | None:
    """Cycle ``number``: a fresh run killed after ``cut`` (a single kill's: the checkpoint kept
    there, else a run killed there, :func:`_first_cut`), or one resumed from the cut before,
    killed after ``cut`` (None: run to the end); the result that ends the check now, else None."""
    if number == 1 and runs.chain is None:
        return _first_cut(ctx, runs)
    # the declared runs end with the cycles' (a single kill declares only its resumed run)
    which = ctx.runs[number - len(runs.spec.cuts) - 2].run
    label = "resume-resumed" if runs.chain is None else f"resume-chain-{number}" + ("-killed" if cut is not None else "")
    # the kill waits for every metric line of the cut step the reference has
    on_metric = None if cut is None else kill_after(runs.metric, cut, runs.reference.points)
    if number == 1:  # a chain's first run: a fresh start
        run = ctx.run(which, label=label, on_metric=on_metric)
    else:
        run = ctx.resume(runs.cut, which, label=label, on_metric=on_metric)
    if cut is None:
        runs.resumed = run
    else:  # where the next cycle resumes from
        runs.cut = Interruption(run.last_step, run.run_dir, run.checkpoints, killed=run)
    return judge_cycle(runs, number, cut, run)


def _reproduce(ctx: CheckContext[ResumeCheck], latest: Path | None = None) -> str:
    """The commands of the check's runs, runnable as printed in a fresh directory; ``latest``: the
    checkpoint a single kill left, relative to its checkpoint directory (the same name in the
    fresh one is what ``{latest_checkpoint}`` then names)."""
    cuts = ctx.spec.cuts
    if len(cuts) == 1:
        return (f"{ctx.command_line()}  # kill -9 after step {cuts[0]}, then: "
                f"{ctx.command_line(resume=True, latest_checkpoint=latest)}")
    return (f"{ctx.command_line()}  # kill -9 after step {cuts[0]}, then "
            + ", then ".join(f"{ctx.command_line(resume=True)}  # kill -9 after step {k}" for k in cuts[1:])
            + f", then {ctx.command_line(resume=True)}")


def _first_cut(ctx: CheckContext[ResumeCheck], runs: ResumeRuns) -> CheckResult | None:
    """A single kill's cut: the checkpoint kept of the uninterrupted run after ``after_step``,
    else one a run killed there left (:func:`interrupt`); the result that ends the check before
    the resume (a kill that tested nothing; no complete checkpoint for ``{latest_checkpoint}`` to
    name: it fails without launching the resume), else None with what the resume will load read."""
    cut = runs.cut = interrupt(ctx.pool, runs.request, runs.spec.after_step, runs.metric, label="resume-killed")
    if cut.error is not None and cut.killed is not None:
        return CheckResult("resume", "error", cut.error,
                           KillUntested(cut.killed.stderr_tail, cut.step, cut.killed.outcome, str(cut.killed.run_dir),
                                        cut.not_kept), time.monotonic() - runs.started, runs.reproduce)
    checkpoint_dir, killed_at = cut.checkpoint_dir, cut.step
    latest = runs.latest = latest_complete_checkpoint(checkpoint_dir)
    if latest is None and ctx.job_file.job.stop_after_steps and not _holds_files(checkpoint_dir):
        # a script with no steps option may save only at an epoch's end: not its failure, untested
        return CheckResult("resume", "error", no_checkpoint_before_end(
            ctx.job_file, checkpoint_dir, killed_at or runs.spec.after_step, "checks.resume.after_step"),
            NoCheckpointLeft(killed_at, str(checkpoint_dir), cut.as_evidence(),
                             cut.killed.stderr_tail if cut.killed is not None else "", [], []),
            time.monotonic() - runs.started, runs.reproduce)
    if latest is None and ctx.resumes_from_latest:  # {latest_checkpoint} would name nothing: not launched
        causes = diagnose_resume(ResumeFacts(0))
        return CheckResult(
            "resume", "failed",
            f"no complete checkpoint under {checkpoint_dir} to resume from ({cut.writer()}: "
            f"{describe_candidates(checkpoint_dir)}): all {killed_at} steps of progress lost; does "
            f"the job checkpoint before step {killed_at}?",
            NoCheckpointLeft(killed_at, str(checkpoint_dir), cut.as_evidence(),
                             cut.killed.stderr_tail if cut.killed is not None else "",
                             [c.text for c in causes], [c.as_evidence() for c in causes]),
            time.monotonic() - runs.started, runs.reproduce,
        )
    # what the resumed run will load, read before it writes newer checkpoints beside it
    runs.inventory = read_inventory(latest if latest is not None else checkpoint_dir)
    if latest is not None:
        runs.reproduce = _reproduce(ctx, latest.relative_to(checkpoint_dir))
    return None


def _holds_files(directory: Path) -> bool:
    return directory.is_dir() and any(p.is_file() for p in directory.rglob("*"))


def _runs(spec: ResumeCheck) -> list[Run]:
    if len(spec.cuts) == 1:
        return [Run("reference", reference=True),
                Run(f"resumed from the checkpoint kept after step {spec.after_step}", resumes=Resumes(spec.after_step))]
    return [Run("reference", reference=True), Run(f"killed after step {spec.cuts[0]}"),
            *(Run(f"resumed, killed after step {k}") for k in spec.cuts[1:]), Run("resumed to the end")]


#: resume: a killed and resumed run must match the uninterrupted one (docs/equivalence.md)
RESUME: Check[ResumeCheck] = Check(
    "resume", ResumeCheck, run=run_resume_check,
    runs=lambda spec, ctx: (_runs(spec), "the resumed trajectory must match the reference after the cut (a "
                            "checkpoint that cannot be kept from it: one more run, killed)"
                            if len(spec.cuts) == 1 else "every cycle must match the reference"),
    requires=lambda spec, facts: resume_problems(facts, "checks.resume") + [
        p for i, name in enumerate(spec.metrics or []) for p in metric_problems(facts, f"checks.resume.metrics[{i}]", name)],
    lane=True,
    calibrates=lambda spec: [None],
    evidence=(ResumeEvidence, ChainEvidence, KillUntested, NoCheckpointLeft, RunDidNotComplete, RunFailure),
)
