"""The ``crash_loop`` drill and its expectation ``give_up`` (docs/drills.md, "crash_loop").

The fault (:mod:`trainguard.faults.crash_loop`) strikes every attempt: SIGKILL to rank ``rank``
when the job prints step ``after_step`` (or the first step past it). The job's own restart policy
runs as the user configured it -- trainguard's launcher: ``job.max_restarts`` and ``job.restart``
(:mod:`trainguard.run.restarts`) -- and the drill measures, per attempt: the step it was struck
at, its first and last step, its progress (steps beyond every earlier attempt's), the wait
before it (measured from the end of the previous attempt to its start), the checkpoint it could
resume from, and the rank-seconds it spent. It fails:

* a loop that does not stop by its cap (``max_attempts``): the drill lets one attempt past the
  cap start, which proves the policy would have gone on, and stops there;
* a restart with less than ``min_backoff_s`` of wait before it;
* a restart that began again from step 1 while a complete checkpoint existed.

A loop that never formed (the job got past the step: the final attempt completed) or a fault that
never struck is an error, never a pass.
"""

from __future__ import annotations

import collections
import contextlib
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from trainguard.config import DrillSpec, Job
from trainguard.drills.evidence import DrillEvidence
from trainguard.drills.expectations import JudgeEntry
from trainguard.drills.judges import DrillContext, Judgement, common_evidence
from trainguard.evidence import MERGED, UNSET, Evidence, Unset
from trainguard.faults.crash_loop import CrashLoopFault
from trainguard.faults.hook import pull_trigger
from trainguard.launch import Launcher, MetricPoint, RunResult
from trainguard.launch.hook import hook_env
from trainguard.launch.reach import RankReach, RankWatch, WorkerNotHere, WorkerSighting
from trainguard.launch.rundir import new_run_dir
from trainguard.report import CheckId, CheckResult, CheckStatus, SkipReason
from trainguard.run.runner import JobRunner, LaunchOptions, SupervisedRun
from trainguard.unit.checkpoints import latest_complete_checkpoint

__all__ = ["GIVE_UP", "RAY_TRAIN_NO_BACKOFF", "TORCHRUN_NO_BACKOFF", "CrashLoopAttempt", "CrashLoopEvidence",
           "CrashLoopReport", "judge_loop", "run_crash_loop", "where_struck"]

#: a measured wait this much short of min_backoff_s still counts (clock reads, not policy)
_CLOCK_SLACK_S = 0.01
#: how often the worker striker looks for the next worker generation
_POLL_S = 0.02


@dataclass
class CrashLoopAttempt(Evidence):
    """One attempt of the loop as measured."""

    attempt: int
    outcome: str
    #: the step the fault struck it at (None: it never got there)
    struck_at_step: int | None
    first_step: int | None
    last_step: int | None
    #: steps it printed beyond every earlier attempt's furthest
    progress_steps: int
    #: the wait before it: from the end of the previous attempt to its start (None: the first)
    wait_before_s: float | None
    duration_s: float
    rank_seconds: float
    #: the newest complete checkpoint when it started (None: none; the first attempt's is None)
    checkpoint_at_start: str | None
    #: the node the struck rank's worker ran on (a backend that places workers: Ray)
    node: str | Unset | None = UNSET
    #: the last step the attempt printed once struck: where the rank had got when it died (a
    #: kill through Ray's API lands seconds after the drill struck; None: not struck)
    reached_step: int | Unset | None = UNSET


@dataclass
class CrashLoopEvidence(Evidence):
    """What the policy did under a fault that strikes every attempt."""

    #: the policy under test, in words
    policy: str
    #: the step that kept failing (the one most attempts were struck at)
    failing_step: int | None
    attempts_struck: int
    cap: int
    min_backoff_s: float
    #: why the policy stopped before max_restarts ran out (empty: it ran out, or the cap stopped it)
    gave_up: str
    rank_seconds: float
    attempts: list[CrashLoopAttempt]
    problems: list[str]
    #: how the last launch ended, in the launcher's words (torchrun's end, for ``target: worker``)
    ended: str
    drill_dir: str | Unset = UNSET
    run_dir: str | Unset = UNSET
    #: the backoff the policy sets, in words; for a policy with no backoff setting (torchrun, Ray
    #: Train, Slurm's requeue), what its measured wait is instead
    backoff_setting: str | Unset = UNSET


