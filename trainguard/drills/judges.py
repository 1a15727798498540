"""The judges of a fault drill: what the run that took the fault must show for each expectation
(docs/drills.md).

* :func:`judge_recover` (``recover``): the job completed after at most ``max_restarts``
  restarts, matches the uninterrupted run and lost at most ``max_lost_steps`` steps;
  :func:`trainguard.drills.ray_recover.judge_ray_recover` is its form for a ray_train job
  whose worker died (Ray Train's FailureConfig restarts the workers inside one fit);
* :func:`judge_fail_clean` (``fail_clean``): the job exited by itself within the deadline with
  an error, and a resume from its latest checkpoint matches;
* :func:`judge_continue` (``continue``): the job ran through the fault at a step rate of at least
  ``min_rate`` of the rate before and matches.

Each takes a :class:`DrillContext` (what the driver saw) and returns a :class:`Judgement`; none
launches anything except fail_clean's verification run through the runner.
:mod:`trainguard.drills.expectations` registers each; ``dispatch.judge_for`` picks a drill's.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple, TypeVar

from trainguard.checks.accounting import SampleAccounting
from trainguard.checks.equivalence import TrajectoryDiff, compare_trajectories
from trainguard.config import DrillSpec
from trainguard.drills.evidence import (
    AttemptEvidence,
    CheckpointIntact,
    ContinueEvidence,
    DrillEvidence,
    ExitEvidence,
    ExitOfRank,
    FailCleanEvidence,
    RecoverEvidence,
    Resume,
    StepRate,
)
from trainguard.drills.observed import observed_restart
from trainguard.drills.steps import attempts_accounting, judged_steps
from trainguard.evidence import UNSET, known
from trainguard.faults.base import Fault
from trainguard.launch import MetricPoint, RunResult, attribution_words
from trainguard.launch.metrics import aligned_trajectories, first_step, step_rate
from trainguard.launch.reported import reported_line
from trainguard.report import CheckStatus
from trainguard.run.request import RunRequest
from trainguard.run.runner import JobRunner, SupervisedRun
from trainguard.unit.checkpoints import compare_checkpoint_dirs

if TYPE_CHECKING:  # pragma: no cover
    from trainguard.launch.reach import RankWatch

__all__ = [
    "DRILL_CAUSES",
    "DrillContext",
    "FailCleanStart",
    "Injection",
    "Judge",
    "Judgement",
    "attempt_evidence",
    "common_evidence",
    "diff_problem",
    "exit_problems",
    "fail_clean_start",
    "fail_clean_verdict",
    "final_state_words",
    "judge_continue",
    "judge_fail_clean",
    "judge_injected",
    "judge_recover",
    "new_stderr",
    "not_injected",
    "recover_causes",
    "recovered_run_problems",
    "trajectory_diff",
    "verify_resume",
]

DRILL_CAUSES = {
    "recover": (
        "no checkpoint before the fault (checkpoints only at exit, or too rarely for the run)",
        "resume_args do not make the job load the latest checkpoint",
        "state missing from the checkpoint (optimizer, scheduler, RNG, data position)",
        "a checkpoint written in place, torn by the kill",
    ),
    "fail_clean": (
        "no timeout on collectives: a rank waits forever for a stuck or dead peer "
        "(init_process_group(timeout=...) / NCCL_ASYNC_ERROR_HANDLING)",
        "the error is caught and swallowed, and the job goes on or exits 0",
        "a checkpoint overwritten in place: the failure leaves it torn",
    ),
    "continue": (
        "blocking I/O in the training loop (tracking or logging calls without a timeout)",
        "retries without a bound or with a long fixed sleep",
    ),
}


class Judgement(NamedTuple):
    """A judge's verdict on one drill: the check's status, its one line for people, and the
    evidence (its expectation's record; the driver adds where the drill's files are)."""

    status: CheckStatus
    summary: str
    evidence: DrillEvidence


E = TypeVar("E", bound=DrillEvidence)


#: a judge: what the driver saw -> its verdict
Judge = Callable[["DrillContext"], Judgement]


@dataclass
class Injection:
    """What happened around the fault; filled from the launcher's monitor thread and the watch."""

    watch_rank: int
    injected_mono: float | None = None  # time.monotonic() at injection
    injected_step: int | None = None
    target_exited_before: bool = False  # the target rank had already exited at injection
    first_exit: tuple[int, int | None, float] | None = None  # (rank, returncode, elapsed)
    stopped_at_deadline: bool = False
    first_step_after_restart_mono: float | None = None
    stderr_offsets: dict[int, int] = field(default_factory=dict)
    run_dir: Path | None = None
    errors: list[str] = field(default_factory=list)
    inject_failed: str | None = None  # what Fault.inject raised: nothing was tested
    #: the processes that run the ranks as they start (attempt 0), as the backend's reach watches
    #: them (a ray_train job: the driver's stderr, read for the workers' pids)
    tracker: RankWatch | None = None
    ray_workers_at_injection: dict[int, int] = field(default_factory=dict)
    #: launcher elapsed time of the first metric point after Ray Train restarted the workers
    ray_first_step_after_restart_t: float | None = None


