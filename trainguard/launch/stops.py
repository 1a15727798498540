"""Why the launcher ends an attempt: each stop condition as a named object.

The launcher's monitor makes one pass every poll interval (50 ms): it gathers what happened
into a :class:`Snapshot` (lines parsed, each rank's exit, a memory sample every 0.5 s), then asks
each condition of :func:`stop_conditions` in turn; the first that returns a :class:`Stop` ends
the attempt, and the launcher acts on it (each rank's activity and stacks collected when the
stop asks for them, then the teardown). A condition only reads the snapshot: it starts,
signals and waits for nothing, so each can be tried on a constructed one.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from trainguard.launch.hang_evidence import EarlyExit, describe_early_exit, early_exit
from trainguard.launch.metrics import MetricPoint
from trainguard.launch.procs import signal_name

__all__ = [
    "AllRanksExited",
    "Deadline",
    "MemoryLimit",
    "Outcome",
    "Progress",
    "RankFailed",
    "SilentRankWait",
    "Snapshot",
    "Stall",
    "StepsDone",
    "Stop",
    "StopCondition",
    "StopRequested",
    "ended_by_trainguard",
    "first_stop",
    "silent_rank_wait",
    "stop_conditions",
]

#: how an attempt ended (``RunResult.outcome``)
Outcome = Literal["ok", "failed", "hung", "timeout", "stopped", "interrupted"]


@dataclass
class Progress:
    """The metric points seen so far, as the stall clock reads them (launch clock)."""

    #: the step whose line means the job is done with training (``LaunchSpec.final_step``)
    final_step: int | None = None
    first_metric: float | None = None
    last_progress: float = 0.0
    #: a rank printed ``final_step``: what is left is flushing and saving at exit
    finished: bool = False
    #: each rank that printed a metric line, with the highest step it printed (lines past
    #: ``final_step`` included, which a run trainguard ends itself never keeps)
    last_step: dict[int, int] = field(default_factory=dict)

    def record(self, point: MetricPoint) -> None:
        """Take one parsed point into account."""
        if self.first_metric is None:
            self.first_metric = point.t
        if self.final_step is not None and point.step >= self.final_step:
            self.finished = True
        self.last_progress = max(self.last_progress, point.t)
        self.last_step[point.rank] = max(self.last_step.get(point.rank, point.step), point.step)


@dataclass(frozen=True)
class Snapshot:
    """What one pass of the monitor saw, times on the launch clock."""

    now: float
    #: each rank's exit code in rank order, None while it runs (a negative code: a signal)
    exit_codes: Mapping[int, int | None]
    #: when the monitor first saw each rank that has exited
    exit_seen_at: Mapping[int, float] = field(default_factory=dict)
    #: the reason given to :meth:`~trainguard.launch.Launcher.stop`, once it was called
    stop_requested: str | None = None
    #: each live rank's process tree's resident memory, in MB, when this pass sampled it
    #: (every 0.5 s; empty on the passes between)
    memory_mb: Mapping[int, float] = field(default_factory=dict)
    #: the ranks trainguard itself signalled: their exit is no failure of theirs
    killed: frozenset[int] = frozenset()
    #: ``now`` less the time the ranks spent stopped by ``Launcher.frozen``: the job's own time
    job_time: float = 0.0
    #: when the last ``frozen`` span ended (0.0 without one)
    resumed_at: float = 0.0
    first_metric: float | None = None
    last_progress: float = 0.0
    finished: bool = False
    #: every metric point so far (only read when a stop looks for a rank that left early)
    points: Sequence[MetricPoint] = ()
    #: each rank that printed a metric line, with the highest step it printed
    last_step: Mapping[int, int] = field(default_factory=dict)

    def early_exit(self, alive: list[int]) -> EarlyExit | None:
        """The first rank that exited 0 while the ranks ``alive`` went on, as evidence (see
        :func:`~trainguard.launch.hang_evidence.early_exit`); None when none did."""
        last: dict[int, int] = {}
        for point in self.points:
            last[point.rank] = max(last.get(point.rank, point.step), point.step)
        return early_exit(dict(self.exit_codes), dict(self.exit_seen_at), last, alive)


@dataclass
class Stop:
    """A condition fired: how the attempt ends and what the run records about it."""

    outcome: Outcome
    reason: str = ""
    failed_rank: int | None = None
    evidence: dict[str, Any] = field(default_factory=dict)
    #: seconds between the moment the condition became true and its detection (a hang)
    detected_after_s: float | None = None
    #: the ranks still run and their state is the evidence (a deadline, a hang): each rank's
    #: CPU activity and stacks are collected before the teardown
    dump_ranks: bool = False


class StopCondition(Protocol):
    """One reason to end an attempt, asked once per monitor pass."""

    def check(self, state: Snapshot) -> Stop | None:
        """The stop, when this condition holds in ``state``; None otherwise."""
        ...


class StopRequested:
    """Someone called :meth:`~trainguard.launch.Launcher.stop` (a check's kill after a step):
    the attempt ends as "stopped" with their reason, blaming no rank."""

    def check(self, state: Snapshot) -> Stop | None:
        if state.stop_requested is None:
            return None
        return Stop("stopped", state.stop_requested)


@dataclass(frozen=True)
class MemoryLimit:
    """One rank's process tree holds more resident memory than ``limit_mb`` (None: no limit):
    the first such rank in rank order fails the attempt."""

    limit_mb: float | None

    def check(self, state: Snapshot) -> Stop | None:
        limit = self.limit_mb
        if limit is None:
            return None
        over = next(((rank, used) for rank, used in state.memory_mb.items() if used > limit), None)
        if over is None:
            return None
        rank, used = over
        reason = (
            f"rank {rank}'s processes used {used:.0f} MB of memory (RSS), "
            f"{used - limit:.0f} MB over the limit of {limit:g} MB"
        )
        evidence = {"memory_limit": {"rank": rank, "rss_mb": round(used, 1), "limit_mb": limit}}
        return Stop("failed", reason, failed_rank=rank, evidence=evidence)


class RankFailed:
    """A rank exited non-zero or died by a signal trainguard did not send: the whole group is
    stopped at once, or the others would wait in a collective until their own timeouts. The
    rank seen first is blamed; a peer that had already exited 0 is named as what it waited for."""

    def check(self, state: Snapshot) -> Stop | None:
        bad = [
            (rank, code)
            for rank, code in state.exit_codes.items()
            if code is not None and code != 0 and rank not in state.killed
        ]
        if not bad:
            return None
        rank, code = min(bad, key=lambda item: state.exit_seen_at[item[0]])
        name = signal_name(code)
        how = f"killed by {name}" if name else f"exited with code {code}"
        stop = Stop("failed", f"rank {rank} {how}", failed_rank=rank)
        left = state.early_exit([rank])
        if left is not None and left["exited_at_s"] < state.exit_seen_at[rank]:
            stop.evidence["early_exit"] = left
            after = (f"after its step {left['last_step']}" if left["last_step"] is not None
                     else "before any step of it was read")
            stop.reason += f" after rank {left['rank']} had exited 0 ({after}): it waited for it in a collective"
        # the death itself is not observable here (tests/benchmarks measure it from the kill);
        # what is known is that it was seen within one poll interval
        return stop


class AllRanksExited:
    """Every rank has ended and none failed (:class:`RankFailed` is asked first): "ok"."""

    def check(self, state: Snapshot) -> Stop | None:
        if all(code is not None for code in state.exit_codes.values()):
            return Stop("ok")
        return None


#: the longest trainguard waits, once the printing ranks are past the step, for a running rank
#: that has printed no metric line yet (s)
SILENT_RANK_WAIT_MAX_S = 30.0


@dataclass(frozen=True)
class StepsDone:
    """The job has no option for its number of steps (``job.stop_after_steps``): trainguard ends
    the run itself once every rank that prints metric lines printed one past ``final_step``. A
    line of step ``final_step + 1`` means that rank is done with every line of step
    ``final_step`` (a line of another metric of the same step comes before it), so two runs
    ended so hold the same steps 1..``final_step``, however late a line was read; the lines past
    it are dropped (:class:`~trainguard.launch.Launcher`). The run's outcome is "ok": the end
    is trainguard's, marked in its evidence (``ended_by_trainguard``), never the job's crash.

    A running rank that has printed no metric line yet may print none (only rank 0 logs) or
    may have started late (ranks that share no collective): it is waited for as long as the
    slowest printing rank took from the launch to its first line (at most
    :data:`SILENT_RANK_WAIT_MAX_S`), counted from the last line kept; one that prints meanwhile
    is then waited for past ``final_step`` like the others."""

    final_step: int | None

    def check(self, state: Snapshot) -> Stop | None:
        final = self.final_step
        if final is None or not state.last_step or min(state.last_step.values()) <= final:
            return None
        silent = sorted(r for r, code in state.exit_codes.items() if code is None and r not in state.last_step)
        wait = silent_rank_wait(state.points) if silent else None
        if wait is not None and state.now < wait.since + wait.seconds:
            return None
        waited = {"silent_ranks": silent, "waited_for_them_s": round(wait.seconds, 3)} if wait is not None else {}
        return Stop("ok", f"ended by trainguard after step {final}", evidence={"ended_by_trainguard": {
            "after_step": final, "ranks_seen": sorted(state.last_step), **waited}})


@dataclass(frozen=True)
class SilentRankWait:
    """How long :class:`StepsDone` waits for ranks that printed nothing, and from when."""

    #: the launch-clock time of the last line kept (the printing ranks' step ``final_step``)
    since: float
    seconds: float


def silent_rank_wait(points: Sequence[MetricPoint]) -> SilentRankWait:
    """The wait for a running rank that printed no line, from the lines kept (``points``): the
    slowest printing rank's time from the launch to its first line (its start-up: a rank that
    prints starts to within about that), capped at :data:`SILENT_RANK_WAIT_MAX_S`."""
    first: dict[int, float] = {}
    for point in points:
        first[point.rank] = min(first.get(point.rank, point.t), point.t)
    since = max((p.t for p in points), default=0.0)
    return SilentRankWait(since, min(max(first.values(), default=0.0), SILENT_RANK_WAIT_MAX_S))


@dataclass(frozen=True)
class Deadline:
    """The job's own time (stopped spans left out) passed ``timeout`` seconds."""

    timeout: float

    def check(self, state: Snapshot) -> Stop | None:
        if state.job_time > self.timeout:
            return Stop("timeout", f"the run exceeded its timeout of {self.timeout:g} s", dump_ranks=True)
        return None


