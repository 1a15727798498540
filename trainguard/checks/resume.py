"""The resume check (registered here): a single kill and resume
(:func:`run_resume`, judged by :func:`trainguard.checks.equivalence.judge_resume`), or chained resumes: one run killed after
each step of ``checks.resume.chain`` and resumed from the checkpoint the kill before left, each
cycle compared with the uninterrupted run.

A bug that shows only on the second resume -- state a resume restores and the next save leaves
out (a counter loaded once and never written again), a checkpoint that resumes only from a fresh
start -- passes a single kill. The cycle that fails and its cut are named: ``cycle 2 (resumed
from step 10, killed after step 27)``.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path

from trainguard.checks.accounting import (
    AccountingEvidence,
    SampleAccounting,
    Segment,
    account_samples,
)
from trainguard.checks.calibration import ToleranceEvidence, ToleranceUsed
from trainguard.checks.context import CheckContext
from trainguard.checks.diagnosis import ResumeFacts, diagnose_resume, read_inventory
from trainguard.checks.equivalence import (
    ResumeRuns,
    TrajectoryDiff,
    compare_trajectories,
    failed_run,
    judge_resume,
    other_metric_diffs,
)
from trainguard.checks.equivalence_records import (
    KillUntested,
    NoCheckpointLeft,
    ResumeEvidence,
    RunFailure,
    TrajectoryEvidence,
)
from trainguard.checks.interruption import Interruption, interrupt, kill_after, untested_kill
from trainguard.config import JobFile, ResumeCheck
from trainguard.config.problems import metric_problems, resume_problems
from trainguard.config.registry import Check, Resumes, Run
from trainguard.evidence import UNSET, Evidence, RunDidNotComplete, Unset
from trainguard.launch import RunResult
from trainguard.launch.metrics import aligned_trajectories
from trainguard.launch.samples import read_samples
from trainguard.report import CheckResult, CheckStatus
from trainguard.unit.checkpoints import (
    StateComparison,
    compare_checkpoint_dirs,
    describe_candidates,
    latest_complete_checkpoint,
)
from trainguard.unit.checkpoints.compare import StateEvidence

__all__ = ["RESUME", "ChainCycle", "ChainEvidence", "run_resume", "run_resume_chain", "run_resume_check"]

#: why a later cycle fails when the first resumed cleanly
LATER_CYCLE_CAUSES = (
    "state a resume restores and the next save leaves out (a counter or buffer loaded from the "
    "checkpoint once and not written again): the first resume matched, a later one did not",
    "a checkpoint written differently by a resumed run than by a fresh one (keys, a step counter "
    "or the data position saved from the values at start rather than the current ones)",
)


@dataclass
class ChainCycle(Evidence):
    """One cycle: the run resumed from the cycle before's checkpoint (the first: a fresh start),
    killed after ``cut`` (the last: run to the end)."""

    cycle: int
    #: the step it was killed after as asked (None: the last cycle, run to the end)
    cut: int | None
    resumed_from_step: int
    killed_after_step: int | None
    #: :meth:`TrajectoryDiff.as_evidence` per metric compared, the progress metric first
    metrics: list[TrajectoryEvidence]
    run_dir: str


@dataclass
class ChainEvidence(Evidence):
    """The chained resume check's evidence (docs/equivalence.md, "Chained resumes")."""

    chain: list[int]
    cycles: list[ChainCycle]
    reference_run_dir: str
    #: :meth:`~trainguard.checks.calibration.ToleranceUsed.as_evidence`: what was allowed, and why
    tolerance: ToleranceEvidence
    #: the final checkpoints compared
    state: StateEvidence | Unset = UNSET
    #: :meth:`SampleAccounting.as_evidence` over the cycles run: samples trained twice or never
    sample_accounting: AccountingEvidence | Unset = UNSET
    failing_cycle: int | Unset = UNSET
    likely_causes: list[str] | Unset = UNSET