@dataclass
class DrillContext:
    """What a judge reads: the drill, the fault, what the driver saw, the run and the reference."""

    runner: JobRunner
    spec: DrillSpec
    fault: Fault
    info: Injection
    run: SupervisedRun
    reference: RunResult
    request: RunRequest
    metric: str
    checkpoint_dir: Path
    stall_limit: float
    #: what a metric line of the job looks like (``Job.metric_line_regexes``): such a line on
    #: stderr after the fault reports nothing
    metric_lines: tuple[str, ...] = ()


def _points(result: RunResult, metric: str, rank: int | None = None) -> list[MetricPoint]:
    return sorted(
        (p for p in result.points if p.name == metric and (rank is None or p.rank == rank)),
        key=lambda p: p.t,
    )


def _rate(points: list[MetricPoint], start: float | None = None, end: float | None = None) -> float | None:
    """Steps per second: the lines read in ``[start, end]`` over its length when given, else
    from the median time per step between lines (robust to lines read in a burst)."""
    if start is not None and end is not None:
        span = end - start
        inside = [p for p in points if start < p.t <= end]
        return len(inside) / span if span > 0 else None
    return step_rate((p.step, p.t) for p in points)


def _last_step_time(points: list[MetricPoint], steps: int) -> float | None:
    """When the job printed its last step (``steps``), or None if it never did."""
    return next((p.t for p in points if p.step >= steps), None)


def _round(value: float | None, digits: int = 3) -> float | None:
    return None if value is None else round(value, digits)


def attempt_evidence(result: RunResult, fault: Fault) -> AttemptEvidence:
    entry = AttemptEvidence(
        outcome=result.outcome,
        reason=result.reason,
        exits=[ExitOfRank(e.rank, e.returncode, e.signal, e.killed_by_trainguard) for e in result.exits],
        last_step=result.last_step,
        duration_s=round(result.duration_s, 2),
        run_dir=str(result.run_dir),
    )
    if not result.ok:
        entry.failed_rank = result.failed_rank
        entry.classified = fault.classify(result)
        entry.stderr_tail = result.stderr_tail[-1500:]
    stacks = result.evidence.get("stacks")
    if stacks:
        entry.stacks_dumped = sorted(int(r) for r, text in stacks.items() if not text.startswith("("))
        entry.stacks = {r: text[-2000:] for r, text in stacks.items()}
    entry.attributed(result.evidence.get("attribution"))
    return entry


def _detected_after(result: RunResult, info: Injection, fault: Fault, stall_limit: float) -> float | None:
    """Seconds from the injection to trainguard's (or the job's) reaction that ended attempt 0."""
    if fault.injected_at is None:
        return None
    if result.outcome == "hung" and result.detected_after_s is not None:
        last = max((p.t for p in result.points), default=0.0)
        return round(last + stall_limit + result.detected_after_s - fault.injected_at, 3)
    if info.first_exit is not None:
        return round(info.first_exit[2] - fault.injected_at, 3)
    return round(result.duration_s - fault.injected_at, 3)


def new_stderr(result: RunResult, info: Injection, rank: int) -> str:
    """What ``rank`` wrote to stderr after the fault was injected."""
    with contextlib.suppress(OSError), open(result.log_path(rank), "rb") as handle:
        handle.seek(info.stderr_offsets.get(rank, 0))
        return handle.read().decode("utf-8", errors="replace")
    return ""


