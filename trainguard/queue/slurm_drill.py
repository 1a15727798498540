"""Fault drills whose target is a job on a Slurm cluster (docs/queue.md, "Drills on a Slurm job").

The drill attaches to a submitted job (its id and its log, which trainguard's sbatch script
appends to across requeues and marks at the start of each attempt), waits until the job has
printed step ``after_step``, injects the fault through Slurm itself, follows the job to its final
state and judges it as a ``recover`` drill is judged (:mod:`trainguard.drills.judges`): the job
came back (``SLURM_RESTART_COUNT``), resumed from its checkpoint (lost steps counted, a restart
from step 1 fails), completed, and its trajectory matches an uninterrupted run; the time from
the fault to the first new step is measured.

Faults (:data:`SLURM_FAULTS`):

* ``requeue``: ``scontrol requeue JOB`` of the running job -- what a preemption with
  ``PreemptMode=REQUEUE`` does (Slurm ends the job and queues it again);
* ``node_down``: ``scontrol update NodeName=N State=DOWN Reason=...`` of the job's first node,
  then ``State=RESUME`` once Slurm has taken the job off it -- a node failure (the job is
  requeued because it was submitted with ``--requeue``; on a one-node cluster it comes back on
  the same node after the RESUME).

Needs an operator's rights for ``scontrol requeue``/``update`` (root or SlurmUser on a test
cluster; a site's admin on a shared one).
"""

from __future__ import annotations

import dataclasses
import itertools
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from trainguard._internal.readers import LineTail, OverLimit, Unreadable, active_limits, shown_name
from trainguard.checks.equivalence import compare_trajectories
from trainguard.config.values import check_regex
from trainguard.drills.evidence import (
    SlurmAttemptSpan,
    SlurmDrillEvidence,
    SlurmInjection,
    SlurmStepNotReached,
)
from trainguard.drills.judges import DRILL_CAUSES, diff_problem
from trainguard.evidence import Evidence
from trainguard.launch import MetricPoint
from trainguard.launch.metrics import MetricParser, trajectory
from trainguard.queue.base import Submission, SubmissionError
from trainguard.queue.slurm import SlurmBackend, key_values
from trainguard.report import CheckResult, CheckStatus

__all__ = ["SLURM_FAULTS", "JobLog", "SlurmAttempt", "SlurmDrill", "check_metric_regex", "read_attempts", "run_slurm_drill"]

#: the faults a drill can inject into a Slurm job
SLURM_FAULTS = ("requeue", "node_down")

#: the line trainguard's sbatch script prints at the start of every attempt
_ATTEMPT = re.compile(r"^trainguard: attempt (?P<restart>\d+) of job \S+ starts on (?P<host>\S+) at "
                      r"(?P<at>[\d.]+)")


@dataclass
class SlurmDrill:
    """One drill against a Slurm job.

    Args:
        name: the drill's name (the result is ``drill:<name>``).
        fault: ``requeue`` or ``node_down``.
        after_step: the fault is injected once the job printed this step.
        steps: the job's last step (the trajectory is compared on 1..steps).
        metric_regex: the job's metric line (groups ``step`` and ``value``), e.g. the job file's
            ``job.metrics.loss``.
        metric: the metric's name (for messages).
        max_lost_steps: most steps of progress the restart may lose (None: not judged).
        timeout_s: the most seconds the drill waits for the step, then for the final state.
        rtol, atol: trajectory tolerance against the uninterrupted run.
        poll_s: how often the log and the job's state are read.
    """

    name: str
    fault: Literal["requeue", "node_down"]
    after_step: int
    steps: int
    metric_regex: str
    metric: str = "loss"
    max_lost_steps: int | None = None
    timeout_s: float = 300.0
    rtol: float = 0.0
    atol: float = 0.0
    poll_s: float = 0.2

    def __post_init__(self) -> None:
        if self.fault not in SLURM_FAULTS:
            raise SubmissionError(f"unknown Slurm drill fault {self.fault!r}; expected one of "
                                  f"{', '.join(SLURM_FAULTS)}")
        if not 1 <= self.after_step < self.steps:
            raise SubmissionError(f"after_step must be in 1..{self.steps - 1} (steps {self.steps}), "
                                  f"got {self.after_step}")
        check_metric_regex(self.metric_regex)


@dataclass
class SlurmAttempt:
    """One run of the job's batch script: its ``SLURM_RESTART_COUNT``, node and metric points
    (``t``: when the drill first read the line, seconds on its monotonic clock)."""

    restart: int
    host: str
    points: list[MetricPoint] = field(default_factory=list)
    #: when the script started it, by the node's clock (``date +%s.%N``, seconds since the epoch)
    started_at: float | None = None


