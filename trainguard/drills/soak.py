"""The chaos soak: faults drawn from a seed during one longer run, every recovery judged
(docs/drills.md, "Chaos soak").

A ``fault: soak`` drill draws its schedule (:func:`~trainguard.faults.soak.soak_schedule`: kind x
rank x trigger step) and runs the job once for ``steps`` steps under the restart policy
(``max_restarts``, default the number of faults + 2). Each scheduled fault is injected by its own
class when the watched rank prints the trigger step, in whichever attempt is running; trainguard
restarts the group from the latest checkpoint after each one (after a pre-emption too: a job
that saved and exited 0 short of its last step is restarted). The verdict is a recover drill's
over the whole run: it completes, every fault struck, no restart began again from step 1, at
most ``max_lost_steps`` steps lost per fault, and every step and the final checkpoint match the
uninterrupted run.

The soak also measures what the goodput forecast (docs/profiling.md) needs, on the real job:
per fault the restart cost (fault -> first step of the next attempt) and the steps lost; the
checkpoint cadence and save time (from the uninterrupted run's step times); and the goodput
(failure-free wall-clock / the soak's wall-clock). Beside it, the forecast's own prediction for
the faults that occurred (:func:`forecast_for`), so the model can be checked against the run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import statistics
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from trainguard.checks.equivalence import compare_trajectories
from trainguard.config import DrillSpec
from trainguard.config.fault_params import FaultParams
from trainguard.config.faults import fault_class
from trainguard.drills.evidence import (
    ForecastInputs,
    ReferenceNotUsable,
    RestartCosts,
    SoakEvidence,
    SoakFaultOutcome,
    SoakForecast,
    SoakMeasured,
    SoakReport,
    SoakRuns,
    StepsLost,
)
from trainguard.drills.judges import diff_problem, recover_causes
from trainguard.drills.steps import attempts_accounting, judged_steps
from trainguard.evidence import UNSET, Unset
from trainguard.faults.base import Fault, FaultContext, FaultUnavailable
from trainguard.faults.soak import SoakEvent, SoakFault, soak_seeds
from trainguard.launch import Launcher, MetricPoint, RunResult
from trainguard.launch.metrics import aligned_trajectories, first_step
from trainguard.launch.rundir import new_run_dir
from trainguard.report import CheckId, CheckResult, CheckStatus, SkipReason
from trainguard.run.runner import JobRunner, LaunchOptions, SupervisedRun
from trainguard.unit.checkpoints import compare_checkpoint_dirs
from trainguard.unit.checkpoints.files import is_temp_name, step_in_name

__all__ = ["FaultRecord", "SoakDriver", "forecast_for", "restart_by_kind", "run_soak", "soak_lines"]

_BACKOFF_S = 0.5
_DEADLINE_MARGIN_S = 5.0


@dataclass
class FaultRecord:
    """What happened to one scheduled fault."""

    event: SoakEvent
    fault: Fault
    attempt: int | None = None
    injected_mono: float | None = None
    injected_step: int | None = None
    first_new_mono: float | None = None
    first_new_step: int | None = None
    error: str | None = None

    @property
    def restart_s(self) -> float | None:
        if self.injected_mono is None or self.first_new_mono is None:
            return None
        return self.first_new_mono - self.injected_mono


class SoakDriver:
    """Injects the schedule's faults in order from the launcher's monitor thread: fault i when
    the watched rank prints step >= its trigger, once the previous fault's attempt is over (or
    ``min_gap`` steps on, should that attempt survive it)."""

    def __init__(self, records: list[FaultRecord], metric: str, watch_rank: int, min_gap: int) -> None:
        self.records = records
        self.metric = metric
        self.watch_rank = watch_rank
        self.min_gap = min_gap
        self.next = 0
        self._lock = threading.Lock()

    def on_metric(self, point: MetricPoint, launcher: Launcher) -> None:
        if point.name != self.metric:
            return
        attempt = launcher.spec.restart_count
        now = time.monotonic()
        with self._lock:
            # the first step of a later attempt, on the rank whose step the fault was timed by:
            # ranks that never wait for each other drift apart (4 steps under load), and the
            # first line of any rank named a laggard's older checkpoint as where the job resumed
            for rec in self.records[:self.next]:
                if (rec.first_new_mono is None and rec.attempt is not None and attempt > rec.attempt
                        and point.rank == self.watch_rank):
                    rec.first_new_mono, rec.first_new_step = now, point.step
            if self.next >= len(self.records) or point.rank != self.watch_rank:
                return
            rec = self.records[self.next]
            if point.step < rec.event.step:
                return
            prev = self.records[self.next - 1] if self.next else None
            if (prev is not None and prev.attempt == attempt and prev.injected_step is not None
                    and point.step < prev.injected_step + self.min_gap):
                return  # lines of the attempt the previous fault is ending
            self.next += 1
            rec.attempt, rec.injected_mono, rec.injected_step = attempt, now, point.step
            rec.fault.injected_at = launcher.elapsed()
        try:
            rec.fault.inject(launcher)
        except Exception as exc:  # the monitor goes on; the verdict reports it
            rec.error = f"inject() raised {type(exc).__name__}: {exc}"

    def finish(self) -> None:
        for rec in self.records:
            with contextlib.suppress(Exception):
                rec.fault.clear()


def _step_times(result: RunResult, metric: str, rank: int) -> dict[int, float]:
    """Seconds each step of ``rank`` took (from the previous step's line), first step left out."""
    points = sorted((p for p in result.points if p.name == metric and p.rank == rank), key=lambda p: p.step)
    return {b.step: b.t - a.t for a, b in itertools.pairwise(points) if b.step == a.step + 1}


def _checkpoint_steps(reference: RunResult) -> list[int]:
    """Steps the job checkpointed: the step numbers in the names under the uninterrupted run's
    checkpoint directory. Empty when the names carry none (nanoGPT's one `ckpt.pt`): the steps
    restarts resumed after are multiples of the cadence, not the cadence, so they are not used."""
    directory = Path(str(reference.evidence.get("checkpoint_dir", "")))
    found: set[int] = set()
    with contextlib.suppress(OSError):
        for entry in directory.iterdir() if directory.is_dir() else ():
            step = step_in_name(entry.name)
            if step is not None and not is_temp_name(entry.name):
                found.add(step)
    return sorted(found)


def _cadence(steps: list[int]) -> int | None:
    gaps = [b - a for a, b in itertools.pairwise(steps) if b > a]
    return int(statistics.median(gaps)) if gaps else None


def _save_s(times: dict[int, float], ckpt_steps: list[int]) -> float | None:
    """The save time: median step time at a checkpoint step (the step itself or the next one,
    whichever holds the save) less the median of the others."""
    at = [max(times.get(s, 0.0), times.get(s + 1, 0.0)) for s in ckpt_steps if s in times or s + 1 in times]
    near = {s for c in ckpt_steps for s in (c, c + 1)}
    rest = [d for s, d in times.items() if s not in near]
    if not at or not rest:
        return None
    return max(0.0, statistics.median(at) - statistics.median(rest))


def forecast_for(work_s: float, restarts_s: Sequence[float], interval_s: float) -> dict[str, float]:
    """The goodput model's wall-clock and goodput for the faults that occurred, fault i costing
    ``restarts_s[i]`` (fault -> first step of the next attempt) and on average half a checkpoint
    interval of lost work; the failure-free ``work_s`` already holds the job's own saves
    (docs/profiling.md, "Goodput forecast")."""
    wall = work_s + sum(restarts_s) + len(restarts_s) * interval_s / 2
    return {"wall_s": round(wall, 3), "goodput": round(work_s / wall, 4) if wall > 0 else 0.0}


def restart_by_kind(records: Sequence[FaultRecord]) -> dict[str, float]:
    """The mean restart cost of each fault kind among ``records`` (those that restarted)."""
    costs: dict[str, list[float]] = {}
    for rec in records:
        if rec.restart_s is not None:
            costs.setdefault(rec.event.kind, []).append(rec.restart_s)
    return {kind: statistics.mean(values) for kind, values in sorted(costs.items())}


def _measurements(run: SupervisedRun, records: list[FaultRecord], reference: RunResult,
                  metric: str, watch_rank: int, wall_s: float) -> SoakMeasured:
    times = _step_times(reference, metric, watch_rank)
    step_s = statistics.median(times.values()) if times else None
    ckpt_steps = _checkpoint_steps(reference)
    every = _cadence(ckpt_steps)
    restarts = [r for rec in records if (r := rec.restart_s) is not None]
    lost = [rec_lost for rec in records if (rec_lost := _lost(run, rec, metric)) is not None]
    work, startup = _failure_free_s(reference, run.attempts[0], metric)
    out = SoakMeasured(
        wall_s=round(wall_s, 3), failure_free_wall_s=round(work, 3), failure_free_basis=startup,
        goodput=round(work / wall_s, 4) if wall_s > 0 else None,
        faults=sum(_struck(rec) for rec in records),
        restart_s=RestartCosts(median=round(statistics.median(restarts), 3), mean=round(statistics.mean(restarts), 3),
                               max=round(max(restarts), 3)) if restarts else None,
        lost_steps=StepsLost(total=sum(lost), mean=round(statistics.mean(lost), 2)) if lost else None,
        step_s=round(step_s, 5) if step_s is not None else None,
        checkpoint_every_steps=every,
        checkpoint_save_s=_round(_save_s(times, ckpt_steps)),
    )
    by_kind = restart_by_kind(records)
    if by_kind and step_s is not None and (every is not None or lost):
        struck = [rec.event.kind for rec in records if _struck(rec) and rec.event.kind in by_kind]
        # the model's lost work: half a checkpoint interval; the mean measured when the cadence
        # is not in the checkpoint names
        interval = every * step_s if every is not None else 2 * statistics.mean(lost) * step_s
        predicted = forecast_for(work, [by_kind[k] for k in struck], interval)
        out.forecast = SoakForecast(
            wall_s=predicted["wall_s"], goodput=predicted["goodput"],
            inputs=ForecastInputs(restart_s_by_kind={k: round(v, 3) for k, v in by_kind.items()},
                                  interval_s=round(interval, 4), faults=len(struck),
                                  lost_per_fault="half an interval" if every is not None
                                  else "the mean measured (no step in the checkpoint names)"),
            wall_error=round(predicted["wall_s"] / wall_s - 1, 4) if wall_s > 0 else None,
        )
    return out


def soak_lines(seed: int, m: SoakMeasured) -> str:
    """What the soak of ``seed`` measured, in a few lines (``trainguard soak`` prints them)."""
    restart, lost = m.restart_s, m.lost_steps
    save = f"~{m.checkpoint_save_s} s" if m.checkpoint_save_s is not None else "not measured"
    lines = [f"seed {seed}: {m.faults} fault(s); restart (fault -> first step) median "
             f"{restart.median if restart else '-'} s, max {restart.max if restart else '-'} s; steps lost "
             f"{lost.total if lost else 0}; checkpoint every {m.checkpoint_every_steps or '? (no step in the names)'} "
             f"steps, save {save}",
             f"wall-clock {m.wall_s:.1f} s vs {m.failure_free_wall_s:.1f} s failure-free: goodput {m.goodput}"]
    forecast = m.forecast
    if isinstance(forecast, SoakForecast):
        lines.append(f"the goodput model for these {forecast.inputs.faults} fault(s) at this soak's "
                     f"restart cost per kind: wall-clock {forecast.wall_s:.1f} s, goodput "
                     f"{forecast.goodput} (wall-clock {forecast.wall_error:+.1%} off)")
    return "\n".join(lines)


def _failure_free_s(reference: RunResult, first: RunResult, metric: str) -> tuple[float, str]:
    """The failure-free wall-clock of the soak: the uninterrupted run's, with its start-up (launch
    -> first step) replaced by the soak's own first start-up. The reference ran first, often on a
    cold file cache (a first `import transformers` took 10 s where the soak's later starts took 4),
    and every restart of the soak pays the warm start-up its first attempt paid."""
    def first_step(result: RunResult) -> float | None:
        return min((p.t for p in result.points if p.name == metric), default=None)

    ref, soak = first_step(reference), first_step(first)
    if ref is None or soak is None:
        return reference.duration_s, "the uninterrupted run's wall-clock"
    return (reference.duration_s - ref + soak,
            f"the uninterrupted run's {reference.duration_s:.1f} s with the soak's own start-up "
            f"({soak:.1f} s to the first step, {ref:.1f} s in the uninterrupted run)")


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 4)