def recovered_run_problems(c: DrillContext, spec: DrillSpec, diff: TrajectoryDiff,
                           evidence: RecoverEvidence) -> list[str]:
    """A recovered run must match the uninterrupted one: its trajectory and its final checkpoint."""
    problems = []
    problem = diff_problem(c.metric, diff, "recovered run")
    if problem:
        problems.append(problem)
    state = compare_checkpoint_dirs(c.checkpoint_dir, c.reference.checkpoints,
                                    rtol=spec.rtol, atol=spec.atol)
    evidence.checkpoint = state.as_evidence()
    if state.differing:
        problems.append(f"the final checkpoint differs from the uninterrupted run's in {state.summary()}")
    elif uncompared := state.uncompared_problem(f"the drill `{spec.name}` in checks.drills", spec.allow_uncompared):
        problems.append(uncompared)
    return problems


def diff_problem(metric: str, diff: TrajectoryDiff, what: str) -> str | None:
    if diff.ok:
        return None
    if diff.first_divergent_step is not None:
        a, b = diff.first_values or (math.nan, math.nan)
        return (
            f"{metric} of the {what} diverges from the uninterrupted run at step "
            f"{diff.first_divergent_step} ({a!r} vs {b!r}; max abs diff {diff.max_abs_diff:.3g})"
        )
    return f"the {what} {diff.missing_words()} of the uninterrupted run"


def common_evidence(c: DrillContext, kind: type[E]) -> E:
    """What every drill's report holds, as the expectation's record ``kind`` (its own fields
    left to its judge)."""
    first = c.run.attempts[0]
    watched = _points(first, c.metric, c.info.watch_rank)
    injected, cleared = c.fault.injected_at, c.fault.cleared_at
    before = [p for p in watched if injected is None or p.t <= injected]
    during_end = cleared if cleared is not None else first.duration_s
    # the rate during the fault counts only the time the job still had steps to do: a job that
    # finished its steps inside the window (and then waited, say, to flush) did not slow down
    last_step_t = _last_step_time(watched, c.spec.steps)
    steps_done_in_window = (injected is not None and last_step_t is not None
                            and injected < last_step_t <= during_end)
    if steps_done_in_window and last_step_t is not None:
        during_end = last_step_t
    rates = StepRate(
        unit=f"steps/s of rank {c.info.watch_rank}",
        before=_round(_rate(before[1:] if len(before) > 2 else before)),  # step 1 pays start-up
        during=_round(_rate(watched, injected, during_end)) if injected is not None else None,
    )
    if steps_done_in_window:
        rates.during_until_last_step, rates.last_step_at_s = True, _round(last_step_t)
    if cleared is not None:
        rates.after_clear = _round(_rate([p for p in watched if p.t > cleared]))
    if c.run.restarts:
        rates.after_restart = _round(_rate(_points(c.run.final, c.metric, c.info.watch_rank)))
    evidence = kind(
        injected_at_s=_round(injected), injected_after_step=c.info.injected_step,
        watched_rank=c.info.watch_rank,
        watched_rank_step_at_injection=max((p.step for p in before), default=None),
        detected_after_s=_detected_after(first, c.info, c.fault, c.stall_limit),
        attempt_ended_after_s=_round(first.duration_s - injected) if injected is not None else None,
        restarts=c.run.restarts, attempts=[attempt_evidence(a, c.fault) for a in c.run.attempts],
        step_rate=rates, fault_evidence=c.fault.evidence().to_dict(), reference_run_dir=str(c.reference.run_dir),
    )
    if c.info.first_exit is not None:
        rank, code, _ = c.info.first_exit
        evidence.first_exit = {"rank": rank, "returncode": code}
    if c.info.errors:
        evidence.fault_errors = list(c.info.errors)
    return evidence


