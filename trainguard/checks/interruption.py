"""Where a resume starts: the checkpoint a kill after step k leaves, kept from the uninterrupted
run or left by a run killed there.

The resume and reshard checks (and smoke's resume stage, through the resume check's run) resume
from a mid-run checkpoint. :func:`interrupt` takes the one the runner kept from the
uninterrupted run of the request (:mod:`trainguard.run.keep`: that run stopped after step k while
its checkpoint directory was copied); when none could be kept, it launches the run once more and
SIGKILLs it after step k, as the checks always did, and the report says why.
"""

from __future__ import annotations

import signal
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from trainguard.evidence import MERGED, UNSET, Evidence, Unset
from trainguard.launch import Launcher, MetricPoint, RunResult
from trainguard.run.keep import KeptCheckpoint, KeptEvidence
from trainguard.run.pool import RunPool
from trainguard.run.request import RunRequest

__all__ = ["Interruption", "InterruptionEvidence", "interrupt", "kill_after", "untested_kill"]


@dataclass
class Interruption:
    """The checkpoint a resume starts from, and the run that made it."""

    #: the step the run was stopped (kept) or killed after
    step: int | None
    #: the run whose sample records cover the steps before the resume
    run_dir: Path
    #: what the resume loads (a kept checkpoint: the copy; each resumed run gets its own copy)
    checkpoint_dir: Path
    kept: KeptCheckpoint | None = None
    #: the killed run, when nothing was kept
    killed: RunResult | None = None
    #: why the kill tested no resume (:func:`untested_kill`)
    error: str | None = None
    #: why no checkpoint was kept (a run was killed instead)
    not_kept: str = ""

    def words(self) -> str:
        """``killed after step 25`` or ``stopped after step 25 and its checkpoint kept``."""
        if self.kept is not None:
            return f"stopped after step {self.step} and its checkpoint kept (standing for a kill there)"
        return f"killed after step {self.step}"

    def writer(self) -> str:
        """Whose checkpoints these are: ``the killed run wrote`` or ``the uninterrupted run, stopped
        after step 5, had written``."""
        if self.kept is not None:
            return f"the uninterrupted run, stopped after step {self.step}, had written"
        return "the killed run wrote"

    def as_evidence(self) -> InterruptionEvidence:
        if self.kept is not None:
            return InterruptionEvidence("kept", self.kept.as_evidence())
        return InterruptionEvidence("killed", run_dir=str(self.run_dir), killed_after_step=self.step,
                                    not_kept=self.not_kept)


@dataclass
class InterruptionEvidence(Evidence):
    """How the checkpoint resumed from was made (:meth:`Interruption.as_evidence`): ``kept`` from
    an uninterrupted run (its keys written in place), or a run ``killed``."""

    how: str
    kept: KeptEvidence | Unset = field(default=UNSET, metadata=MERGED)
    run_dir: str | Unset = UNSET
    killed_after_step: int | Unset | None = UNSET
    not_kept: str | Unset = UNSET


def interrupt(pool: RunPool, request: RunRequest, after_step: int, metric: str, *, label: str,
              what: str = "the run") -> Interruption:
    """The checkpoint a kill of ``request`` after ``after_step`` leaves: kept from its
    uninterrupted run when the runner kept one, else from a run launched and killed now."""
    kept, why = pool.kept(request, after_step)
    if kept is not None:
        return Interruption(kept.step, kept.run_dir, kept.directory, kept=kept)
    killed = pool.run(request, label=label, on_metric=kill_after(metric, after_step), keep=False)
    return Interruption(killed.last_step, killed.run_dir, killed.checkpoints, killed=killed,
                        error=untested_kill(killed, metric, after_step, request.steps, what=what), not_kept=why)


#: how long (launch clock, from the cut step's line) a kill waits for the cut step's other
#: metric lines before it lands anyway, on the next line read
METRIC_WAIT_S = 2.0


def kill_after(metric: str, after_step: int, expected: Iterable[MetricPoint] = (),
               wait_s: float = METRIC_WAIT_S) -> Callable[[MetricPoint, Launcher], None]:
    """The metric callback that SIGKILLs the run once it printed ``after_step`` of ``metric``.

    With ``expected`` (the uninterrupted run's points), the kill waits until every metric line
    that run printed for the cut step (the newest step of ``metric`` read, on every rank) is read
    too: a job that prints its grad norm 50 ms after its loss line had it cut off, and the
    comparison of that cycle called it missing. The wait is bounded: a line read more than
    ``wait_s`` after the cut step's first one kills whatever is missing."""
    wanted: dict[int, set[tuple[str, int]]] = {}
    for p in expected:
        wanted.setdefault(p.step, set()).add((p.name, p.rank))
    seen: dict[int, set[tuple[str, int]]] = {}
    first_read: float | None = None  # when the first line of ``metric`` past after_step was read
    newest = after_step  # the newest step of ``metric`` read: the cut step

    def kill(point: MetricPoint, launcher: Launcher) -> None:
        nonlocal first_read, newest
        if point.step < after_step:
            return
        seen.setdefault(point.step, set()).add((point.name, point.rank))
        if point.name == metric:
            first_read = point.t if first_read is None else first_read
            newest = max(newest, point.step)
        if first_read is None:
            return
        if wanted.get(newest, set()) <= seen.get(newest, set()) or point.t - first_read > wait_s:
            launcher.stop(f"SIGKILL after step {newest}", signal.SIGKILL)

    return kill


def untested_kill(killed: RunResult, metric: str, after_step: int, steps: int, what: str = "the run") -> str | None:
    """Why the run that was to be SIGKILLed right after ``after_step`` (of ``steps``) tests no
    resume, or None when the kill landed mid-run.

    The kill came too late when the run had already printed its last step (it finished, or was
    killed in its teardown): its output is read with a lag, and a job that prints its lines in a
    burst (a logger flushed at exit) shows step ``after_step`` only at the end. That is said as
    such, not as a broken metric or a failed resume. A run that finished without ever printing
    ``after_step`` has a metric trainguard cannot read."""
    reached = max((p.step for p in killed.points if p.name == metric), default=None)
    late = reached is not None and (reached >= steps or (killed.ok and reached >= after_step))
    if late:
        how = "had finished" if killed.ok else "had printed its last step and was exiting"
        return (f"the kill came too late to test a resume: {what} {how} (step {reached} of {steps} "
                f"printed) when trainguard read step {after_step} of `{metric}` and sent the SIGKILL (the "
                "job's output is read with a lag that grows on a loaded machine, and a job that prints "
                "its lines in a burst shows them only then); give the check more steps after after_step, "
                "and print each step's line when it is done")
    if killed.outcome == "stopped":
        return None
    if killed.ok:
        return (f"{what} finished ({reached if reached is not None else 'no'} step(s) of `{metric}`) "
                f"before trainguard saw step {after_step} of `{metric}`; check job.metrics.{metric}")
    return f"{what} failed before step {after_step}: {killed.reason}"