#: what the wait before a restart is, for the policies that have no backoff setting
TORCHRUN_NO_BACKOFF = ("torchrun has no backoff setting: its wait is its monitor interval and the "
                       "workers' teardown")
RAY_TRAIN_NO_BACKOFF = ("Ray Train's FailureConfig has no backoff setting: its wait is the worker "
                        "group's teardown and restart")


@dataclass
class CrashLoopReport(Evidence):
    """A crash_loop drill's report object: what its spec asked, then its record."""

    fault: str
    expect: str
    rank: int
    after_step: int
    steps: int
    found: CrashLoopEvidence | Unset = field(default=UNSET, metadata=MERGED)


class Striker:
    """Strikes every attempt: SIGKILL to ``rank`` at the first ``metric`` line of a step >=
    ``after_step``; notes each attempt's first and last step and what the checkpoint directory
    held once it was struck."""

    def __init__(self, rank: int, after_step: int, metric: str, checkpoints: Path, cap: int) -> None:
        self.rank, self.after_step, self.metric, self.checkpoints = rank, after_step, metric, checkpoints
        self.cap = cap
        self.struck: dict[int, int] = {}
        self.first: dict[int, int] = {}
        self.last: dict[int, int] = {}
        self.newest: dict[int, str | None] = {}  # attempt -> the newest checkpoint once it was struck
        #: how: raise -- the start-up hook's trigger file (None: SIGKILL)
        self.trigger: Path | None = None
        self._lock = threading.Lock()

    def attempt_of(self, launcher: Launcher) -> int:
        """The attempt a line belongs to: trainguard's restart count."""
        return launcher.spec.restart_count

    def on_metric(self, point: MetricPoint, launcher: Launcher) -> None:
        if point.name != self.metric:
            return
        with self._lock:
            attempt = self.attempt_of(launcher)
            self.first.setdefault(attempt, point.step)
            self.last[attempt] = max(point.step, self.last.get(attempt, point.step))
            if attempt in self.struck or point.step < self.after_step or self.spares(attempt):
                return
            self.struck[attempt] = point.step
            self.strike(launcher, attempt)
        newest = latest_complete_checkpoint(self.checkpoints)
        self.newest[attempt] = None if newest is None else str(newest)

    def spares(self, attempt: int) -> bool:
        """The fault leaves ``attempt`` alone (the node mode: its worker is elsewhere)."""
        return False

    def strike(self, launcher: Launcher, attempt: int) -> None:
        if self.trigger is not None:  # how: raise -- the hook in this attempt's rank raises
            pull_trigger(self.trigger, launcher.ranks[self.rank].popen.pid)
        else:
            launcher.kill_rank(self.rank, signal.SIGKILL)
        with contextlib.suppress(OSError, subprocess.TimeoutExpired):
            launcher.ranks[self.rank].popen.wait(timeout=5)

    def finish(self) -> None:
        """Nothing left running (the worker striker's watchers)."""


class WorkerStriker(Striker):
    """``target: worker``: strikes the rank's child processes (torchrun's workers); an attempt is
    a worker generation, its wait measured from the kill to the next worker's process start. A
    generation past the cap stops the launch (proof the policy went on)."""

    def __init__(self, rank: int, after_step: int, metric: str, checkpoints: Path, cap: int) -> None:
        super().__init__(rank, after_step, metric, checkpoints, cap)
        self.generation = 0
        self.waits: dict[int, float] = {}
        self.spans: dict[int, tuple[float, float]] = {}  # generation -> (start, end), time.monotonic()
        self.workers: dict[int, int] = {}  # generation -> processes struck
        self._threads: list[threading.Thread] = []
        self._stop = threading.Event()

    def attempt_of(self, launcher: Launcher) -> int:
        if self.generation > self.cap - 1 and self.generation not in self.first:
            launcher.stop(f"crash_loop: attempt {self.generation + 1} started past the cap of {self.cap} attempt(s)")
        return self.generation

    def strike(self, launcher: Launcher, attempt: int) -> None:
        rank = psutil.Process(launcher.ranks[self.rank].popen.pid)
        kids = rank.children()
        if self.trigger is not None:  # how: raise -- the hook in every worker of this generation raises
            pull_trigger(self.trigger, [kid.pid for kid in kids])
        for kid in kids if self.trigger is None else ():
            with contextlib.suppress(psutil.Error):
                kid.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        self.spans[attempt] = (self.spans.get(attempt, (killed - launcher.elapsed(), killed))[0], killed)
        self.workers[attempt] = len(kids)
        watcher = threading.Thread(target=self._next_worker, args=(rank, {k.pid for k in kids}, killed, attempt + 1),
                                   name="trainguard-crash-loop-watch", daemon=True)
        self._threads.append(watcher)
        watcher.start()

    def _next_worker(self, rank: psutil.Process, old: set[int], killed: float, generation: int) -> None:
        """The wait before ``generation``: from the kill to its first worker process seen (polled
        every ``_POLL_S``: the process clock of /proc counts from a boot time in whole seconds)."""
        while not self._stop.wait(_POLL_S):
            try:
                new = [k for k in rank.children() if k.pid not in old]
            except psutil.Error:
                return
            if new:
                seen = time.monotonic()
                self.waits[generation] = seen - killed
                self.spans[generation] = (seen, seen)
                self.generation = generation  # lines of the old one still read count for it
                return

    def finish(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=5)