class JobLog:
    """Reads the job's log as it grows, one line at a time through the reader layer (a regular
    file only, never more than a line in memory), and splits it into attempts."""

    def __init__(self, path: Path, metric: str, regex: str) -> None:
        self.path, self.metric, self.regex = path, metric, regex
        self.lines = LineTail(path)
        self.attempts: list[SlurmAttempt] = []
        self.parser = MetricParser({metric: regex})

    def read(self, until: float | None = None) -> bool:
        """Read what the log gained, stopping at ``until`` (a ``time.monotonic()``); whether it
        read to the end. :class:`Unreadable` when the log is not a regular file or is over the
        read limit."""
        now = time.monotonic()
        for raw in self.lines.lines(until):
            line = raw.decode("utf-8", "replace")
            marker = _ATTEMPT.match(line)
            if marker:
                self.attempts.append(SlurmAttempt(int(marker["restart"]), marker["host"],
                                                  started_at=float(marker["at"])))
                self.parser = MetricParser({self.metric: self.regex})
            elif self.attempts:
                self.attempts[-1].points += self.parser.parse(line, rank=0, t=now)
        return self.lines.caught_up

    def last_step(self) -> int:
        points = self.attempts[-1].points if self.attempts else []
        return max((p.step for p in points), default=0)


def read_attempts(log: str | Path, metric_regex: str, metric: str = "loss") -> list[SlurmAttempt]:
    """The attempts in a job's log as it is now (points' ``t``: when it was read), read within
    the read limits (``read_timeout``: :class:`~trainguard._internal.readers.OverLimit`)."""
    tail = JobLog(Path(log), metric, check_metric_regex(metric_regex))
    seconds = active_limits().seconds
    if not tail.read(time.monotonic() + seconds):
        raise OverLimit(f"reading {shown_name(Path(log).name)} took more than {seconds:g} s, over "
                        "the limit (setting read_timeout)")
    return tail.attempts


def check_metric_regex(regex: str) -> str:
    """``regex`` when it compiles and has the groups ``step`` and ``value`` (a Slurm log's metric
    line); :class:`SubmissionError` saying what is wrong and how to write it otherwise."""
    try:
        return check_regex(regex, count_hint=False)
    except ValueError as exc:
        raise SubmissionError(f"metric_regex: {exc}") from None


def run_slurm_drill(
    backend: SlurmBackend,
    job_id: str,
    log: str | Path,
    drill: SlurmDrill,
    reference: Mapping[int, float],
) -> CheckResult:
    """Run ``drill`` against the submitted job ``job_id`` whose log is ``log`` and judge it
    against ``reference`` (the uninterrupted run's ``{step: value}``)."""
    started = time.monotonic()
    tail = JobLog(Path(log), drill.metric, drill.metric_regex)
    evidence = SlurmDrillEvidence(drill.fault, drill.after_step, drill.steps, job_id, str(log))

    def result(status: CheckStatus, summary: str, found: Evidence | None = None) -> CheckResult:
        # what was gathered so far, as it is now
        return CheckResult(f"drill:{drill.name}", status, summary, found or dataclasses.replace(evidence),
                           time.monotonic() - started)

    deadline = started + drill.timeout_s
    try:
        return _drive(_DrillOfJob(backend, job_id, drill, tail, reference, deadline, evidence, result))
    except Unreadable as exc:  # a FIFO, a device, over the read limit: never waited on
        return result("error", f"the job's log {shown_name(str(log))} was not read: {exc}; point "
                      "the record's links.log at the job's output file (a regular file)")


@dataclass(frozen=True)
class _DrillOfJob:
    """One drill of one submitted job: the backend and job, the drill, its log, reference, deadline, evidence and verdict."""

    backend: SlurmBackend
    job_id: str
    drill: SlurmDrill
    tail: JobLog
    reference: Mapping[int, float]
    deadline: float  # a time.monotonic(): every read of the log stops there
    evidence: SlurmDrillEvidence  # gathered as the drill goes
    result: Callable[..., CheckResult]


def _drive(run: _DrillOfJob) -> CheckResult:
    """Wait for the step, inject, follow the job to its end and judge it; every read of the log
    stops at ``run.deadline``."""
    backend, job_id, drill, tail = run.backend, run.job_id, run.drill, run.tail
    reference, deadline, evidence, result = run.reference, run.deadline, run.evidence, run.result
    state = backend.status(job_id)
    tail.read(deadline)
    while tail.last_step() < drill.after_step:
        if state.terminal or time.monotonic() > deadline:
            late = SlurmStepNotReached(evidence.fault, evidence.after_step, evidence.steps, evidence.job_id,
                                       evidence.log, dict(state.evidence))
            return result("error", f"the job reached step {tail.last_step()} of {drill.after_step} "
                          f"before it {'ended' if state.terminal else 'timed out'} ({state.message}): "
                          "the fault came too late; give it more steps or an earlier after_step", late)
        time.sleep(drill.poll_s)
        tail.read(deadline)
        state = backend.status(job_id)
    injected_step = tail.last_step()
    injected = time.monotonic()
    try:
        evidence.fault_evidence = _inject(backend, job_id, drill, state)
    except SubmissionError as exc:
        return result("error", f"could not inject {drill.fault}: {exc}")
    evidence.injected_step = injected_step
    final = _follow(backend, job_id, tail, deadline)
    seconds = active_limits().seconds
    if not tail.read(time.monotonic() + seconds):  # the end of the log, which the verdict needs
        return result("error", f"reading the job's log took more than {seconds:g} s after it ended, "
                      "over the limit (setting read_timeout)")
    return _judge(drill, tail.attempts, final, reference, injected, evidence, result)