@dataclass(frozen=True)
class Stall:
    """No new metric line for longer than the stall limit: a hang. CPU time is not progress
    (NCCL busy-polls inside a stuck collective). The limit is ``startup_timeout`` before the
    first line when set, at least ``shutdown_timeout`` once a rank printed its final step when
    set, ``stall_timeout`` otherwise (None: no limit). A rank that exited 0 while the others
    went on is named first as the likely cause of the silence."""

    stall_timeout: float | None
    startup_timeout: float | None = None
    shutdown_timeout: float | None = None

    def limit(self, state: Snapshot) -> float | None:
        """The stall limit that applies in ``state``."""
        if state.first_metric is None and self.startup_timeout is not None:
            return self.startup_timeout
        if state.finished and self.shutdown_timeout is not None:
            return max(self.stall_timeout or 0.0, self.shutdown_timeout)
        return self.stall_timeout

    def check(self, state: Snapshot) -> Stop | None:
        # frozen time is not the job's: a pause starts the stall clock afresh
        since = state.now - max(state.last_progress, state.resumed_at, 0.0)
        limit = self.limit(state)
        if limit is None or not since > limit:
            return None
        if state.first_metric is None:
            reason = f"no new metric line since launch for {since:.1f} s (limit {limit:g} s)"
        elif state.finished:
            reason = f"no exit {since:.1f} s after the last step (limit {limit:g} s)"
        else:
            reason = f"no new metric line for {since:.1f} s (limit {limit:g} s)"
        stop = Stop("hung", reason, detected_after_s=since - limit, dump_ranks=True)
        left = state.early_exit([rank for rank, code in state.exit_codes.items() if code is None])
        if left is not None:  # the cause of the silence, named first
            stop.evidence["early_exit"] = left
            stop.reason = f"{describe_early_exit(left)} ({reason})"
        return stop