def not_injected(c: DrillContext) -> Judgement | None:
    """An error verdict when the fault never struck the running job (so nothing was tested)."""
    first = c.run.attempts[0]
    if c.fault.injected_at is None:
        how = "finished" if first.ok else f"ended ({first.reason or first.outcome})"
        return Judgement("error", f"the fault was never injected: the first attempt {how} before rank "
                f"{c.info.watch_rank} printed step {c.spec.after_step} of `{c.metric}`",
                common_evidence(c, DrillEvidence))
    evidence = common_evidence(c, DrillEvidence)
    if c.info.inject_failed is not None:
        if first.ok or c.info.target_exited_before:
            # its target was gone because the run was over: the fault came too late, it did not fail
            gone = "the run had finished" if first.ok else f"rank {c.spec.rank} had already exited"
            return Judgement("error", f"the fault came too late to test anything: {gone} while it looked for "
                    f"its target after step {c.info.injected_step} ({c.info.inject_failed}); give the drill "
                    "more steps after after_step", evidence)
        return Judgement("error", f"the fault could not be injected after step {c.info.injected_step}: "
                f"{c.info.inject_failed}", evidence)
    reached = evidence.watched_rank_step_at_injection
    if c.info.target_exited_before or (reached is not None and reached >= c.spec.steps):
        where = (f"rank {c.spec.rank} had already exited" if c.info.target_exited_before
                 else f"rank {c.info.watch_rank} had already printed its last step ({reached})")
        return Judgement("error", f"the fault came too late to test anything: {where} when trainguard read "
                f"step {c.info.injected_step} and injected it (the job's output is read with a "
                "lag that grows on a loaded machine); give the drill more steps after after_step",
                evidence)
    if no_effect := c.fault.no_effect(first, c.spec.steps, c.metric):
        return Judgement("error", f"the fault had no effect: {no_effect}", evidence)
    return None


def judge_injected(kind: type[E]) -> Callable[[Callable[[DrillContext, E], Judgement]], Judge]:
    """The opening every judge shares, as a decorator of ``judge(c, evidence)``: the error of
    :func:`not_injected` when the fault never struck, else ``judge`` with the common evidence
    as ``kind``, the expectation's record to fill."""

    def wrap(judge: Callable[[DrillContext, E], Judgement]) -> Judge:
        @functools.wraps(judge)
        def run(c: DrillContext) -> Judgement:
            return not_injected(c) or judge(c, common_evidence(c, kind))

        return run

    return wrap


def trajectory_diff(c: DrillContext, points: Iterable[MetricPoint], steps: Iterable[int]) -> TrajectoryDiff:
    actual, expected = aligned_trajectories(list(points), c.reference.points, c.metric)
    return compare_trajectories(actual, expected, metric=c.metric, steps=steps,
                                rtol=c.spec.rtol, atol=c.spec.atol)


def _lost_steps(c: DrillContext) -> tuple[int, list[Resume], bool]:
    """Steps of progress lost over all restarts; per restart; whether one restarted from 0."""
    total, per, from_scratch = 0, [], False
    start = first_step(c.reference.points, c.metric)  # 1, or 0 for a job counting from 0
    for failed, nxt in zip(c.run.attempts, c.run.attempts[1:]):
        done = max((p.step for p in failed.points if p.name == c.metric), default=start - 1)
        steps = [p.step for p in nxt.points if p.name == c.metric]
        if not steps:
            continue
        resumed_from = min(steps) - 1
        lost = max(0, done - resumed_from)
        total += lost
        again = min(steps) <= start and done >= start
        from_scratch |= again
        per.append(Resume(last_step_before=done, resumed_from_step=max(resumed_from, 0), lost=lost,
                          began_again=True if again else UNSET))
    return total, per, from_scratch


def recover_causes(resumed_from: Sequence[int | None], diff: TrajectoryDiff,
                   accounting: SampleAccounting | None = None) -> list[str]:
    """The recover causes in the order the evidence gives: when every restart resumed from a
    checkpoint (``resumed_from``: the step each restart resumed after, 0 for one that began
    again) and the run then diverged, the state missing from that checkpoint comes first (and
    "no checkpoint" is ruled out); the resume check names which state. Samples the attempts
    trained twice or never (``accounting``) put the data position before it."""
    causes = list(DRILL_CAUSES["recover"])
    resumed = bool(resumed_from) and all(resumed_from)
    if resumed and diff.first_divergent_step is not None:
        state = next(c for c in causes if c.startswith("state missing"))
        causes = [state + " -- `trainguard check --only resume` reads the checkpoint and names "
                  "what is missing"] + [c for c in causes if c is not state and not c.startswith("no checkpoint")]
    if accounting is not None and accounting.known and not accounting.ok:
        causes.insert(0, f"the data position not saved or not restored: {accounting.summary()}")
    return causes


