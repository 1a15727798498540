"""``crash_loop`` on a Slurm job: Slurm's requeue as the restart policy under test (docs/drills.md,
"crash_loop on Slurm requeue").

The drill attaches to a submitted job (its id and its log, which trainguard's sbatch script marks
at the start of every attempt with ``SLURM_RESTART_COUNT`` and the node's clock) and strikes every
attempt: once the attempt printed step ``after_step`` (or the first step past it), the tasks of
the job's running step get SIGKILL (``scancel --signal=KILL JOB.STEP``; the batch shell is spared,
so the job script sees its step fail, as when the OOM killer or a bad GPU takes a rank). Whatever
requeues the job -- the script's ``failure_requeues``, ``RequeueExit`` in slurm.conf, a site's
epilog -- is the policy under test. Per attempt the drill measures the step it was struck at, its
first and last step, its progress, the wait before it (from the kill to the script's start marker
of the next attempt: Slurm's requeue delay plus scheduling), the checkpoint it could resume from
and its rank-seconds; it judges them as every crash_loop drill is judged
(:func:`trainguard.drills.crash_loop.judge_loop`): a loop that does not stop by ``max_attempts``
(the drill lets one attempt past it start, then cancels the job), a wait shorter than
``min_backoff_s``, a restart from step 1 while a checkpoint existed.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from trainguard.drills.crash_loop import (
    CrashLoopAttempt,
    CrashLoopEvidence,
    judge_loop,
    where_struck,
)
from trainguard.queue.base import Submission, SubmissionError
from trainguard.queue.slurm import SlurmBackend
from trainguard.queue.slurm_drill import JobLog, SlurmAttempt, check_metric_regex
from trainguard.report import CheckResult, CheckStatus
from trainguard.unit.checkpoints import latest_complete_checkpoint

__all__ = ["SLURM_NO_BACKOFF", "SlurmCrashLoop", "run_slurm_crash_loop"]

#: what the wait before a requeued attempt is: Slurm's requeue has no backoff a job sets
SLURM_NO_BACKOFF = ("Slurm's requeue has no backoff setting a job sets: its wait is the requeue delay "
                    "measured from the kill to the next attempt's start")


@dataclass
class SlurmCrashLoop:
    """One crash_loop drill of a Slurm job.

    Args:
        name: the drill's name (the result is ``drill:<name>``).
        after_step: every attempt is struck once it printed this step.
        metric_regex: the job's metric line (groups ``step`` and ``value``).
        max_attempts: the cap: the most attempts the policy may start.
        min_backoff_s: the shortest wait before a requeued attempt the policy promises (0: not judged).
        ranks: the job's ranks (rank-seconds are an attempt's seconds times this).
        checkpoints: the job's checkpoint directory, read when an attempt is struck (None: a
            restart from step 1 is not judged).
        metric: the metric's name.
        timeout_s: the most seconds the drill follows the job (then it cancels it).
        poll_s: how often the log and the job's state are read.
    """

    name: str
    after_step: int
    metric_regex: str
    max_attempts: int
    min_backoff_s: float = 0.0
    ranks: int = 1
    checkpoints: str | None = None
    metric: str = "loss"
    timeout_s: float = 300.0
    poll_s: float = 0.2

    def __post_init__(self) -> None:
        if self.after_step < 1 or self.max_attempts < 1 or self.min_backoff_s < 0 or self.ranks < 1:
            raise SubmissionError("after_step, max_attempts and ranks must be >= 1 and min_backoff_s >= 0, got "
                                  f"{self.after_step}, {self.max_attempts}, {self.ranks} and {self.min_backoff_s:g}")
        check_metric_regex(self.metric_regex)


@dataclass
class _Strikes:
    """What the drill did to each attempt: the step and wall-clock time it struck it at, and the
    newest checkpoint then."""

    step: dict[int, int]
    at: dict[int, float]
    newest: dict[int, str | None]


def run_slurm_crash_loop(backend: SlurmBackend, job_id: str, log: str | Path,
                         drill: SlurmCrashLoop) -> CheckResult[CrashLoopEvidence]:
    """Strike every attempt of the submitted job ``job_id`` (its log ``log``) and judge how its
    requeue policy ended the loop."""
    started = time.monotonic()
    tail = JobLog(Path(log), drill.metric, drill.metric_regex)
    strikes = _Strikes({}, {}, {})
    deadline = started + drill.timeout_s
    stopped, state = "", backend.status(job_id)
    while True:
        tail.read(deadline)
        attempts = tail.attempts
        if len(attempts) > drill.max_attempts:
            stopped = f"attempt {len(attempts)} started past the cap of {drill.max_attempts}: the drill cancelled the job"
            break
        if attempts and len(attempts) - 1 not in strikes.step:
            _strike(backend, job_id, drill, attempts, strikes)
        state = backend.status(job_id)
        if state.terminal:
            break
        if time.monotonic() > deadline:
            stopped = f"still {state.message} after {drill.timeout_s:g} s: the drill cancelled the job"
            break
        time.sleep(drill.poll_s)
    ended_at = time.time()
    if stopped:
        backend.client("scancel", job_id)
        state = backend.wait(job_id, 30, poll_s=0.5)
    tail.read(time.monotonic() + 10)
    status, summary, found = _judge(drill, job_id, tail.attempts, strikes, state, stopped, ended_at)
    return CheckResult(f"drill:{drill.name}", status, summary, found, time.monotonic() - started)


def _strike(backend: SlurmBackend, job_id: str, drill: SlurmCrashLoop, attempts: list[SlurmAttempt],
            strikes: _Strikes) -> None:
    """SIGKILL the running step of the newest attempt once it printed ``after_step``."""
    current = len(attempts) - 1
    step = max((p.step for p in attempts[-1].points), default=0)
    if step < drill.after_step:
        return
    try:
        hit = backend.signal_steps(job_id, "KILL")
    except SubmissionError:  # the step ended meanwhile: the state tells
        return
    if hit:
        strikes.step[current], strikes.at[current] = step, time.time()
        strikes.newest[current] = _newest_checkpoint(Path(drill.checkpoints)) if drill.checkpoints else None


def _newest_checkpoint(directory: Path) -> str | None:
    """The newest complete checkpoint trainguard recognises under ``directory``, else its newest
    non-empty file (a job's own format: the toy job's ``rank0-step000005.json``), else None."""
    newest = latest_complete_checkpoint(directory)
    if newest is not None:
        return str(newest)
    try:
        files = [(p.stat().st_mtime, p) for p in directory.iterdir()
                 if not p.name.startswith(".") and p.is_file() and p.stat().st_size > 0]
    except OSError:
        return None
    return str(max(files)[1]) if files else None


def _judge(drill: SlurmCrashLoop, job_id: str, attempts: list[SlurmAttempt], strikes: _Strikes,
           state: Submission, stopped: str, ended_at: float) -> tuple[CheckStatus, str, CrashLoopEvidence]:
    """The verdict, its summary and the measured loop."""
    measured, best = [], 0
    for i, attempt in enumerate(attempts):
        steps = sorted({p.step for p in attempt.points})
        struck = strikes.step.get(i)
        end = strikes.at.get(i, ended_at)
        duration = max(0.0, end - attempt.started_at) if attempt.started_at is not None else 0.0
        before = strikes.at.get(i - 1)
        wait = attempt.started_at - before if i and before is not None and attempt.started_at is not None else None
        outcome = ("struck" if struck is not None else "stopped by the drill" if stopped
                   else "ok" if state.status == "succeeded" else state.message)
        measured.append(CrashLoopAttempt(
            i, outcome, struck, steps[0] if steps else None, steps[-1] if steps else None,
            len([s for s in steps if s > best]), None if wait is None else round(wait, 3), round(duration, 3),
            round(duration * drill.ranks, 3), strikes.newest.get(i - 1) if i else None,
            reached_step=steps[-1] if struck is not None and steps else None))
        best = max([best, *steps])
    policy = f"Slurm requeue of job {job_id} ({attempts[0].host if attempts else 'no node seen'})"
    ended = f"{state.message}; restarts {state.evidence.get('restarts')}" + (f"; {stopped}" if stopped else "")
    spent = round(sum(a.rank_seconds for a in measured), 3)
    failing, struck_count, where = where_struck(measured)
    status: CheckStatus
    if not measured:
        status, problems = "error", [f"no attempt of job {job_id} in its log ({ended}): is it trainguard's sbatch script?"]
    else:
        status, problems = judge_loop(measured, drill.max_attempts, drill.min_backoff_s, no_backoff=SLURM_NO_BACKOFF)
    found = CrashLoopEvidence(policy, failing, struck_count, drill.max_attempts, drill.min_backoff_s, "", spent,
                              measured, problems, ended, backoff_setting=SLURM_NO_BACKOFF)
    waits = ", ".join(f"{a.wait_before_s:.1f}" for a in measured if a.wait_before_s is not None) or "none"
    if status == "passed":
        summary = (f"{where}; Slurm stopped requeueing after {len(measured)} attempt(s) (cap {drill.max_attempts}): "
                   f"{state.message}; waits {waits} s (min_backoff_s {drill.min_backoff_s:g}); "
                   f"{spent:.1f} rank-seconds spent")
    else:
        summary = f"{where}; " + "; ".join(problems) + f"; waits {waits} s; {spent:.1f} rank-seconds spent"
    return status, summary, found