class ReachStriker(WorkerStriker):
    """A job whose backend restarts its ranks inside the launch (Ray Train's FailureConfig): the
    rank's worker is reached as the backend says (:class:`~trainguard.launch.reach.RankReach`),
    each worker generation is an attempt, its wait measured from the kill to the next sighting of
    the rank's worker, and the node each generation's worker ran on is noted."""

    def __init__(self, rank: int, after_step: int, metric: str, checkpoints: Path, cap: int,
                 reach: RankReach, ranks: int) -> None:
        super().__init__(rank, after_step, metric, checkpoints, cap)
        self.reach, self.ranks = reach, ranks
        self.nodes: dict[int, str | None] = {}
        #: the node mode: strike only where attempt 0's worker of the rank ran
        self.by_node = False
        self._launch_t0 = 0.0

    def strike(self, launcher: Launcher, attempt: int) -> None:
        watch = self.reach.watch(launcher)
        watch.poll()
        seen = watch.started_after(-1.0, self.rank)
        self.nodes.setdefault(attempt, _node(seen[-1]) if seen else None)
        killed = launcher.elapsed()
        self._launch_t0 = time.monotonic() - killed
        if self.trigger is not None and seen:  # how: raise -- in the train function of the rank's worker
            pull_trigger(self.trigger, seen[-1].pid)
        elif self.trigger is None:
            with contextlib.suppress(Exception):  # a worker gone already: the next generation tells
                self.reach.target(launcher).kill_rank(self.rank, signal.SIGKILL)
        start = self.spans.get(attempt, (self._launch_t0, 0.0))[0]
        self.spans[attempt] = (start, self._launch_t0 + killed)
        self.workers[attempt] = self.ranks  # the whole worker group restarts
        watcher = threading.Thread(target=self._next_sighting, args=(watch, killed, attempt + 1),
                                   name="trainguard-crash-loop-watch", daemon=True)
        self._threads.append(watcher)
        watcher.start()

    @property
    def bad_node(self) -> str | None:
        return self.nodes.get(0) if self.by_node else None

    def spares(self, attempt: int) -> bool:
        node = self.nodes.get(attempt)
        return self.by_node and attempt > 0 and node is not None and node != self.bad_node

    def on_metric(self, point: MetricPoint, launcher: Launcher) -> None:
        if point.name == self.metric:
            self.reach.ready(launcher, self.rank)  # the worker looked up while it trains (once)
        super().on_metric(point, launcher)

    def _next_sighting(self, watch: RankWatch, killed: float, generation: int) -> None:
        while not self._stop.wait(_POLL_S):
            with contextlib.suppress(Exception):
                watch.poll()
            new = watch.started_after(killed, self.rank)
            if new:
                self.waits[generation] = max(0.0, new[0].t - killed)
                self.nodes[generation] = _node(new[0])
                self.spans[generation] = (self._launch_t0 + new[0].t, self._launch_t0 + new[0].t)
                self.generation = generation  # lines of the old one still read count for it
                return


def _node(sighting: WorkerSighting) -> str | None:
    """The node a worker ran on: the backend's node id (several nodes of one machine share an IP)."""
    return f"{sighting.node_id} ({sighting.node})" if sighting.node_id else sighting.node