def _diffs(job_file: JobFile, spec: ResumeCheck, metric: str, run: RunResult, reference: RunResult,
           steps: range, tol: ToleranceUsed) -> list[TrajectoryDiff]:
    """The run against the reference on ``steps``, in the progress metric and every other
    metric that counts (``spec.metrics``, default all of job.metrics)."""
    actual, expected = aligned_trajectories(run.points, reference.points, metric)
    progress = compare_trajectories(actual, expected, metric=metric,
                                    steps=[s for s in expected if s in steps],
                                    rtol=spec.rtol, atol=spec.atol, band=tol.band(metric))
    return [progress, *other_metric_diffs(job_file, spec, metric, run, reference, steps, tol)]


def _problem(diff: TrajectoryDiff) -> str | None:
    if diff.first_divergent_step is not None:
        a, b = diff.first_values or (math.nan, math.nan)
        return (f"{diff.metric} diverges from the uninterrupted run at step {diff.first_divergent_step} "
                f"({a!r} vs {b!r}; max abs diff {diff.max_abs_diff:.3g})")
    if not diff.ok:
        return f"{diff.metric} {diff.missing_words()}"
    return None


def _accounting(reference: RunResult, cycles: list[ChainCycle], steps: int) -> SampleAccounting:
    """The samples of the cycles run, each cycle's up to the step the next resumed from."""
    segments = []
    for cycle, after in zip(cycles, [*cycles[1:], None], strict=True):
        last = after.resumed_from_step if after is not None else steps
        label = "in cycle 1" if cycle.cycle == 1 else f"in cycle {cycle.cycle} (resumed from step {cycle.resumed_from_step})"
        segments.append(Segment(read_samples(Path(cycle.run_dir)), cycle.resumed_from_step + 1, last, label))
    return account_samples(read_samples(reference.run_dir), segments, steps=steps)


def _diff_problems(where: str, diffs: list[TrajectoryDiff]) -> list[str]:
    """The metrics a cycle parts from the uninterrupted run in, as one problem named by ``where``."""
    found = [p for p in (_problem(d) for d in diffs) if p]
    return [f"{where}: " + "; ".join(found)] if found else []


def _failing_cycle_causes(failing: int) -> tuple[list[str], str]:
    """(the likely causes, a note for the summary) of a chain whose cycle ``failing`` failed:
    what the cycles before it show depends on how many resumes they made."""
    if failing > 2:
        return (list(LATER_CYCLE_CAUSES),
                f"; cycles 1-{failing - 1} matched, so the state is lost only by a resumed run's save")
    if failing == 2:
        return ["the first resume already differs: run `checks.resume` with a single kill (after_step) "
                "for the diagnosis of a failed resume"], ""
    return ["the run differs from the uninterrupted one before any resume: the job is not "
            "deterministic (the determinism check names why)"], ""


def _resume_reproduce(ctx: CheckContext[ResumeCheck], after_step: int, latest: Path | None = None) -> str:
    """Both commands of a resume, runnable as printed in a fresh directory; ``latest``: the
    checkpoint the killed run left, relative to its checkpoint directory (the same name in the
    fresh one is what ``{latest_checkpoint}`` then names)."""
    return (
        f"{ctx.command_line()}  # kill -9 after step {after_step}, then: "
        f"{ctx.command_line(resume=True, latest_checkpoint=latest)}"
    )


def run_resume(ctx: CheckContext[ResumeCheck]) -> CheckResult:
    """Reference run of ``steps``; a second run SIGKILLed right after ``after_step``; resumed in
    new processes with ``resume_args``; the resumed steps must equal the reference's."""
    runs = _resume_runs(ctx, time.monotonic())
    return runs if isinstance(runs, CheckResult) else judge_resume(runs)


def _resume_runs(ctx: CheckContext[ResumeCheck], started: float) -> ResumeRuns | CheckResult:
    """The runs of a single-kill resume from the context, or the result that ends the check
    before they are all there (a run that failed, a kill that tested nothing)."""
    spec, metric, request = ctx.spec, ctx.metric, ctx.request
    reproduce = _resume_reproduce(ctx, spec.after_step)
    runs = ResumeRuns(ctx.job_file, spec, metric, ctx.tolerance, request, ctx.reference(), started, reproduce)
    if not runs.reference.ok:
        return failed_run("resume", runs.reference, started, reproduce)
    runs.cut = interrupt(ctx.pool, request, spec.after_step, metric, label="resume-killed")
    stopped = _stopped_before_resume(runs, ctx.resumes_from_latest)
    if stopped is not None:
        return stopped
    if runs.latest is not None:
        runs.reproduce = _resume_reproduce(ctx, spec.after_step, runs.latest.relative_to(runs.cut.checkpoint_dir))
    runs.resumed = ctx.resume(runs.cut, label="resume-resumed")
    if not runs.resumed.ok:
        return failed_run("resume", runs.resumed, started, runs.reproduce)
    return runs