def _struck(rec: FaultRecord) -> bool:
    """The fault was injected (not only scheduled, and its injection did not fail)."""
    return rec.injected_mono is not None and rec.error is None


def _lost(run: SupervisedRun, rec: FaultRecord, metric: str) -> int | None:
    """Steps of progress the fault cost: the last step its attempt printed minus the step the
    next attempt resumed after."""
    if rec.attempt is None or rec.first_new_step is None or rec.attempt >= len(run.attempts):
        return None
    done = max((p.step for p in run.attempts[rec.attempt].points if p.name == metric), default=0)
    return max(0, done - (rec.first_new_step - 1))


def _record_evidence(run: SupervisedRun, rec: FaultRecord, metric: str) -> SoakFaultOutcome:
    event = rec.event
    entry = SoakFaultOutcome(event.index, event.kind, event.rank, event.step, attempt=rec.attempt,
                             injected_after_step=rec.injected_step)
    if rec.attempt is not None and rec.attempt < len(run.attempts):
        ended = run.attempts[rec.attempt]
        entry.attempt_ended = ended.outcome if ended.ok else rec.fault.classify(ended)
    if rec.first_new_step is not None:
        entry.resumed_from_step = max(rec.first_new_step - 1, 0)
        entry.lost_steps = _lost(run, rec, metric)
    if rec.restart_s is not None:
        entry.fault_to_first_step_after_restart_s = round(rec.restart_s, 3)
    if rec.error:
        entry.error = rec.error
    return entry