def _measure(run: SupervisedRun, striker: Striker, world_size: int) -> list[CrashLoopAttempt]:
    if isinstance(striker, WorkerStriker):  # and ReachStriker
        return _measure_generations(run, striker)
    out, best = [], 0
    for i, result in enumerate(run.attempts):
        steps = sorted({p.step for p in result.points if p.name == striker.metric})
        wait = run.waits[i - 1].measured_s if 0 < i <= len(run.waits) else None
        start = _checkpoint_at_start(run, result, striker, i)
        out.append(CrashLoopAttempt(
            i, result.outcome, striker.struck.get(i), striker.first.get(i), steps[-1] if steps else None,
            len([s for s in steps if s > best]), None if wait is None else round(wait, 3),
            round(result.duration_s, 3), round(result.duration_s * world_size, 3), start,
            reached_step=steps[-1] if i in striker.struck and steps else None))
        best = max([best, *steps])
    return out


def _measure_generations(run: SupervisedRun, striker: WorkerStriker) -> list[CrashLoopAttempt]:
    """The worker generations of one launch (torchrun's restarts), as attempts."""
    out, best, end = [], 0, time.monotonic()
    seen = sorted(set(striker.first) | set(striker.struck))
    for g in seen:
        first, last = striker.first.get(g), striker.last.get(g)
        span = striker.spans.get(g)
        duration = (span[1] if g in striker.struck and span else end) - span[0] if span else 0.0
        ranks = striker.workers.get(g, 1)
        # a launch that completed ended its last generation, struck or not (a kill that did not take)
        outcome = "ok" if g == seen[-1] and run.final.outcome == "ok" else "struck" if g in striker.struck \
            else run.final.outcome
        wait = striker.waits.get(g)
        out.append(CrashLoopAttempt(
            g, outcome, striker.struck.get(g), first, last, max(0, (last or 0) - best) if last and last > best else 0,
            None if wait is None else round(wait, 3), round(duration, 3), round(duration * ranks, 3),
            striker.newest.get(g - 1) if g else None,
            striker.nodes.get(g) if isinstance(striker, ReachStriker) else UNSET,
            last if g in striker.struck else None))
        best = max(best, last or 0)
    return out


def _checkpoint_at_start(run: SupervisedRun, result: RunResult, striker: Striker, i: int) -> str | None:
    """The newest complete checkpoint when attempt ``i`` started: the one trainguard passed it
    (``resumed_from``), else the one the directory held once attempt ``i - 1`` was struck."""
    if i == 0:
        return None
    resumed = result.evidence.get("resumed_from")
    if isinstance(resumed, str) and resumed and not resumed.startswith("nothing"):
        return resumed
    return striker.newest.get(i - 1)


def judge_loop(attempts: list[CrashLoopAttempt], cap: int, min_backoff_s: float,
               bad_node: str | None = None, no_backoff: str = "") -> tuple[CheckStatus, list[str]]:
    """The verdict on the measured attempts and its problems (failed) or why none (error).
    ``bad_node``: the node mode's failing node (a rank put back there fails; moved off it, the
    loop ends by the policy's placement and passes). ``no_backoff``: for a policy with no backoff
    setting, what its wait is instead, said with the first wait under ``min_backoff_s`` (the
    verdict is the measured waits', never these words')."""
    if not any(a.struck_at_step is not None for a in attempts):
        return "error", [f"the fault never struck: no attempt printed a step >= after_step "
                         f"({attempts[0].outcome}: check job.metrics and steps)"]
    moved = bad_node is not None and attempts[-1].node not in (bad_node, None, UNSET)
    last = attempts[-1]
    if last.outcome == "ok" and not moved:
        why = (f"attempt {last.attempt} completed although the fault struck it at step {last.struck_at_step}: the "
               "kill did not end the rank (or landed after its last step; give the job more steps)"
               if last.struck_at_step is not None else
               f"attempt {last.attempt} completed (it resumed past the step the fault strikes at; set after_step "
               "to a step no checkpoint is saved at)")
        return "error", [f"no crash loop formed: {why}"]
    problems = []
    if len(attempts) > cap:
        problems.append(f"did not stop by its cap of {cap} attempt(s): attempt {cap + 1} started")
    for a in attempts[1:]:
        if min_backoff_s > 0 and a.wait_before_s is not None and a.wait_before_s + _CLOCK_SLACK_S < min_backoff_s:
            said = any("min_backoff_s" in problem for problem in problems)  # the policy's words once
            problems.append(f"restarted attempt {a.attempt} after {a.wait_before_s:.2f} s, less than "
                            f"min_backoff_s {min_backoff_s:g}" + (f" ({no_backoff})" if no_backoff and not said else ""))
        if a.first_step == 1 and a.checkpoint_at_start is not None:
            problems.append(f"attempt {a.attempt} began again from step 1 while {a.checkpoint_at_start} existed")
        if bad_node is not None and a.node == bad_node:
            problems.append(f"attempt {a.attempt} put the rank back on node {bad_node}, where it failed before")
    return ("failed" if problems else "passed"), problems