def _stopped_before_resume(runs: ResumeRuns, resumes_from_latest: bool) -> CheckResult | None:
    """The result that ends the check before the resume (a kill that tested nothing, no
    complete checkpoint for ``{latest_checkpoint}`` to name), else None with what the resume
    will load read."""
    cut, started, reproduce = runs.cut, runs.started, runs.reproduce
    killed_at = cut.step
    if cut.error is not None and cut.killed is not None:
        return CheckResult(
            "resume", "error", cut.error, KillUntested(cut.killed.stderr_tail, killed_at, cut.killed.outcome,
                                                       str(cut.killed.run_dir), cut.not_kept),
            time.monotonic() - started, reproduce
        )
    checkpoint_dir = cut.checkpoint_dir
    latest = runs.latest = latest_complete_checkpoint(checkpoint_dir)
    if latest is None and resumes_from_latest:  # {latest_checkpoint} would name nothing: not launched
        return _no_checkpoint_left(cut, time.monotonic() - started, reproduce)
    # what the resumed run will load, read before it writes newer checkpoints beside it
    runs.inventory = read_inventory(latest if latest is not None else checkpoint_dir)
    return None


def _no_checkpoint_left(cut: Interruption, duration: float, reproduce: str) -> CheckResult:
    """The killed run left no complete checkpoint, so a resume from the latest one has nothing
    to name: the check fails without launching it."""
    causes = diagnose_resume(ResumeFacts(0))
    checkpoint_dir, killed_at = cut.checkpoint_dir, cut.step
    return CheckResult(
        "resume", "failed",
        f"no complete checkpoint under {checkpoint_dir} to resume from ({cut.writer()}: "
        f"{describe_candidates(checkpoint_dir)}): all {killed_at} steps of progress lost; does "
        f"the job checkpoint before step {killed_at}?",
        NoCheckpointLeft(killed_at, str(checkpoint_dir), cut.as_evidence(),
                         cut.killed.stderr_tail if cut.killed is not None else "",
                         [c.text for c in causes], [c.as_evidence() for c in causes]),
        duration, reproduce,
    )


def run_resume_check(ctx: CheckContext[ResumeCheck]) -> CheckResult:
    """The resume check: chained when ``chain`` lists more than one kill, else a single one."""
    return run_resume_chain(ctx) if len(ctx.spec.cuts) > 1 else run_resume(ctx)