def stop_conditions(*, timeout: float, stall_timeout: float | None, startup_timeout: float | None = None,
                    shutdown_timeout: float | None = None, max_rss_mb: float | None = None,
                    end_after_step: int | None = None) -> tuple[StopCondition, ...]:
    """Every condition, in the order the monitor asks them; the order decides between two
    that hold at once. A requested stop comes first (the ranks it killed have all exited, and
    that is no "ok"), a failed rank before "all exited" (its peers may have ended meanwhile),
    the job's own end before trainguard's (``end_after_step``: :class:`StepsDone`, asked only
    then), the deadline before a stall (an attempt past its timeout is a timeout, however quiet)."""
    return (
        StopRequested(),
        MemoryLimit(max_rss_mb),
        RankFailed(),
        AllRanksExited(),
        *((StepsDone(end_after_step),) if end_after_step is not None else ()),
        Deadline(timeout),
        Stall(stall_timeout, startup_timeout, shutdown_timeout),
    )


def first_stop(conditions: Iterable[StopCondition], state: Snapshot) -> Stop | None:
    """The stop of the first condition that fires in ``state``, or None."""
    for condition in conditions:
        stop = condition.check(state)
        if stop is not None:
            return stop
    return None


def ended_by_trainguard(evidence: object) -> int | None:
    """The step after which trainguard ended a run itself (:class:`StepsDone`), read from the
    run's evidence; None when the run ended otherwise."""
    ended = evidence.get("ended_by_trainguard") if isinstance(evidence, dict) else None
    step = ended.get("after_step") if isinstance(ended, dict) else None
    return step if isinstance(step, int) else None