def run_crash_loop(runner: JobRunner, spec: DrillSpec) -> CheckResult[CrashLoopReport]:
    """Run one crash_loop drill and judge it (``drill:<name>``)."""
    started = time.monotonic()
    job_file, job = runner.job_file, runner.job_file.job
    base = CrashLoopReport("crash_loop", "give_up", spec.rank, spec.after_step, spec.steps)
    reproduce = f"trainguard drill {job_file.path} --only {spec.name}"

    def result(status: CheckStatus, summary: str, found: CrashLoopEvidence | Unset = UNSET,
               skip: SkipReason | None = None) -> CheckResult[CrashLoopReport]:
        report = CrashLoopReport(base.fault, base.expect, base.rank, base.after_step, base.steps, found)
        return CheckResult(str(CheckId.of_drill(spec.name)), status, summary, report,
                           time.monotonic() - started, reproduce, skip)

    unavailable = CrashLoopFault.unavailable_for(runner.backend)
    if unavailable is not None:
        return result("skipped", unavailable, UNSET, SkipReason.JOB_KIND)
    params = spec.fault_params
    given = params.optional_number("max_attempts") if "max_attempts" in params else None
    cap = int(given) if given is not None else job.max_restarts + 1
    wait = params.optional_number("min_backoff_s") if "min_backoff_s" in params else None
    worker = params.raw("target", "rank") == "worker"
    # a backend that restarts the ranks inside the launch (Ray Train): its policy is under test
    in_launch = runner.backend.drill_restarts("kill_rank", "recover", 1).in_launch
    # torchrun's and Ray Train's own policies promise no backoff: judged only when the drill sets one
    min_backoff = float(wait if wait is not None else 0.0 if worker or in_launch else job.restart.backoff_s)
    world_size = spec.world_size or job.world_size
    request = runner.request_for(spec, world_size=world_size)
    drill_dir = new_run_dir(job_file.state_dir, job.name, f"drill-{spec.name}", keep=runner.settings.keep_runs)
    checkpoints = drill_dir / "checkpoints"
    checkpoints.mkdir(parents=True, exist_ok=True)
    reach = runner.backend.fault_reach("kill_rank", job_name=job.name, world_size=world_size) if in_launch else None
    striker = (ReachStriker(spec.rank, spec.after_step, job.progress_metric, checkpoints, cap, reach, world_size) if reach
               else (WorkerStriker if worker else Striker)(spec.rank, spec.after_step, job.progress_metric,
                                                           checkpoints, cap))
    if isinstance(striker, ReachStriker):
        striker.by_node = params.raw("node") == "first"
    env = reach.launch_env() if reach else None
    if params.raw("how", "kill") == "raise":
        striker.trigger = drill_dir / "crash_loop.trigger"
        # torchrun's workers and Ray's have their RANK only once started (or another one): every
        # process arms, and the trigger names the pids that raise
        rank = spec.rank if runner.backend.rank_at_start() and not worker else None
        env = {**(env or {}), **hook_env({"fault": "crash_loop", "mode": "raise", "rank": rank,
                                          "trigger": str(striker.trigger), "step": spec.after_step,
                                          "events": str(drill_dir / "crash_loop.events.jsonl")}, job.env)}
    stall = spec.stall_timeout or job.stall_timeout
    try:
        if reach is not None:
            try:
                client = reach.open()
            except WorkerNotHere as exc:
                return result("error", str(exc))
            if striker.trigger is not None and client is not None and not client.pid_path:
                return result("error", "`how: raise` names the Ray worker's pid to the start-up hook, and the "
                              "workers are reached through Ray's API here (their pids are not this machine's): "
                              "use `how: kill`, or run the drill where the workers run")
        run = runner.supervise(request, label=f"drill-{spec.name}", checkpoint_dir=checkpoints,
                               on_metric=striker.on_metric,
                               options=LaunchOptions(max_restarts=0 if in_launch else min(job.max_restarts, cap),
                                                     extra_env=env,
                                                     stall_timeout=stall, startup_timeout=max(stall, job.stall_timeout)))
    finally:
        striker.finish()
        if reach is not None:
            reach.close()
    attempts = _measure(run, striker, world_size)
    bad = striker.bad_node if isinstance(striker, ReachStriker) else None
    policy, backoff = _policy(job, worker, in_launch)
    status, problems = judge_loop(attempts, cap, min_backoff, bad, backoff if worker or in_launch else "")
    failing, struck, where = where_struck(attempts)
    spent = round(sum(a.rank_seconds for a in attempts), 3)
    found = CrashLoopEvidence(policy, failing, struck, cap, min_backoff, run.gave_up, spent, attempts, problems,
                              f"{run.final.outcome}: {run.final.reason}" if run.final.reason else run.final.outcome,
                              str(drill_dir), str(run.run_dir), backoff)
    waits = ", ".join(f"{a.wait_before_s:.2f}" for a in attempts if a.wait_before_s is not None) or "none"
    if status != "passed":
        return result(status, f"{where}; " + "; ".join(problems) + f"; {spent:.1f} rank-seconds spent", found)
    if bad is not None and attempts[-1].outcome == "ok":
        return result("passed", f"{where}; the policy moved rank {spec.rank} off node {bad} in attempt "
                      f"{attempts[-1].attempt} and the job completed; {spent:.1f} rank-seconds spent", found)
    stop = (f"the launch ended ({found.ended[:200]})" if worker or in_launch
            else run.gave_up or f"its limit of {job.max_restarts} restart(s) ran out")
    return result("passed", f"{where}; the policy stopped after {len(attempts)} attempt(s) (cap {cap}): {stop}; "
                  f"waits {waits} s (min_backoff_s {min_backoff:g}); {spent:.1f} rank-seconds spent", found)