def _judge(spec: DrillSpec, run: SupervisedRun, records: list[FaultRecord], reference: RunResult,
           metric: str, checkpoint_dir: Path) -> tuple[CheckStatus, list[str], SoakEvidence]:
    start = first_step(reference.points, metric)  # 1, or 0 for a job counting from 0
    missed = [rec.event for rec in records if rec.injected_mono is None]
    failed_inject = [rec for rec in records if rec.error]
    actual, expected = aligned_trajectories(run.points, reference.points, metric)
    steps, unprinted = judged_steps(run.attempts, metric, spec.steps)
    diff = compare_trajectories(actual, expected, metric=metric, steps=steps, rtol=spec.rtol, atol=spec.atol)
    evidence = SoakEvidence(restarts=run.restarts, trajectory=diff.as_evidence())
    if unprinted:  # checkpointed, then the rank died before printing the step: not missing
        evidence.trajectory.unprinted_resumed_steps = unprinted
    problems: list[str] = []
    if not run.ok:
        final = run.final
        problems.append(f"did not recover: after {run.restarts} restart(s) (max_restarts "
                        f"{_limit(spec, records)}) the last attempt ended {final.outcome}: "
                        f"{final.reason or 'no reason recorded'}")
    for rec in records:
        lost = _lost(run, rec, metric)
        if (rec.first_new_step is not None and rec.injected_step is not None
                and rec.first_new_step <= start < rec.injected_step):
            problems.append(f"after fault {rec.event.index} ({rec.event.kind} on rank {rec.event.rank} "
                            f"after step {rec.injected_step}) the job began again at step {start}: no "
                            "usable checkpoint, all progress lost")
        elif spec.max_lost_steps is not None and lost is not None and lost > spec.max_lost_steps:
            problems.append(f"fault {rec.event.index} ({rec.event.kind}) lost {lost} steps "
                            f"(max_lost_steps {spec.max_lost_steps})")
    if run.ok:
        problem = diff_problem(metric, diff, "soaked run")
        if problem:
            problems.append(problem)
        state = compare_checkpoint_dirs(checkpoint_dir, reference.checkpoints,
                                        rtol=spec.rtol, atol=spec.atol)
        evidence.checkpoint = state.as_evidence()
        if state.differing:
            problems.append(f"the final checkpoint differs from the uninterrupted run's in {state.summary()}")
        elif uncompared := state.uncompared_problem(f"the drill `{spec.name}` in checks.drills", spec.allow_uncompared):
            problems.append(uncompared)
    accounting = attempts_accounting(reference, run.attempts, metric, spec.steps)
    if accounting is not None and accounting.known:
        evidence.sample_accounting = accounting.as_evidence()
        if not accounting.ok:
            problems.append(accounting.summary())
    if problems:
        resumed_from = [0 if rec.first_new_step <= start else rec.first_new_step - 1
                        for rec in records if rec.first_new_step is not None]
        evidence.likely_causes = recover_causes(resumed_from, diff, accounting)
        return "failed", problems, evidence
    if failed_inject or missed:
        words = [f"fault {r.event.index} ({r.event.kind}) could not be injected: {r.error}" for r in failed_inject]
        if missed:
            words.append(f"{len(missed)} scheduled fault(s) never struck (first: {missed[0].kind} at step "
                         f"{missed[0].step}): the job finished before trainguard read the trigger step "
                         "(output is read with a lag on a loaded machine); raise `steps` or `min_gap`")
        return "error", words, evidence
    return "passed", [], evidence