@judge_injected(RecoverEvidence)
def judge_recover(c: DrillContext, evidence: RecoverEvidence) -> Judgement:
    spec, run = c.spec, c.run
    lost, per_restart, from_scratch = _lost_steps(c)
    evidence.lost_steps, evidence.resumes = lost, per_restart
    compared, unprinted = judged_steps(run.attempts, c.metric, spec.steps)
    diff = trajectory_diff(c, run.points, compared)
    evidence.trajectory = diff.as_evidence()
    if unprinted:
        evidence.trajectory.unprinted_resumed_steps = unprinted
    problems: list[str] = []
    if not run.ok:
        final = run.final
        # the fault struck attempt 0 only: a restart that failed failed by itself (nanoGPT's
        # resume before its first checkpoint: FileNotFoundError), so it is told in its own words
        ended = c.fault.classify(final) if not run.restarts else (final.reason or final.outcome)
        last = next((line.strip() for line in reversed(final.stderr_tail.splitlines()) if line.strip()), "")
        problems.append(
            f"did not recover: after {run.restarts} restart(s) (max_restarts {spec.restart_limit}) "
            f"the last attempt ended: {ended}" + (f" ({last[:200]})" if run.restarts and last else "")
        )
    if from_scratch:
        problems.append(
            f"the restarted job began again at step {first_step(c.reference.points, c.metric)}: "
            "no usable checkpoint, all progress lost "
            "(does the job checkpoint during the run, and do resume_args load the latest one?)"
        )
    if spec.max_lost_steps is not None and lost > spec.max_lost_steps:
        problems.append(f"{lost} steps of progress lost (max_lost_steps {spec.max_lost_steps})")
    if run.ok:
        problems += recovered_run_problems(c, spec, diff, evidence)
    accounting = attempts_accounting(c.reference, run.attempts, c.metric, spec.steps)
    if accounting is not None and accounting.known:
        evidence.sample_accounting = accounting.as_evidence()
        if not accounting.ok:
            problems.append(accounting.summary())
    first = run.attempts[0]
    detected = evidence.detected_after_s
    what = (f"{spec.fault} on rank {spec.rank} after step {c.info.injected_step}: "
            f"attempt 0 {first.outcome} ({c.fault.classify(first) if not first.ok else 'no failure'}"
            f"{f', detected after {detected:.2f} s' if detected is not None else ''})")
    if problems:
        # the reference with step records (the profile's timed run, shared, has none)
        found, observed = observed_restart(c.runner.scheduling.recorded(c.reference), run.attempts, c.metric,
                                           diff.first_divergent_step, spec.steps)
        evidence.first_divergence = found if found is not None else UNSET
        evidence.likely_causes = observed + recover_causes([r.resumed_from_step for r in per_restart], diff, accounting)
        return Judgement("failed", f"{what}; " + "; ".join(problems), evidence)
    recovery = None
    if c.info.injected_mono is not None and c.info.first_step_after_restart_mono is not None:
        recovery = c.info.first_step_after_restart_mono - c.info.injected_mono
        evidence.fault_to_first_step_after_restart_s = round(recovery, 3)
    restarts = (f"recovered with {run.restarts} restart(s), {lost} step(s) lost"
                + (f", first step {recovery:.1f} s after the fault" if recovery is not None else ""))
    if not run.restarts:
        restarts = "the job completed without needing a restart"
    same = final_state_words(evidence)
    return Judgement("passed", f"{what}; {restarts}; all {diff.compared_steps} steps match the "
            f"uninterrupted run{same}", evidence)