def where_struck(attempts: list[CrashLoopAttempt]) -> tuple[int | None, int, str]:
    """The step that kept failing (the one most attempts were struck at), how many attempts were
    struck, and both in words -- with every step struck when they differ, and the step each
    attempt had reached when it died where that is later (a slow kill)."""
    struck = [a.struck_at_step for a in attempts if a.struck_at_step is not None]
    failing = collections.Counter(struck).most_common(1)[0][0] if struck else None
    where = (f"step {failing} failed on {len(struck)} of {len(attempts)} attempt(s)"
             + (f" (struck at steps {', '.join(map(str, sorted(set(struck))))})" if len(set(struck)) > 1 else ""))
    late = [f"attempt {a.attempt} struck at step {a.struck_at_step} reached step {a.reached_step}" for a in attempts
            if isinstance(a.reached_step, int) and a.struck_at_step is not None and a.reached_step > a.struck_at_step]
    return failing, len(struck), where + (f" (the rank died later: {', '.join(late)})" if late else "")


def _policy(job: Job, worker: bool, in_launch: bool) -> tuple[str, str]:
    """The policy under test in words, and its backoff setting (or, for a policy without one,
    what its wait is instead)."""
    if in_launch:
        return f"Ray Train FailureConfig(max_failures={job.max_restarts}), inside one fit", RAY_TRAIN_NO_BACKOFF
    if worker:
        return (f"the job's own restarts of its workers (`{' '.join(job.command)}`), one trainguard attempt",
                TORCHRUN_NO_BACKOFF)
    r = job.restart
    return (f"trainguard launcher: job.max_restarts {job.max_restarts}, backoff {r.backoff_s:g} s doubling to "
            f"{r.max_backoff_s:g} s, jitter {r.jitter:g}, max_attempts_without_progress "
            f"{r.max_attempts_without_progress or 'none'}",
            f"backoff_s {r.backoff_s:g} doubling to max_backoff_s {r.max_backoff_s:g}, jitter {r.jitter:g}")


def _judged_by_its_drill(c: DrillContext) -> Judgement:
    return Judgement("error", f"`expect: give_up` is judged by the crash_loop drill; {c.spec.fault} strikes once "
                     "(use `fault: crash_loop`)", common_evidence(c, DrillEvidence))


#: give_up as the registry holds it: only crash_loop is judged by it, and its drill runner judges
GIVE_UP = JudgeEntry("give_up", _judged_by_its_drill)