def _limit(spec: DrillSpec, records: list[FaultRecord]) -> int:
    return spec.max_restarts if spec.max_restarts is not None else len(records) + 2


def run_soak(runner: JobRunner, spec: DrillSpec) -> CheckResult:
    """Run one soak drill and judge it; the result is named ``drill:<name>``. With several
    ``seeds`` (and no ``soak_seed`` setting) it runs once per seed and passes when every run
    did; the evidence keeps each run's under ``runs``."""
    seeds = soak_seeds(spec.fault_params, runner.settings.soak_seed)
    if len(seeds) == 1:
        return _run_one(runner, spec, seeds[0])
    started = time.monotonic()
    results = [_run_one(runner, spec, seed) for seed in seeds]
    worst = next((r for status in ("failed", "error", "skipped") for r in results if r.status == status), None)
    status = worst.status if worst is not None else "passed"
    summary = "; ".join(f"[{r.evidence.seed}] {r.status}: {r.summary}" for r in results)
    return CheckResult(str(CheckId.of_drill(spec.name)), status, summary,
                       SoakRuns("soak", seeds, [r.evidence for r in results]),
                       time.monotonic() - started, f"trainguard soak {runner.job_file.path} --only {spec.name}")


def _run_one(runner: JobRunner, spec: DrillSpec, seed: int) -> CheckResult[SoakReport]:
    started = time.monotonic()
    job_file = runner.job_file
    name = str(CheckId.of_drill(spec.name))
    world_size = spec.world_size or job_file.job.world_size
    events = SoakFault.schedule_of(spec.fault_params, spec.steps, world_size, seed)
    reproduce = (f"trainguard soak {job_file.path} --only {spec.name} --seed {seed}  "
                 f"(pytest: --trainguard-soak-seed {seed})")
    base = SoakReport("soak", "recover", seed, spec.steps, list(events))

    def result(status: CheckStatus, summary: str, found: SoakEvidence | ReferenceNotUsable | Unset = UNSET,
               skip_reason: SkipReason | None = None) -> CheckResult[SoakReport]:
        return CheckResult(name, status, summary, dataclasses.replace(base, found=found),
                           time.monotonic() - started, reproduce, skip_reason)

    unavailable = SoakFault.unavailable_for(runner.backend)
    if unavailable is not None:
        return result("skipped", unavailable, UNSET, SkipReason.JOB_KIND)
    if not events:
        return result("error", f"the schedule of seed {seed} holds no fault in {spec.steps} steps; raise "
                      "`steps` or lower `every_steps`")
    metric = job_file.job.progress_metric
    request = runner.request_for(spec, world_size=world_size)
    reference = runner.scheduling.reference(request)
    if not reference.ok:
        return result("error", f"the uninterrupted reference run failed, so there is nothing to soak: "
                      f"{reference.reason}", ReferenceNotUsable(str(reference.run_dir)))
    reporting = sorted({p.rank for p in reference.points if p.name == metric})
    if not reporting:
        return result("error", f"the reference run printed no `{metric}` line; check job.metrics.{metric}",
                      ReferenceNotUsable(str(reference.run_dir)))
    own = dict(spec.params.get("fault_params") or {})
    records = [FaultRecord(e, fault_class(e.kind)(FaultParams(own.get(e.kind)), rank=e.rank, after_step=e.step))
               for e in events]
    drill_dir = new_run_dir(job_file.state_dir, job_file.job.name, f"soak-{spec.name}",
                            keep=runner.settings.keep_runs)
    values = runner.placeholders(request, drill_dir, drill_dir / "checkpoints")
    ctx = FaultContext(work_dir=drill_dir / "fault", checkpoint_dir=drill_dir / "checkpoints",
                       world_size=world_size,
                       env={**{k: v.format_map(values) for k, v in job_file.job.env.items()},
                            **{k: v.format_map(values) for k, v in request.env}})
    ctx.work_dir.mkdir(parents=True, exist_ok=True)
    ctx.checkpoint_dir.mkdir(parents=True, exist_ok=True)
    driver = SoakDriver(records, metric, reporting[0], int(spec.params.get("min_gap", 3)))
    stall = spec.stall_timeout or job_file.job.stall_timeout
    grace = max((float(r.fault.params.number("grace")) for r in records if r.event.kind == "preempt"), default=0.0)
    env: dict[str, str] = {}
    try:
        for rec in records:
            try:
                rec.fault.setup(ctx)
            except FaultUnavailable as exc:
                return result("skipped", f"{rec.event.kind} cannot be injected on this machine: {exc}", UNSET,
                              exc.needs)
            env.update(rec.fault.launch_env(ctx))
        soak_started = time.monotonic()
        run = runner.supervise(
            request, label=f"soak-{spec.name}", options=LaunchOptions(
                max_restarts=_limit(spec, records), backoff_s=_BACKOFF_S, extra_env=env,
                # a job that saved and exited 0 on a pre-emption notice is restarted like a failed one
                restart_if=lambda r: r.ok and (r.last_step or 0) < spec.steps,
                stall_timeout=max(stall, grace + _DEADLINE_MARGIN_S) if grace else stall,
                startup_timeout=max(stall, job_file.job.stall_timeout)),
            on_metric=driver.on_metric, checkpoint_dir=ctx.checkpoint_dir,
        )
        wall = time.monotonic() - soak_started
        driver.finish()
        status, problems, found = _judge(spec, run, records, reference, metric, ctx.checkpoint_dir)
        found.faults = [_record_evidence(run, rec, metric) for rec in records]
        measured = found.measured = _measurements(run, records, reference, metric, reporting[0], wall)
        found.drill_dir, found.run_dir = str(drill_dir), str(run.run_dir)  # the attempts' logs
        found.reference_run_dir = str(reference.run_dir)
        evidence = found
        struck = sum(_struck(rec) for rec in records)
        kinds = ", ".join(sorted({e.kind for e in events}))
        what = f"seed {seed}: {struck} of {len(events)} faults ({kinds}) in {spec.steps} steps"
        if status == "failed":
            return result(status, f"{what}; " + "; ".join(problems), evidence)
        if status == "error":
            return result(status, f"{what}; " + "; ".join(problems), evidence)
        return result("passed", f"{what}; recovered every time with {run.restarts} restart(s), "
                      f"{measured.lost_steps.total if measured.lost_steps else 0} step(s) lost, goodput "
                      f"{measured.goodput:.2f}; all {found.trajectory.compared_steps} "
                      "steps match the uninterrupted run", evidence)
    finally:  # Ctrl-C included: nothing is left stopped or running
        driver.finish()
        for rec in records:
            with contextlib.suppress(Exception):
                rec.fault.teardown()
