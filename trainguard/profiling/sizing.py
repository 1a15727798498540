"""The resource-sizing report: how many GPUs the full run should get, how long it takes, what it
costs, how often to checkpoint and what limits scaling.

Inputs are a measured profile (per world size: throughput, step time, startup, memory,
checkpoint cost; plus the fitted scaling model) and the job file's ``target:`` section. Sizes
that were not measured are predicted by the fitted model and marked ``extrapolated``.

Failures follow the goodput model of :mod:`trainguard.profiling.goodput`: each size's wall-clock
with failures, goodput, GPU-hours wasted and the checkpoint interval that maximises goodput.
:func:`apply_failure_inputs` recomputes them with what the drills of a session measured.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from trainguard.config import Target
from trainguard.evidence import Evidence
from trainguard.profiling.goodput import (
    FailureInputs,
    goodput,
    interval_curve,
    measured_recovery,
    optimal_interval_s,
    wall_clock_s,
)
from trainguard.profiling.stats import ScalingFit
from trainguard.profiling.timeouts import (
    RecommendedTimeout,
    recommend_restart_policy,
    recommend_timeouts,
)
from trainguard.report import CheckResult

__all__ = [
    "BatchHeadroom",
    "Candidate",
    "GoodputCurve",
    "SizeInputs",
    "Sizing",
    "apply_failure_inputs",
    "apply_measured_recovery",
    "checkpoint_interval_s",
    "default_failure_inputs",
    "predict_duration_s",
    "size_run",
]


def checkpoint_interval_s(cost_s: float, mtbf_s: float, max_lost_s: float) -> tuple[float, str]:
    """Young/Daly's optimal checkpoint interval sqrt(2 C M), capped at ``max_lost_s`` so a failure
    right before a checkpoint loses at most that much work. Returns (interval, which rule won)."""
    if cost_s <= 0:
        return max_lost_s, "checkpoints cost nothing measurable: interval = the lost-work cap"
    daly = math.sqrt(2.0 * cost_s * mtbf_s)
    if daly > max_lost_s:
        return max_lost_s, f"Young/Daly gives {daly / 60:.1f} min; capped at the lost-work limit"
    return daly, "Young/Daly sqrt(2 x checkpoint cost x MTBF)"


def predict_duration_s(
    startup_s: float,
    mean_step_s: float,
    steps: int,
    tail_s: float = 0.0,
    *,
    warmup_s: float = 0.0,
    warmup_steps: int = 0,
) -> float:
    """Wall-clock of a run of ``steps`` steps: start-up to the first step line, the warm-up steps
    as measured (``warmup_s`` from the first step line to the last warm-up one), the remaining
    steps at the measured mean (checkpoint and eval steps included at the job's own cadence),
    the exit."""
    counted = max(warmup_steps, 1)  # the first step's duration is part of the start-up
    return startup_s + warmup_s + max(0, steps - counted) * mean_step_s + tail_s


@dataclass(frozen=True)
class SizeInputs:
    """What the sizing needs from one measured world size."""

    world_size: int
    throughput_sps: float
    samples_per_step: int
    startup_s: float
    tail_s: float
    checkpoint_cost_s: float | None
    peak_mem_mb: float | None  # the largest rank's peak (GPU memory on GPU, else RSS)
    warmup_s: float = 0.0  # first step line -> the last warm-up step's line
    warmup_steps: int = 0
    step_p99_s: float | None = None
    step_max_s: float | None = None
    #: the job's own checkpoint cadence in the profile runs (steps between saves)
    checkpoint_every_steps: int | None = None


@dataclass
class Candidate(Evidence):
    """The predicted full run at one world size."""

    gpus: int
    extrapolated: bool
    throughput_sps: float
    efficiency: float
    steps: int
    step_time_s: float
    hours: float  # no failures
    mtbf_hours: float
    checkpoint_every_s: float | None
    checkpoint_every_steps: int | None
    checkpoint_rule: str
    expected_failures: float
    hours_with_failures: float
    gpu_hours: float
    cost: float
    memory_headroom_mb: float | None
    feasible: bool
    why_not: list[str] = field(default_factory=list)
    #: the goodput forecast (effective training time ratio, 0..1) at ``checkpoint_every_s``
    goodput: float | None = None
    #: GPU-hours that made no new progress: gpus x (wall-clock with failures - without)
    wasted_gpu_hours: float | None = None
    #: what the nearest measured size measured: checkpoint save, step tail, start-up
    checkpoint_cost_s: float | None = None
    young_daly_s: float | None = None
    step_p99_s: float | None = None
    step_max_s: float | None = None
    startup_s: float | None = None
    #: the job's own checkpoint cadence as profiled, and the goodput it would give at this size
    job_checkpoint_every_steps: int | None = None
    goodput_at_job_cadence: float | None = None


@dataclass
class GoodputCurve(Evidence):
    """Goodput against the checkpoint interval at one size (the profile report's plot)."""

    gpus: int
    #: the interval chosen, and the lost-work cap (target.max_lost_minutes)
    chosen_s: float
    cap_s: float
    #: [interval_s, goodput] on a log grid
    points: list[list[float]]


@dataclass
class BatchHeadroom(Evidence):
    """Memory headroom per rank at the profile's batch, from the headroom search
    (:class:`~trainguard.profiling.headroom.Headroom`)."""

    summary: str
    budget_mb: float
    profile_batch: int | None
    #: the budget less the peak at the profile's batch
    headroom_mb: float | None
    peak_mb: float | None
    #: "measured" (a probe at that batch) or "fitted"
    peak_source: str | None
    largest_pass: int | None
    safe_batch: int | None
    world_size: int


@dataclass
class Sizing(Evidence):
    """The whole sizing report."""

    target: dict[str, Any]
    candidates: list[Candidate]
    recommended: int | None
    recommendation: str
    limits: list[str]
    device: str
    memory_budget_mb: float | None
    memory_budget_source: str
    #: memory headroom per rank at the profile's batch from the headroom search (its budget,
    #: peak, headroom, largest and safe batch); None when no search ran
    batch_headroom: BatchHeadroom | None = None
    #: what one failure costs and where each figure came from
    failure_inputs: FailureInputs | None = None
    #: goodput vs checkpoint interval at the recommended (else smallest) size
    goodput_curve: GoodputCurve | None = None
    #: the timeouts the job should use at that size (:func:`recommend_timeouts`)
    timeouts: list[RecommendedTimeout] = field(default_factory=list)

    def candidate(self, gpus: int) -> Candidate | None:
        return next((c for c in self.candidates if c.gpus == gpus), None)


def _nearest(measured: Mapping[int, SizeInputs], n: int) -> SizeInputs:
    return measured[min(measured, key=lambda m: (abs(m - n), -m))]


# documented keyword-only sizing API: its options are its parameters (pyproject.toml, PLR0913)
def size_run(  # noqa: PLR0913
    target: Target,
    measured: Mapping[int, SizeInputs],
    fit: ScalingFit | None,
    *,
    samples_per_step: Callable[[int], int],
    device: str,
    memory_budget_mb: Callable[[int], tuple[float | None, str]],
    extra_limits: list[str] | None = None,
    unit: str = "GPU(s)",
    failure_inputs: FailureInputs | None = None,
) -> Sizing:
    """Predict the full run at 1..``target.max_gpus`` ranks and recommend the cheapest size that
    meets the deadline with scaling efficiency >= ``target.min_efficiency`` and fits in memory.

    Efficiency is relative to the smallest measured size. Unmeasured sizes use ``fit`` (marked
    extrapolated); without a fit only measured sizes are candidates. Failures cost what
    ``failure_inputs`` says (default: the target's, :func:`default_failure_inputs`)."""
    if not measured:
        raise ValueError("no measured world size to size from")
    base = min(measured)
    base_thr = measured[base].throughput_sps
    candidates: list[Candidate] = []
    for n in range(1, target.max_gpus + 1):
        if n in measured:
            thr, extrapolated = measured[n].throughput_sps, False
        elif fit is not None and fit.model is not None:
            predicted = fit.throughput(n)
            if predicted is None or predicted <= 0:
                continue
            thr, extrapolated = predicted, True
        else:
            continue
        near = _nearest(measured, n)
        sps = samples_per_step(n)
        steps = _target_steps(target, sps)
        step_time = sps / thr
        efficiency = (thr / base_thr) / (n / base)
        seconds = predict_duration_s(
            near.startup_s, step_time, steps, near.tail_s, warmup_s=near.warmup_s,
            warmup_steps=near.warmup_steps,
        )
        mtbf_h = target.mtbf_hours_by_gpus.get(n, target.mtbf_hours / n)
        budget, _ = memory_budget_mb(n)
        headroom = None
        if budget is not None and near.peak_mem_mb is not None:
            headroom = budget - near.peak_mem_mb
        candidates.append(
            Candidate(
                gpus=n, extrapolated=extrapolated, throughput_sps=thr, efficiency=efficiency,
                steps=steps, step_time_s=step_time, hours=seconds / 3600, mtbf_hours=mtbf_h,
                checkpoint_every_s=None, checkpoint_every_steps=None, checkpoint_rule="",
                expected_failures=0.0, hours_with_failures=seconds / 3600, gpu_hours=0.0, cost=0.0,
                memory_headroom_mb=headroom, feasible=False, checkpoint_cost_s=near.checkpoint_cost_s,
                step_p99_s=near.step_p99_s, step_max_s=near.step_max_s, startup_s=near.startup_s,
                job_checkpoint_every_steps=near.checkpoint_every_steps,
            )
        )
    budget_1, source = memory_budget_mb(base)
    sizing = Sizing(
        target=target.model_dump(),
        candidates=candidates,
        recommended=None,
        recommendation="",
        limits=_limits(fit, measured, candidates, target, unit) + list(extra_limits or []),
        device=device,
        memory_budget_mb=budget_1,
        memory_budget_source=source,
    )
    return apply_failure_inputs(sizing, failure_inputs or default_failure_inputs(target), unit=unit)


def default_failure_inputs(target: Target) -> FailureInputs:
    """What a failure costs before any drill measured it: ``target.restart_minutes`` and
    ``target.checkpoint_load_seconds`` (default: as long as the save)."""
    load = target.checkpoint_load_seconds
    return FailureInputs(
        restart_s=target.restart_minutes * 60,
        restart_source=f"default: target.restart_minutes = {target.restart_minutes:g}",
        load_s=load,
        load_source=(f"default: target.checkpoint_load_seconds = {load:g}" if load is not None
                     else "default: as long as the measured checkpoint save"),
    )


def _forecast(c: Candidate, inputs: FailureInputs, target: Target) -> None:
    """Fill ``c``'s failure figures from the goodput model."""
    mtbf_s = c.mtbf_hours * 3600
    work_s = c.hours * 3600
    save = c.checkpoint_cost_s or 0.0
    fixed = inputs.fixed_s(c.checkpoint_cost_s)
    choice = optimal_interval_s(save, mtbf_s, fixed, target.max_lost_minutes * 60, floor_s=c.step_time_s)
    wall = wall_clock_s(work_s, choice.interval_s, save, mtbf_s, fixed)
    c.checkpoint_every_s = choice.interval_s
    c.checkpoint_every_steps = max(1, int(choice.interval_s // c.step_time_s)) if c.step_time_s > 0 else None
    c.checkpoint_rule = choice.rule if c.checkpoint_cost_s is not None else (
        "no checkpoint cost measured (0 assumed): interval = the lost-work cap")
    c.young_daly_s = choice.young_daly_s
    c.goodput = goodput(choice.interval_s, save, mtbf_s, fixed) if work_s > 0 else 1.0
    c.goodput_at_job_cadence = None
    # against the chosen interval only when a save costs something measurable: at a cost of 0
    # every cadence is free, and the job's own would beat the lost-work cap chosen for it
    if c.job_checkpoint_every_steps and c.checkpoint_cost_s and c.step_time_s > 0:
        c.goodput_at_job_cadence = goodput(c.job_checkpoint_every_steps * c.step_time_s, save, mtbf_s, fixed)
    c.expected_failures = wall / mtbf_s
    c.hours_with_failures = wall / 3600
    c.gpu_hours = c.hours_with_failures * c.gpus
    c.cost = c.gpu_hours * target.price_per_gpu_hour
    c.wasted_gpu_hours = (wall - work_s) / 3600 * c.gpus
    why_not = []
    if c.efficiency < target.min_efficiency:
        why_not.append(f"efficiency {c.efficiency:.0%} < minimum {target.min_efficiency:.0%}")
    if math.isinf(wall):
        why_not.append(f"a failure costs more than the {c.mtbf_hours:.3g} h between failures: no progress")
    elif target.deadline_hours is not None and c.hours_with_failures > target.deadline_hours:
        why_not.append(f"{c.hours_with_failures:.2f} h > deadline {target.deadline_hours:g} h")
    if c.memory_headroom_mb is not None and c.memory_headroom_mb < 0:
        why_not.append(f"needs {-c.memory_headroom_mb:.0f} MB more memory per rank than the budget")
    c.why_not, c.feasible = why_not, not why_not


def apply_failure_inputs(sizing: Sizing, inputs: FailureInputs, *, unit: str | None = None) -> Sizing:
    """``sizing`` with every candidate's failure figures (wall-clock with failures, goodput,
    GPU-hours wasted, checkpoint interval), the recommendation, the goodput curve and the
    timeouts computed from ``inputs`` (in place; returned)."""
    target = Target.model_validate(sizing.target)
    unit = unit or ("GPU(s)" if sizing.device == "gpu" else "rank(s)")
    for c in sizing.candidates:
        _forecast(c, inputs, target)
    sizing.failure_inputs = inputs
    sizing.recommended, sizing.recommendation = _recommend(target, sizing.candidates, unit)
    shown = sizing.candidate(sizing.recommended) if sizing.recommended else (
        sizing.candidates[0] if sizing.candidates else None)
    sizing.goodput_curve, sizing.timeouts = None, []
    if shown is not None and shown.checkpoint_every_s:
        save, fixed = shown.checkpoint_cost_s or 0.0, inputs.fixed_s(shown.checkpoint_cost_s)
        curve = interval_curve(save, shown.mtbf_hours * 3600, fixed,
                               around_s=(shown.young_daly_s or shown.checkpoint_every_s),
                               floor_s=shown.step_time_s)
        sizing.goodput_curve = GoodputCurve(shown.gpus, shown.checkpoint_every_s, target.max_lost_minutes * 60,
                                            [[round(t, 4), round(g, 6)] for t, g in curve])
    if shown is not None:
        load = 0.0 if inputs.load_in_restart else (
            inputs.load_s if inputs.load_s is not None else shown.checkpoint_cost_s or 0.0)
        sizing.timeouts = recommend_timeouts(
            step_p99_s=shown.step_p99_s, step_max_s=shown.step_max_s, save_s=shown.checkpoint_cost_s,
            load_s=load, startup_s=shown.startup_s, expected_failures=shown.expected_failures,
            gpus=shown.gpus,
        )
        sizing.timeouts += recommend_restart_policy(
            fixed_s=inputs.fixed_s(shown.checkpoint_cost_s), restart_source=inputs.restart_source,
            checkpoint_every_s=shown.checkpoint_every_s or shown.step_time_s, job_mtbf_s=shown.mtbf_hours * 3600,
            expected_failures=shown.expected_failures, wall_s=shown.hours_with_failures * 3600,
            goodput=shown.goodput, gpus=shown.gpus,
        ) if sizing.timeouts else []
    return sizing


def _target_steps(target: Target, samples_per_step: int) -> int:
    if target.steps is not None:
        return target.steps
    samples = target.samples
    if samples is None:
        assert target.tokens is not None and target.tokens_per_sample is not None
        samples = math.ceil(target.tokens / target.tokens_per_sample)
    return max(1, math.ceil(samples / samples_per_step))


def _recommend(target: Target, candidates: list[Candidate], unit: str) -> tuple[int | None, str]:
    feasible = [c for c in candidates if c.feasible]
    if feasible:
        best = min(feasible, key=lambda c: (c.cost, c.hours_with_failures, c.gpus))
        if target.price_per_gpu_hour == 0:
            best = min(feasible, key=lambda c: (c.gpu_hours, c.hours_with_failures, c.gpus))
        how = " (extrapolated by the fitted model)" if best.extrapolated else " (measured)"
        return best.gpus, (
            f"{best.gpus} {unit}{how}: {best.hours_with_failures:.2f} h wall-clock, "
            f"{best.gpu_hours:.2f} {unit.replace('(s)', '')}-hours, cost {best.cost:.2f} at "
            f"{target.price_per_gpu_hour:g}/GPU-hour, {best.efficiency:.0%} efficient, goodput "
            f"{best.goodput or 0:.2%} -- the "
            "cheapest size that meets the deadline with enough efficiency"
        )
    if not candidates:
        return None, "no size could be predicted (a single measured world size and no fit)"
    efficient = [c for c in candidates if c.efficiency >= target.min_efficiency]
    if not efficient:
        return None, (
            f"no size reaches the minimum efficiency of {target.min_efficiency:.0%} "
            "(beyond the base size); lower target.min_efficiency or fix what limits scaling"
        )
    fastest = min(efficient, key=lambda c: c.hours_with_failures)
    reasons = "; ".join(fastest.why_not)
    return None, (
        f"no size meets every constraint: the fastest with efficiency >= "
        f"{target.min_efficiency:.0%} is {fastest.gpus} {unit} ({reasons}); raise max_gpus, "
        "extend the deadline or lower min_efficiency"
    )


def _limits(
    fit: ScalingFit | None,
    measured: Mapping[int, SizeInputs],
    candidates: list[Candidate],
    target: Target,
    unit: str,
) -> list[str]:
    out: list[str] = []
    model = fit.model if fit is not None else None
    if model is not None:
        if model.sigma > 0:
            out.append(
                f"serial/contended share sigma = {model.sigma:.3f} ({model.name}): speed-up can "
                f"never exceed {1 / model.sigma:.1f}x however many ranks are added"
            )
        peak = model.peak()
        if peak is not None:
            out.append(
                f"cross-rank coherency cost kappa = {model.kappa:.4f} (USL): throughput peaks near "
                f"{peak:.1f} x the base size and falls beyond"
            )
    eff_drop = [c for c in candidates if c.efficiency < target.min_efficiency]
    if eff_drop:
        first = min(eff_drop, key=lambda c: c.gpus)
        out.append(
            f"efficiency falls below {target.min_efficiency:.0%} from {first.gpus} {unit} "
            f"({first.efficiency:.0%}{', extrapolated' if first.extrapolated else ''})"
        )
    for n, m in sorted(measured.items()):
        if m.checkpoint_cost_s:
            share = m.checkpoint_cost_s / (m.samples_per_step / m.throughput_sps)
            if share > 0.5:
                out.append(f"one checkpoint costs {share:.1f} steps at {n} rank(s)")
            break
    return out


def apply_measured_recovery(sizing: Sizing, checks: Iterable[CheckResult]) -> Sizing:
    """``sizing`` with its goodput forecast recomputed from what the passed recover drills and
    chaos soaks among ``checks`` measured (restart cost, steps lost;
    :func:`~trainguard.profiling.goodput.measured_recovery`); unchanged when none did."""
    if sizing.failure_inputs is None or not sizing.candidates:
        return sizing
    inputs = sizing.failure_inputs
    measured = measured_recovery(checks, inputs)
    return apply_failure_inputs(sizing, measured) if measured != inputs else sizing