def _inject(backend: SlurmBackend, job_id: str, drill: SlurmDrill, state: Submission) -> SlurmInjection:
    if drill.fault == "requeue":
        backend.requeue(job_id)
        return SlurmInjection(f"scontrol requeue {job_id}")
    node = _first_node(backend, str(state.evidence.get("nodes", "")))
    reason = f"trainguard drill {drill.name}"
    backend.scontrol("update", f"NodeName={node}", "State=DOWN", f"Reason={reason}")
    down_at = time.monotonic()
    try:  # until Slurm has taken the job off the node (it requeues it: --requeue)
        while backend.status(job_id).status == "running" and time.monotonic() - down_at < 60:
            time.sleep(drill.poll_s)
    finally:
        # a site with ReturnToService=2 has already put it back when its slurmd re-registered;
        # RESUME is refused for a node that is not down
        node_state = key_values(backend.scontrol("show", "node", "--oneliner", node)).get("State", "")
        if "DOWN" in node_state or "DRAIN" in node_state:
            backend.scontrol("update", f"NodeName={node}", "State=RESUME")
    return SlurmInjection(f"scontrol update NodeName={node} State=DOWN Reason='{reason}'; then State=RESUME",
                          node=node, node_state_before_resume=node_state, down_s=round(time.monotonic() - down_at, 2))


def _first_node(backend: SlurmBackend, nodelist: str) -> str:
    if not nodelist:
        raise SubmissionError("the job's node list is empty: is it running?")
    return backend.scontrol("show", "hostnames", nodelist).split()[0]


def _follow(backend: SlurmBackend, job_id: str, tail: JobLog, deadline: float) -> Submission:
    state = backend.status(job_id)
    while not state.terminal and time.monotonic() < deadline:
        time.sleep(0.2)
        tail.read(deadline)  # live, so the first step after the restart is timed
        state = backend.status(job_id)
    return state


def _judge(drill: SlurmDrill, attempts: list[SlurmAttempt], final: Submission,
           reference: Mapping[int, float], injected: float, evidence: SlurmDrillEvidence,
           result: Callable[..., CheckResult]) -> CheckResult:
    restarts = final.evidence.get("restarts")
    evidence.state, evidence.restarts = final.evidence.get("state"), restarts
    evidence.attempts = [SlurmAttemptSpan(a.restart, a.host, min((p.step for p in a.points), default=None),
                                          max((p.step for p in a.points), default=None)) for a in attempts]
    lost, from_scratch = 0, False
    unlogged: list[int] = []
    for failed, nxt in itertools.pairwise(attempts):
        done = max((p.step for p in failed.points), default=0)
        steps = [p.step for p in nxt.points]
        if steps:
            resumed_from = min(steps) - 1
            lost += max(0, done - resumed_from)
            from_scratch |= resumed_from == 0 and done > 0
            # trained and checkpointed (the next attempt resumed after them) but their lines
            # never reached the log: srun was killed before it forwarded the step's last output
            unlogged += range(done + 1, resumed_from + 1)
    evidence.lost_steps = lost
    evidence.steps_trained_but_not_in_the_log = unlogged
    points = [p for a in attempts for p in a.points]
    diff = compare_trajectories(trajectory(points, drill.metric), reference, metric=drill.metric,
                                steps=[s for s in range(1, drill.steps + 1) if s not in unlogged],
                                rtol=drill.rtol, atol=drill.atol)
    evidence.trajectory = diff.as_evidence()
    problems = []
    if final.status != "succeeded":
        problems.append(f"did not complete: the job ended {final.message}"
                        if final.terminal else f"did not end within {drill.timeout_s:g} s ({final.message})")
    if len(attempts) < 2 or not restarts:
        problems.append("Slurm did not requeue the job (one attempt in its log; "
                        f"SLURM_RESTART_COUNT {restarts}): was it submitted with --requeue?")
    if from_scratch:
        problems.append("the requeued job began again at step 1: no usable checkpoint, all "
                        "progress lost (do resume_args load the latest checkpoint?)")
    if drill.max_lost_steps is not None and lost > drill.max_lost_steps:
        problems.append(f"{lost} steps of progress lost (max_lost_steps {drill.max_lost_steps})")
    problem = diff_problem(drill.metric, diff, "requeued job")
    if problem and final.status == "succeeded":
        problems.append(problem)
    what = f"{drill.fault} of Slurm job {evidence.job_id} after step {evidence.injected_step}"
    if problems:
        evidence.likely_causes = list(DRILL_CAUSES["recover"])
        return result("failed", f"{what}; " + "; ".join(problems))
    new = [p.t for a in attempts[1:] for p in a.points]
    recovery = min(new) - injected if new else None
    evidence.fault_to_first_step_after_restart_s = round(recovery, 2) if recovery is not None else None
    return result("passed", f"{what}; requeued {restarts} time(s), {lost} step(s) lost"
                  + (f", first step {recovery:.1f} s after the fault" if recovery is not None else "")
                  + f"; all {diff.compared_steps} steps match the uninterrupted run")