def exit_problems(c: DrillContext, evidence: ExitEvidence) -> list[str]:
    """What is wrong with how the first attempt ended, for a job that must exit non-zero by
    itself within ``deadline`` of the fault with an error on stderr (or dead of a signal): one
    sentence per problem. Fills ``exit_after_s``, ``failed_rank_stderr_after_fault``,
    ``error_reported`` and ``error_line`` (the last line of its stderr after the fault that
    says something, :func:`trainguard.launch.reported.reported_line`) in ``evidence``."""
    spec, info = c.spec, c.info
    first = c.run.attempts[0]
    problems: list[str] = []
    exit_after = None
    if info.first_exit is not None and c.fault.injected_at is not None:
        exit_after = info.first_exit[2] - c.fault.injected_at
        evidence.exit_after_s = round(exit_after, 3)
    if first.ok:
        problems.append("the job completed (exit 0) despite the fault; expected it to fail"
                        + c.runner.backend.restart_note(c.runner.job_file.job.max_restarts))
    elif info.stopped_at_deadline:
        problems.append(f"the job hung: no rank exited within {spec.deadline_s:g} s of the fault "
                        "(trainguard stopped it at the deadline)")
    elif first.outcome == "hung":
        problems.append(f"the job hung: trainguard's stall detection ended it ({first.reason}); "
                        f"no rank exited by itself{attribution_words(first.evidence.get('attribution'), ' ({})')}")
    elif first.outcome != "failed":
        problems.append(f"the attempt ended as {first.outcome}: {first.reason}")
    elif exit_after is not None and exit_after > spec.deadline_s:
        problems.append(f"the job exited {exit_after:.1f} s after the fault, later than the "
                        f"deadline of {spec.deadline_s:g} s")
    if first.outcome == "failed" and first.failed_rank is not None:
        rank = first.failed_rank
        exit_info = next((e for e in first.exits if e.rank == rank), None)
        text = new_stderr(first, info, rank)
        evidence.failed_rank_stderr_after_fault = text[-1500:]
        said = reported_line(text, c.metric_lines)
        if exit_info is not None and exit_info.signal:
            evidence.error_reported = f"rank {rank} died of {exit_info.signal} (no chance to write)"
        elif said is not None:
            evidence.error_reported = "yes"
            evidence.error_line = said[:300]
        else:
            problems.append(f"rank {rank} exited with code {exit_info.returncode if exit_info else '?'} "
                            "but wrote no error to stderr after the fault (nothing but "
                            + ("metric lines, progress bars, warnings or trainguard's own lines)"
                               if text.strip() else "an empty stderr)"))
    return problems


@dataclass
class FailCleanStart:
    """What a fail_clean judgement reads before its verification run, while the fault is still
    set up (its classification and causes may read state the teardown removes)."""

    evidence: FailCleanEvidence
    problems: list[str]
    done: int  # the last step the faulted run printed
    what: str  # the fault and how the run ended, for the summary
    own_causes: list[str]  # the fault's own causes (Fault.likely_causes)
    #: whether the latest checkpoint must be resumed from: no, when the run trained to its last
    #: step despite the fault (a resume from its final checkpoint prints nothing, and that is
    #: no torn checkpoint)
    verify: bool


def fail_clean_start(c: DrillContext) -> FailCleanStart | Judgement:
    """The part of a fail_clean judgement before the verification run (a Judgement: nothing was
    injected)."""
    skipped = not_injected(c)
    if skipped:
        return skipped
    evidence = common_evidence(c, FailCleanEvidence)
    spec, info = c.spec, c.info
    first = c.run.attempts[0]
    problems = exit_problems(c, evidence)
    exit_after = known(evidence.exit_after_s)
    done = max((p.step for p in first.points if p.name == c.metric), default=0)
    how = c.fault.classify(first) if not first.ok else "completed"
    what = (f"{spec.fault} on rank {spec.rank} after step {info.injected_step}: {how}"
            + (f" {exit_after:.2f} s after the fault" if exit_after is not None and not first.ok else ""))
    return FailCleanStart(evidence, problems, done, what, _fault_causes(c, first),
                          verify=not (first.ok and done >= spec.steps))


def verify_resume(c: DrillContext) -> RunResult:
    """The verification run: the job resumed from ``c.checkpoint_dir``'s latest checkpoint,
    with the fault removed."""
    return c.runner.run(c.request, label=f"drill-{c.spec.name}-verify", resume=True,
                        checkpoint_dir=c.checkpoint_dir)