def run_resume_chain(ctx: CheckContext[ResumeCheck]) -> CheckResult:
    """The reference; a fresh run killed after ``chain[0]``; then each later cut: resumed from
    the checkpoint directory the kills share and killed again; last, resumed to the end."""
    started = time.monotonic()
    spec, metric, tol = ctx.spec, ctx.metric, ctx.tolerance
    cuts = spec.cuts
    reproduce = (f"{ctx.command_line()}  # kill -9 after step {cuts[0]}, then "
                 + ", then ".join(f"{ctx.command_line(resume=True)}  # kill -9 after step {k}"
                                  for k in cuts[1:])
                 + f", then {ctx.command_line(resume=True)}")

    def done(status: CheckStatus, summary: str, evidence: Evidence) -> CheckResult:
        return CheckResult("resume", status, summary, evidence, time.monotonic() - started, reproduce)

    reference = ctx.reference()
    if not reference.ok:
        return done("error", f"the uninterrupted run did not complete: {reference.reason}",
                    RunDidNotComplete(str(reference.run_dir), reference.stderr_tail))
    evidence = ChainEvidence(chain=cuts, cycles=[], reference_run_dir=str(reference.run_dir),
                             tolerance=tol.as_evidence())
    checkpoint_dir: Path | None = None
    problems: list[str] = []
    start = min(reference.trajectory(metric), default=1)  # 1, or 0 for a job counting from 0
    state: StateComparison | None = None  # the final checkpoints', compared after the last cycle
    for i, cut in enumerate([*cuts, None], start=1):
        run = ctx.run(ctx.runs[i].run, label=f"resume-chain-{i}" + ("-killed" if cut is not None else ""),
                         resume=i > 1, checkpoint_dir=checkpoint_dir,
                         # the kill waits for every metric line of the cut step the reference has
                         on_metric=None if cut is None else kill_after(metric, cut, reference.points))
        checkpoint_dir = checkpoint_dir or run.checkpoints
        steps = sorted(p.step for p in run.points if p.name == metric)
        resumed_from = 0 if i == 1 or not steps or steps[0] <= start else steps[0] - 1
        where = (f"cycle {i} ({'a fresh start' if i == 1 else f'resumed from step {resumed_from}'}"
                 + (f", killed after step {cut})" if cut is not None else ", run to the end)"))
        cycle = ChainCycle(i, cut, resumed_from, run.last_step if cut is not None else None, [], str(run.run_dir))
        evidence.cycles.append(cycle)
        if cut is not None:
            why = untested_kill(run, metric, cut, spec.steps, what=f"the run of {where}")
            if why is not None:
                return done("error", why, evidence)
        elif not run.ok:
            problems.append(f"{where}: the job did not complete: {run.reason}")
        if not steps:
            problems.append(f"{where}: the run printed no `{metric}` line")
        else:
            if i > 1 and resumed_from == 0:
                problems.append(f"{where}: the resumed run started again from step {steps[0]}: no usable checkpoint")
            # a killed run's last printed step may lack the lines that follow its progress line
            # (the kill landed between them): compared up to the step before it, or the cut step
            last = spec.steps if cut is None else max(min(cut, steps[-1]), steps[-1] - 1)
            diffs = _diffs(ctx.job_file, spec, metric, run, reference, range(steps[0], last + 1), tol)
            cycle.metrics = [d.as_evidence() for d in diffs]
            problems += _diff_problems(where, diffs)
        if problems:
            evidence.failing_cycle = i
            break
    else:
        state = compare_checkpoint_dirs(checkpoint_dir, reference.checkpoints, rtol=spec.rtol, atol=spec.atol) \
            if checkpoint_dir is not None else None
        if state is not None:
            evidence.state = state.as_evidence()
            if state.differing and tol.exact_state:
                problems.append(f"after the last cycle the final checkpoints differ in {state.summary()}")
                evidence.failing_cycle = len(cuts) + 1
            elif uncompared := state.uncompared_problem("checks.resume", spec.allow_uncompared):
                return done("error", f"every cycle matches the uninterrupted run, but {uncompared}",
                            evidence)
    accounting = _accounting(reference, evidence.cycles, spec.steps)
    evidence.sample_accounting = accounting.as_evidence()
    if problems:
        if accounting.known and not accounting.ok:
            problems.append(accounting.summary())
        failing = evidence.failing_cycle if evidence.failing_cycle is not UNSET else len(cuts) + 1
        evidence.likely_causes, note = _failing_cycle_causes(failing)
        return done("failed", "; ".join(problems) + note, evidence)
    spans = ", ".join(f"{c.resumed_from_step}->{c.killed_after_step if c.killed_after_step is not None else spec.steps}"
                      for c in evidence.cycles[1:])
    return done("passed", f"{len(cuts)} kills after steps {', '.join(map(str, cuts))}, each resumed from the "
                f"checkpoint the kill before left (resumed spans {spans}): every cycle matches the "
                f"uninterrupted run{_state_words(state, tol)}", evidence)


def _state_words(state: StateComparison | None, tol: ToleranceUsed) -> str:
    """What a passing summary says of the final checkpoints it compared (or did not)."""
    if state is None:
        return ""
    if state.ok:
        return ", final checkpoints equal"
    if state.compared and not state.uncompared and not tol.exact_state:
        return " (final state not judged: the calibrated job is not bitwise deterministic)"
    return state.note("checks.resume")


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
