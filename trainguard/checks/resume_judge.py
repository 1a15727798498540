"""Judging a resume: the runs resumed from a cut against the uninterrupted run, for the resume
check (:mod:`trainguard.checks.resume`, which runs them, cycle by cycle).

Every resumed run is compared in one way (:func:`compare_resumed`: its progress metric, then
each other metric that counts, on the steps it ran after the step it resumed from,
:func:`where_resumed`), and the final checkpoints in one call (:func:`final_state`). A chain's
cycles are judged as each ends (:func:`judge_cycle`: the first that parts from the uninterrupted
run is named, and the later ones are not run); :func:`judge_resume` gives the verdict: a single
kill's with the diagnosis of a failed resume, a chain's with the cycle that failed.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from trainguard.checks.accounting import SampleAccounting, Segment, account_samples
from trainguard.checks.calibration import ToleranceUsed
from trainguard.checks.diagnosis import (
    LR_METRIC,
    RESUME_CAUSE_TEXT,
    ResumeFacts,
    explain,
    resume_diagnosis,
)
from trainguard.checks.difference_size import DifferenceSize
from trainguard.checks.divergence import (
    DivergenceEvidence,
    ObservedCause,
    observe_resume,
)
from trainguard.checks.divergence_noisy import observe_noisy_resume
from trainguard.checks.equivalence import TrajectoryDiff, compare_trajectories, failed_run
from trainguard.checks.equivalence_records import ChainCycle, ChainEvidence, ResumeEvidence
from trainguard.checks.interruption import Interruption, untested_kill
from trainguard.config import JobFile, ResumeCheck
from trainguard.evidence import UNSET, Evidence, RunDidNotComplete
from trainguard.launch import RunResult
from trainguard.launch.metrics import aligned_trajectories
from trainguard.launch.samples import read_samples
from trainguard.report import CheckResult, CheckStatus
from trainguard.run.request import RunRequest
from trainguard.unit.checkpoints import (
    CheckpointInventory,
    StateComparison,
    compare_checkpoint_dirs,
)

__all__ = [
    "LATER_CYCLE_CAUSES",
    "ResumeRuns",
    "compare_resumed",
    "final_state",
    "judge_cycle",
    "judge_resume",
    "reference_failed",
    "where_resumed",
]

#: why a later cycle fails when the first resumed cleanly
LATER_CYCLE_CAUSES = (
    "state a resume restores and the next save leaves out (a counter or buffer loaded from the "
    "checkpoint once and not written again): the first resume matched, a later one did not",
    "a checkpoint written differently by a resumed run than by a fresh one (keys, a step counter "
    "or the data position saved from the values at start rather than the current ones)",
)


@dataclass
class ResumeRuns:
    """What the resume check judges: its spec, tolerance and request, and the runs its context
    gave it (the reference, where each resume started, the resumed runs), gathered as they come."""

    job_file: JobFile
    spec: ResumeCheck
    metric: str
    tol: ToleranceUsed
    request: RunRequest
    reference: RunResult
    started: float
    reproduce: str
    #: where the next resume starts (a kept checkpoint, or one a killed run left)
    cut: Interruption = field(init=False)
    #: the newest complete checkpoint a single kill's cut left (None: none)
    latest: Path | None = None
    #: what a single kill's resumed run loaded, read before it wrote newer checkpoints beside it
    inventory: CheckpointInventory | None = None
    #: the run resumed last (a chain's: its last cycle)
    resumed: RunResult = field(init=False)
    #: a chain's cycles as reported (None: a single kill)
    chain: ChainEvidence | None = field(init=False)
    #: where a chain's cycles parted from the uninterrupted run (the first that did ends the chain)
    problems: list[str] = field(default_factory=list)
    #: a run with the run agent's step records for a failure's diagnosis (:meth:`CheckContext.recorded`)
    recorded: Callable[[RunResult], RunResult] = field(default=lambda run: run, repr=False)

    def __post_init__(self) -> None:
        self.chain = ChainEvidence(chain=self.spec.cuts, cycles=[], reference_run_dir=str(self.reference.run_dir),
                                   tolerance=self.tol.as_evidence()) if len(self.spec.cuts) > 1 else None

    def recorded_dirs(self) -> tuple[Path, Path]:
        """(the reference's run directory, the saving run's: the cut's) for a failure's
        diagnosis, which reads their step records: where the reference was kept without them
        (the profile's timed run, whose kept checkpoint the cut may be), the recorded one's."""
        recorded = self.recorded(self.reference)
        saved = self.cut.run_dir
        return recorded.run_dir, recorded.run_dir if saved == self.reference.run_dir else saved

    def result(self, status: CheckStatus, summary: str, evidence: Evidence) -> CheckResult:
        """The check's result, timed from its start."""
        return CheckResult("resume", status, summary, evidence, time.monotonic() - self.started, self.reproduce)


def where_resumed(first_step: int, expected: Mapping[int, float]) -> tuple[bool, int]:
    """(began again, the step resumed after) of a resumed run whose first step is
    ``first_step``: from scratch when it began at the uninterrupted run's first step (1, or 0
    for a job counting from 0, as nanoGPT's `iter 0`), resumed after no step (reported as 0)."""
    began_again = first_step <= min(expected, default=1)
    return began_again, 0 if began_again else first_step - 1


def compare_resumed(runs: ResumeRuns, run: RunResult, steps: range) -> list[TrajectoryDiff]:
    """``run`` against the uninterrupted run on ``steps``: the progress metric first (within the
    calibrated band), then each other metric ``spec.metrics`` names (default: all of
    job.metrics), on the steps the uninterrupted run printed it (a metric printed every N steps
    is compared every N). Every resumed run, a chain's every cycle, is compared by it."""
    spec, tol, reference = runs.spec, runs.tol, runs.reference
    out = []
    names = spec.metrics if spec.metrics is not None else list(runs.job_file.job.metrics)
    for name in [runs.metric, *(n for n in names if n != runs.metric)]:
        actual, expected = aligned_trajectories(run.points, reference.points, name)
        printed = steps if name == runs.metric else [s for s in expected if s in steps]
        if printed or name == runs.metric:  # the progress metric always: no step in common fails
            out.append(compare_trajectories(actual, expected, metric=name, steps=printed, rtol=spec.rtol,
                                            atol=spec.atol, band=tol.band(name)))
    return out


def final_state(runs: ResumeRuns) -> StateComparison:
    """The final checkpoints of the run resumed last against the uninterrupted run's, within the
    spec's rtol/atol: the one comparison of checkpoints a resume makes."""
    return compare_checkpoint_dirs(runs.resumed.checkpoints, runs.reference.checkpoints,
                                   rtol=runs.spec.rtol, atol=runs.spec.atol)


def reference_failed(runs: ResumeRuns) -> CheckResult:
    """The uninterrupted run did not complete: nothing to compare with."""
    if runs.chain is None:
        return failed_run("resume", runs.reference, runs.started, runs.reproduce)
    reference = runs.reference
    return runs.result("error", f"the uninterrupted run did not complete: {reference.reason}",
                       RunDidNotComplete(str(reference.run_dir), reference.stderr_tail))


def judge_cycle(runs: ResumeRuns, number: int, cut: int | None, run: RunResult) -> CheckResult | None:
    """The run of cycle ``number`` as it ended (killed after ``cut``, or run to the end): the
    result that ends the check now (it failed to run, or its kill tested nothing), else None. A
    chain's cycle is compared with the uninterrupted run here, its problems kept in
    ``runs.problems``; a single kill's resumed run is judged by :func:`judge_resume`."""
    if runs.chain is not None:
        return _judge_chain_cycle(runs, runs.chain, number, cut, run)
    return None if run.ok else failed_run("resume", run, runs.started, runs.reproduce)


def _judge_chain_cycle(runs: ResumeRuns, chain: ChainEvidence, number: int, cut: int | None,
                       run: RunResult) -> CheckResult | None:
    """A chain's cycle ``number`` against the uninterrupted run, recorded in ``chain``."""
    spec, metric, problems = runs.spec, runs.metric, runs.problems
    steps = sorted(p.step for p in run.points if p.name == metric)
    resumed_from = 0 if number == 1 or not steps else where_resumed(steps[0], runs.reference.trajectory(metric))[1]
    where = (f"cycle {number} ({'a fresh start' if number == 1 else f'resumed from step {resumed_from}'}"
             + (f", killed after step {cut})" if cut is not None else ", run to the end)"))
    cycle = ChainCycle(number, cut, resumed_from, run.last_step if cut is not None else None, [], str(run.run_dir))
    chain.cycles.append(cycle)
    if cut is not None:
        why = untested_kill(run, metric, cut, spec.steps, what=f"the run of {where}")
        if why is not None:
            return runs.result("error", why, chain)
    elif not run.ok:
        problems.append(f"{where}: the job did not complete: {run.reason}")
    if not steps:
        problems.append(f"{where}: the run printed no `{metric}` line")
    else:
        if number > 1 and resumed_from == 0:
            problems.append(f"{where}: the resumed run started again from step {steps[0]}: no usable checkpoint")
        # a killed run's last printed step may lack the lines that follow its progress line
        # (the kill landed between them): compared up to the step before it, or the cut step
        last = spec.steps if cut is None else max(min(cut, steps[-1]), steps[-1] - 1)
        diffs = compare_resumed(runs, run, range(steps[0], last + 1))
        cycle.metrics = [d.as_evidence() for d in diffs]
        found = [p for p in (_cycle_problem(d) for d in diffs) if p]
        problems += [f"{where}: " + "; ".join(found)] if found else []
    if problems:
        chain.failing_cycle = number
    return None


def _cycle_problem(diff: TrajectoryDiff) -> str | None:
    if diff.first_divergent_step is not None:
        a, b = diff.first_values or (math.nan, math.nan)
        return (f"{diff.metric} diverges from the uninterrupted run at step {diff.first_divergent_step} "
                f"({a!r} vs {b!r}; max abs diff {diff.max_abs_diff:.3g})")
    if not diff.ok:
        return f"{diff.metric} {diff.missing_words()}"
    return None


def judge_resume(runs: ResumeRuns) -> CheckResult:
    """The verdict of a resume whose runs all ran: a chain's by its cycles (:func:`judge_cycle`),
    a single kill's resumed run against the uninterrupted one: trajectories, final checkpoints,
    samples; a failure with its likely causes."""
    if runs.chain is not None:
        return _judge_chain(runs, runs.chain)
    spec, metric, tol, request, reference, cut, resumed = (
        runs.spec, runs.metric, runs.tol, runs.request, runs.reference, runs.cut, runs.resumed)
    inventory, reproduce, killed_at = runs.inventory, runs.reproduce, runs.cut.step
    actual, expected = aligned_trajectories(resumed.points, reference.points, metric)
    evidence = ResumeEvidence(
        after_step=spec.after_step, killed_after_step=killed_at,
        run_dirs={"reference": str(reference.run_dir), ("killed" if cut.kept is None else "kept_from"): str(cut.run_dir),
                  "resumed": str(resumed.run_dir)},
        interruption=cut.as_evidence(),
    )
    if not actual:
        return runs.result("failed", f"the resumed run printed no `{metric}` line", evidence)
    first_step = min(actual)
    began_again, resumed_from = where_resumed(first_step, expected)
    lost = max(0, (killed_at or spec.after_step) - (first_step - 1))
    evidence.resumed_from_step, evidence.steps_lost = resumed_from, lost
    if "resumed_from" in resumed.evidence:
        evidence.resumed_from_checkpoint = resumed.evidence["resumed_from"]
    diff, *others = compare_resumed(runs, resumed, range(first_step, spec.steps + 1))
    evidence.trajectory, evidence.tolerance = diff.as_evidence(), tol.as_evidence()
    if others:
        evidence.other_metrics = [d.as_evidence() for d in others]
    state = final_state(runs)
    evidence.state = state.as_evidence()
    accounting = _resume_accounting(reference, cut.run_dir, resumed, expected, spec.steps, first_step)
    evidence.sample_accounting = accounting.as_evidence()
    problems = _progress_problems(spec, first_step, killed_at, lost, began_again)
    problems += _trajectory_problems(metric, diff, others, tol)
    if state.differing and tol.exact_state:  # a calibrated noisy job: every tensor differs
        problems.append(f"final checkpoints differ in {state.summary()}")
    duration = time.monotonic() - runs.started
    if problems:
        divergent = [d.first_divergent_step for d in (diff, *others) if d.first_divergent_step is not None]
        facts = ResumeFacts(
            resumed_from, first_divergent_step=min(divergent, default=None), checkpoint=inventory,
            final_state=state, lr=_lr_divergence(runs.job_file, resumed, reference, first_step, spec),
            metrics={d.metric: d.first_divergent_step for d in (diff, *others)}, world_size=request.world_size,
            samples_accounted=accounting.summary() if accounting.known and not accounting.ok else None,
            began_again=began_again, on_gpu=any(v > 0 for v in reference.peak_gpu_mb.values()),
            boundary_compared=first_step in expected, counted_from=0 if 0 in expected else 1,
            last_step=max(expected) if 0 in expected else spec.steps, difference=_difference(tol, diff, *others),
        )
        reference_dir, saved_dir = runs.recorded_dirs()
        noisy = _observed_noisy(runs, facts, (reference_dir, saved_dir)) if not tol.exact_state else None
        causes, found = resume_diagnosis(
            reference_dir=reference_dir, resumed_dir=resumed.run_dir, world_size=request.world_size,
            steps=spec.steps, facts=facts, saved_dir=saved_dir,
        )
        if noisy is not None:
            found.first_divergence = noisy
        evidence.diagnosis = found
        evidence.likely_causes = [c.text for c in causes if not c.ruled_out]
        why = explain(causes)
        summary = "; ".join(problems) + (f". {why[0].upper()}{why[1:]}" if why else "")
        return runs.result("failed", summary, evidence)
    if uncompared := state.uncompared_problem("checks.resume", spec.allow_uncompared):
        return runs.result("error", f"{cut.words()}, resumed from step {resumed_from}; steps "
                           f"{first_step}-{max(expected)} match the uninterrupted run, but {uncompared}", evidence)
    state_note = (
        f", final checkpoints equal ({Path(state.files[0]).name})" if state.compared and state.files and state.ok
        else " (final state not judged: the calibrated job is not bitwise deterministic)" if state.compared
        and not state.uncompared
        else state.note("checks.resume")
    ) + tol.within()
    compared = f" in {', '.join([metric, *(d.metric for d in others)])}" if others else ""
    return CheckResult(
        "resume",
        "passed",
        f"{cut.words()}, resumed from step {resumed_from} ({lost} steps lost); "
        f"steps {first_step}-{max(expected)} match the uninterrupted run{compared}{state_note}",
        evidence,
        duration,
        reproduce,
    )


def _difference(tol: ToleranceUsed, *diffs: TrajectoryDiff) -> DifferenceSize | None:
    """The first divergent step's values of the metric that parts first, and the calibrated
    spread there (what :mod:`trainguard.checks.difference_size` weighs)."""
    parted = [d for d in diffs if d.first_divergent_step is not None and d.first_values is not None]
    if not parted:
        return None
    first = min(parted, key=lambda d: d.first_divergent_step or 0)
    step, (a, b) = first.first_divergent_step or 0, first.first_values or (math.nan, math.nan)
    if not (math.isfinite(a) and math.isfinite(b)):
        return None
    return DifferenceSize(first.metric, step, a, b, tol.ratio(first.metric, step, abs(a - b)))


def _observed_noisy(runs: ResumeRuns, facts: ResumeFacts, dirs: tuple[Path, Path]) -> DivergenceEvidence | None:
    """A calibrated noisy job's resume: its step records against the uninterrupted run's as whole
    runs, the sums of squares within the calibrated spread (bit for bit every tensor differs);
    the causes that shows go into ``facts`` (the exact comparison is then not made)."""
    facts.exact_records = False
    if facts.resumed_from <= 0 or facts.began_again:
        return None
    found, observed = observe_noisy_resume(
        dirs[0], runs.resumed.run_dir, dirs[1], tolerance=runs.tol.ss_tolerance(),
        resumed_from=facts.resumed_from, counted_from=facts.counted_from,
        last_printed=facts.last_step if facts.last_step is not None else runs.spec.steps)
    facts.observed = tuple(observed)
    return found


def _resume_accounting(reference: RunResult, killed_dir: Path, resumed: RunResult, expected: Mapping[int, float],
                       steps: int, first_step: int) -> SampleAccounting:
    """The samples the killed run (up to the step the resume went on from) and the resumed run
    (from ``first_step``) trained, against the uninterrupted run's."""
    began_again, resumed_from = where_resumed(first_step, expected)
    # steps from 1, or from 0 (nanoGPT's `iter 0` through `iter N`, `epoch 0` through N - 1)
    base = 0 if 0 in expected else 1
    last = max(expected, default=steps) if base == 0 else steps
    return account_samples(read_samples(reference.run_dir), [
        Segment(read_samples(killed_dir), base, resumed_from if not began_again else base - 1, "before the kill"),
        Segment(read_samples(resumed.run_dir), first_step, last, f"after the resume at step {resumed_from}"),
    ], steps=last - base + 1, first_step=base)


def _progress_problems(spec: ResumeCheck, first_step: int, killed_at: int | None, lost: int,
                       began_again: bool) -> list[str]:
    """The progress the resume lost: all of it (it began again), or more than ``max_lost_steps``."""
    problems = []
    if began_again:
        problems.append(
            f"the resumed run started again from step {first_step}: no usable checkpoint, all "
            f"{killed_at} steps of progress lost (does the job checkpoint before it exits, "
            "and does resume_args make it load the latest one?)"
        )
    if spec.max_lost_steps is not None and lost > spec.max_lost_steps:
        problems.append(f"{lost} steps of progress lost (max_lost_steps {spec.max_lost_steps})")
    return problems


def _trajectory_problems(metric: str, diff: TrajectoryDiff, others: Sequence[TrajectoryDiff],
                         tol: ToleranceUsed) -> list[str]:
    """Where the resumed run parts from the uninterrupted one: in the progress ``metric``
    (``diff``, with the tolerance it was allowed), then in each other metric."""
    problems = []
    if not diff.ok:
        if diff.first_divergent_step is not None:
            a, b = diff.first_values or (math.nan, math.nan)
            problems.append(
                f"{metric} diverges from the uninterrupted run at step {diff.first_divergent_step} "
                f"(resumed {a!r} vs reference {b!r}; max abs diff {diff.max_abs_diff:.3g}, "
                f"max rel diff {diff.max_rel_diff:.3g}{tol.words(metric, diff.first_divergent_step, abs(a - b))})"
            )
        else:
            problems.append(f"the resumed run {diff.missing_words()}")
    for other in others:
        if other.first_divergent_step is not None:
            a, b = other.first_values or (math.nan, math.nan)
            problems.append(
                f"{other.metric} diverges from the uninterrupted run at step {other.first_divergent_step} "
                f"(resumed {a!r} vs reference {b!r}; max abs diff {other.max_abs_diff:.3g})"
                + (f" while {metric} matches" if diff.ok else "")
            )
    return problems


def _lr_divergence(
    job_file: JobFile, resumed: RunResult, reference: RunResult, first_step: int, spec: ResumeCheck
) -> tuple[int | None, str] | None:
    """Where a learning-rate metric the job prints first differs after the resume."""
    name = next((m for m in job_file.job.metrics if LR_METRIC.match(m)), None)
    if name is None:
        return None
    actual, expected = aligned_trajectories(resumed.points, reference.points, name)
    if not actual:
        return None
    diff = compare_trajectories(actual, expected, metric=name, steps=range(first_step, spec.steps + 1),
                                rtol=max(spec.rtol, 1e-6), atol=spec.atol)
    return diff.first_divergent_step, name


def _judge_chain(runs: ResumeRuns, chain: ChainEvidence) -> CheckResult:
    """A chain's verdict: the cycle that parted from the uninterrupted run, or, when every cycle
    ran and matched, the final checkpoints; the samples the cycles trained twice or never."""
    spec, tol, problems, cuts = runs.spec, runs.tol, runs.problems, runs.spec.cuts
    state: StateComparison | None = None  # compared only after a last cycle that matched
    if not problems:
        state = final_state(runs)
        chain.state = state.as_evidence()
        if state.differing and tol.exact_state:
            problems.append(f"after the last cycle the final checkpoints differ in {state.summary()}")
            chain.failing_cycle = len(cuts) + 1
        elif uncompared := state.uncompared_problem("checks.resume", spec.allow_uncompared):
            return runs.result("error", f"every cycle matches the uninterrupted run, but {uncompared}", chain)
    accounting = _chain_accounting(runs.reference, chain.cycles, spec.steps)
    chain.sample_accounting = accounting.as_evidence()
    if problems:
        if accounting.known and not accounting.ok:
            problems.append(accounting.summary())
        failing = chain.failing_cycle if chain.failing_cycle is not UNSET else len(cuts) + 1
        chain.likely_causes, note = _failing_cycle_causes(failing)
        observed = _observed_cycle(runs, chain, failing)
        if observed:
            chain.likely_causes = [f"{RESUME_CAUSE_TEXT[c.key]}: {c.observation}" for c in observed] + chain.likely_causes
            note += f". Most likely {RESUME_CAUSE_TEXT[observed[0].key].split(' (')[0]}: {observed[0].observation}"
        return runs.result("failed", "; ".join(problems) + note, chain)
    spans = ", ".join(f"{c.resumed_from_step}->{c.killed_after_step if c.killed_after_step is not None else spec.steps}"
                      for c in chain.cycles[1:])
    return runs.result("passed", f"{len(cuts)} kills after steps {', '.join(map(str, cuts))}, each resumed from "
                       f"the checkpoint the kill before left (resumed spans {spans}): every cycle matches the "
                       f"uninterrupted run{_state_words(state, tol)}", chain)


def _observed_cycle(runs: ResumeRuns, chain: ChainEvidence, failing: int) -> list[ObservedCause]:
    """The causes the step records of a chain's failing cycle (a resumed one) show against the
    uninterrupted run's, with what the cycle before it saved; where they first differ is set on
    ``chain``. Nothing for a first cycle (no resume) or without step records."""
    if not 2 <= failing <= len(chain.cycles):
        return []
    cycle, before = chain.cycles[failing - 1], chain.cycles[failing - 2]
    expected = runs.reference.trajectory(runs.metric)
    counted_from = 0 if 0 in expected else 1
    last = max(expected) if counted_from == 0 else runs.spec.steps
    reference_dir = runs.recorded(runs.reference).run_dir
    if not runs.tol.exact_state:  # a calibrated noisy job: whole runs, within the calibrated spread
        found, observed = observe_noisy_resume(reference_dir, Path(cycle.run_dir), Path(before.run_dir),
                                               tolerance=runs.tol.ss_tolerance(), resumed_from=cycle.resumed_from_step,
                                               counted_from=counted_from, last_printed=last)
    else:
        found, observed = observe_resume(reference_dir, Path(cycle.run_dir), Path(before.run_dir),
                                         resumed_from=cycle.resumed_from_step, counted_from=counted_from,
                                         last_printed=last)
    if found is not None:
        chain.first_divergence = found
    return observed


def _chain_accounting(reference: RunResult, cycles: list[ChainCycle], steps: int) -> SampleAccounting:
    """The samples of the cycles run, each cycle's up to the step the next resumed from."""
    segments = []
    for cycle, after in zip(cycles, [*cycles[1:], None], strict=True):
        last = after.resumed_from_step if after is not None else steps
        label = "in cycle 1" if cycle.cycle == 1 else f"in cycle {cycle.cycle} (resumed from step {cycle.resumed_from_step})"
        segments.append(Segment(read_samples(Path(cycle.run_dir)), cycle.resumed_from_step + 1, last, label))
    return account_samples(read_samples(reference.run_dir), segments, steps=steps)


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


def _state_words(state: StateComparison | None, tol: ToleranceUsed) -> str:
    """What a passing summary says of the final checkpoints it compared (or did not)."""
    if state is None:
        return ""
    if state.ok:
        return ", final checkpoints equal"
    if state.compared and not state.uncompared and not tol.exact_state:
        return " (final state not judged: the calibrated job is not bitwise deterministic)"
    return state.note("checks.resume")