def judge_fail_clean(c: DrillContext) -> Judgement:
    start = fail_clean_start(c)
    if isinstance(start, Judgement):
        return start
    return fail_clean_verdict(c, start, verify_resume(c) if start.verify else None)


def fail_clean_verdict(c: DrillContext, start: FailCleanStart, verify: RunResult | None) -> Judgement:
    """The fail_clean verdict once the verification run (``verify``; None: none was needed)
    is known."""
    spec, evidence, problems = c.spec, start.evidence, start.problems
    first = c.run.attempts[0]
    if verify is not None:
        evidence.verification = attempt_evidence(verify, c.fault)
    if verify is None:
        pass
    elif not verify.ok:
        problems.append(f"the resume run from the latest checkpoint (fault removed) failed: "
                        f"{verify.reason} -- the checkpoint is not usable")
        evidence.checkpoint = CheckpointIntact(intact=False, why=verify.reason)
    else:
        _verified(c, start, verify)
    if problems:
        own = start.own_causes
        causes = [*own, *[x for x in _fail_clean_causes(first, evidence) if x not in own]]
        evidence.likely_causes = causes
        torn = isinstance(evidence.checkpoint, CheckpointIntact) and not evidence.checkpoint.intact
        return Judgement("failed", f"{start.what}; " + "; ".join(problems) + (
            f". Most likely {causes[0]}" if torn else ""), evidence)
    return Judgement("passed", f"{start.what} (deadline {spec.deadline_s:g} s), error reported{_said(evidence)}; "
            f"resumed from checkpoint step {evidence.resumed_from_step} with the fault removed and matched the "
            "uninterrupted run", evidence)


def _verified(c: DrillContext, start: FailCleanStart, verify: RunResult) -> None:
    """Judge a verification run that completed: where it resumed, the steps lost, its
    trajectory against the reference and its sample accounting (into ``start``)."""
    spec, evidence, problems, done = c.spec, start.evidence, start.problems, start.done
    steps = [p.step for p in verify.points if p.name == c.metric]
    first_reference_step = first_step(c.reference.points, c.metric)
    resumed_from = min(steps) - 1 if steps else None
    lost = max(0, done - resumed_from) if resumed_from is not None else None
    evidence.resumed_from_step = None if resumed_from is None else max(resumed_from, 0)
    evidence.lost_steps = lost
    diff = trajectory_diff(c, verify.points, range((resumed_from or 0) + 1, spec.steps + 1))
    evidence.trajectory = diff.as_evidence()
    intact = True
    if resumed_from is None:
        problems.append(f"the resume run printed no `{c.metric}` line")
        intact = False
    elif resumed_from < first_reference_step:
        problems.append(f"the resume run started again from step {first_reference_step}: no usable "
                        f"checkpoint from before the fault (the job had reached step {done})")
        intact = False
    problem = diff_problem(c.metric, diff, "run resumed from the checkpoint")
    if problem:
        problems.append(problem)
        intact = False
    if spec.max_lost_steps is not None and lost is not None and lost > spec.max_lost_steps:
        problems.append(f"{lost} steps of progress lost (max_lost_steps {spec.max_lost_steps})")
    evidence.checkpoint = CheckpointIntact(intact=intact, resumed_from_step=resumed_from)
    accounting = attempts_accounting(c.reference, [c.run.attempts[0], verify], c.metric, spec.steps)
    if accounting is not None and accounting.known:
        evidence.sample_accounting = accounting.as_evidence()
        if not accounting.ok:
            problems.append(accounting.summary())


def final_state_words(evidence: RecoverEvidence) -> str:
    """What a passing summary says of the final checkpoints: ``, final checkpoints equal`` when
    the recovered run's was compared whole with the uninterrupted run's, `` (state not compared:
    why; allowed by allow_uncompared)`` when the drill let a skipped comparison go, else nothing
    (neither run left one)."""
    state = known(evidence.checkpoint)
    if state is not None and state.uncompared:
        return f" (state not compared: {state.uncompared}; allowed by the drill's allow_uncompared)"
    return ", final checkpoints equal" if state is not None and state.compared else ""


def _said(evidence: ExitEvidence) -> str:
    """`` ('the line')``: the line the failed rank reported, for a summary (nothing when it
    died of a signal)."""
    said = known(evidence.error_line)
    return f" (\"{said[:200]}\")" if said else ""


def _fail_clean_causes(first: RunResult, evidence: FailCleanEvidence) -> list[str]:
    """The fail_clean causes, the one the evidence shows first (with that evidence)."""
    hang, swallowed, torn = DRILL_CAUSES["fail_clean"]
    checkpoint = evidence.checkpoint
    if isinstance(checkpoint, CheckpointIntact) and not checkpoint.intact:
        why = checkpoint.why or (
            "the resume from it started again from step 1" if checkpoint.resumed_from_step == 0
            else "the run resumed from it does not match the uninterrupted run")
        written = [p for p in evidence.fault_evidence.get("enospc_paths", []) if isinstance(p, str)]
        where = f"; the fault hit a write to {', '.join(written[:2])}" if written else ""
        return [f"{torn} ({why}{where})", swallowed, hang]
    if first.ok:
        return [swallowed, torn, hang]
    return [hang, swallowed, torn]


@judge_injected(ContinueEvidence)
def judge_continue(c: DrillContext, evidence: ContinueEvidence) -> Judgement:
    spec, run = c.spec, c.run
    problems: list[str] = []
    final = run.final
    if not final.ok:
        problems.append(f"the job did not run through the fault: {c.fault.classify(final)}")
    diff = trajectory_diff(c, run.points, range(1, spec.steps + 1))
    evidence.trajectory = diff.as_evidence()
    if final.ok:
        problem = diff_problem(c.metric, diff, "run under the fault")
        if problem:
            problems.append(problem)
    rates = evidence.step_rate
    last_step_at = known(rates.last_step_at_s)
    if rates.during_until_last_step is True and last_step_at is not None and final.ok and not c.run.restarts:
        lingered = final.duration_s - last_step_at
        evidence.exit_after_last_step_s = _round(lingered)
        if lingered > spec.deadline_s:
            problems.append(f"the job did all {spec.steps} steps during the fault but exited only "
                            f"{lingered:.1f} s after its last step (deadline {spec.deadline_s:g} s): "
                            "its shutdown blocks on the fault")
    before, during = rates.before, rates.during
    ratio = during / before if before and during is not None else None
    # a fault that slows the job on purpose (slow_rank) sets its own floor when the drill gives none
    floor = spec.min_rate if spec.min_rate is not None else getattr(c.fault, "min_rate_default", spec.rate_floor)
    rates.min_rate = floor
    rates.during_over_before = _round(ratio)
    if ratio is None:
        evidence.rate_note = "too few steps before the fault to measure the rate"
    elif ratio < floor:
        problems.append(f"the step rate during the fault fell to {ratio:.0%} of the rate before "
                        f"({during:.2f} vs {before:.2f} steps/s; min_rate {floor:g})")
    try:
        problems += c.fault.verify_continue(final)
    except Exception as exc:
        problems.append(f"the fault's own check raised {type(exc).__name__}: {exc}")
    evidence.fault_evidence = c.fault.evidence().to_dict()  # with what its own check found
    what = f"{spec.fault} on rank {spec.rank} after step {c.info.injected_step} for {spec.duration:g} s"
    if problems:
        evidence.likely_causes = _with_faults_causes(c, final, list(DRILL_CAUSES["continue"]))
        return Judgement("failed", f"{what}: " + "; ".join(problems), evidence)
    shown = f"{ratio:.0%} of the rate before" if ratio is not None else "rate not measured"
    return Judgement("passed", f"{what}: the job ran through it ({shown}) and matches the uninterrupted "
            f"run on all {diff.compared_steps} steps", evidence)


def _with_faults_causes(c: DrillContext, result: RunResult, causes: list[str]) -> list[str]:
    """The fault's own causes for what happened (:meth:`Fault.likely_causes`) first, then the
    expectation's."""
    own = _fault_causes(c, result)
    return [*own, *[x for x in causes if x not in own]]


def _fault_causes(c: DrillContext, result: RunResult) -> list[str]:
    """The fault's own causes for what happened in ``result`` (:meth:`Fault.likely_causes`)."""
    try:
        return list(c.fault.likely_causes(result))
    except Exception:  # a fault's own reading must not cost the verdict
        return []
