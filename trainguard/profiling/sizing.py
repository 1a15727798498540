"""The resource-sizing report: how many GPUs the full run should get, how long it takes, what it
costs, how often to checkpoint and what limits scaling.

Inputs are a measured profile (per world size: throughput, step time, startup, memory,
checkpoint cost; plus the fitted scaling model) and the job file's ``target:`` section. Sizes
that were not measured are predicted by the fitted model and marked ``extrapolated``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import MISSING, asdict, dataclass, field, fields
from typing import Any

from trainguard.config import Target
from trainguard.profiling.stats import ScalingFit

__all__ = ["Candidate", "SizeInputs", "Sizing", "checkpoint_interval_s", "predict_duration_s", "size_run"]


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


@dataclass
class Candidate:
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


@dataclass
class Sizing:
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
    batch_headroom: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        """The JSON form (the profile check's ``evidence["sizing"]``, the gate report's ``sizing``)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Sizing:
        """The sizing :meth:`to_dict` wrote (read back from a report); ValueError naming what
        is missing when ``data`` is not one."""
        candidates = [_from_dict(Candidate, c, f"sizing.candidates[{i}]")
                      for i, c in enumerate(data.get("candidates") or [])]
        return _from_dict(cls, {**data, "candidates": candidates}, "sizing")

    def candidate(self, gpus: int) -> Candidate | None:
        return next((c for c in self.candidates if c.gpus == gpus), None)


def _from_dict(cls: Any, data: Any, where: str) -> Any:
    if not isinstance(data, Mapping):
        raise ValueError(f"{where} is {type(data).__name__}, not an object")
    known = {f.name: f for f in fields(cls)}
    required = [n for n, f in known.items() if f.default is MISSING and f.default_factory is MISSING]
    missing = [n for n in required if n not in data]
    if missing:
        raise ValueError(f"{where} lacks {', '.join(missing)}")
    return cls(**{k: v for k, v in data.items() if k in known})


def _nearest(measured: Mapping[int, SizeInputs], n: int) -> SizeInputs:
    return measured[min(measured, key=lambda m: (abs(m - n), -m))]


def size_run(
    target: Target,
    measured: Mapping[int, SizeInputs],
    fit: ScalingFit | None,
    *,
    samples_per_step: Callable[[int], int],
    device: str,
    memory_budget_mb: Callable[[int], tuple[float | None, str]],
    extra_limits: list[str] | None = None,
    unit: str = "GPU(s)",
) -> Sizing:
    """Predict the full run at 1..``target.max_gpus`` ranks and recommend the cheapest size that
    meets the deadline with scaling efficiency >= ``target.min_efficiency`` and fits in memory.

    Efficiency is relative to the smallest measured size. Unmeasured sizes use ``fit`` (marked
    extrapolated); without a fit only measured sizes are candidates."""
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
        cost_s = near.checkpoint_cost_s
        every_s: float | None = None
        every_steps: int | None = None
        rule = "no checkpoint cost measured: no interval computed"
        rework_s = near.startup_s  # a restart repeats the start-up at least
        if cost_s is not None:
            every_s, rule = checkpoint_interval_s(cost_s, mtbf_h * 3600, target.max_lost_minutes * 60)
            every_steps = max(1, int(every_s // step_time))
            rework_s += min(every_s, seconds) / 2
        failures = seconds / (mtbf_h * 3600)
        with_failures = seconds + failures * rework_s
        hours = with_failures / 3600
        budget, _ = memory_budget_mb(n)
        headroom = None
        if budget is not None and near.peak_mem_mb is not None:
            headroom = budget - near.peak_mem_mb
        why_not = []
        if efficiency < target.min_efficiency:
            why_not.append(f"efficiency {efficiency:.0%} < minimum {target.min_efficiency:.0%}")
        if target.deadline_hours is not None and hours > target.deadline_hours:
            why_not.append(f"{hours:.2f} h > deadline {target.deadline_hours:g} h")
        if headroom is not None and headroom < 0:
            why_not.append(f"needs {-headroom:.0f} MB more memory per rank than the budget")
        candidates.append(
            Candidate(
                gpus=n, extrapolated=extrapolated, throughput_sps=thr, efficiency=efficiency,
                steps=steps, step_time_s=step_time, hours=seconds / 3600, mtbf_hours=mtbf_h,
                checkpoint_every_s=every_s, checkpoint_every_steps=every_steps,
                checkpoint_rule=rule, expected_failures=failures, hours_with_failures=hours,
                gpu_hours=hours * n, cost=hours * n * target.price_per_gpu_hour,
                memory_headroom_mb=headroom, feasible=not why_not, why_not=why_not,
            )
        )
    recommended, text = _recommend(target, candidates, unit)
    budget_1, source = memory_budget_mb(base)
    return Sizing(
        target=target.model_dump(),
        candidates=candidates,
        recommended=recommended,
        recommendation=text,
        limits=_limits(fit, measured, candidates, target, unit) + list(extra_limits or []),
        device=device,
        memory_budget_mb=budget_1,
        memory_budget_source=source,
    )


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
            f"{target.price_per_gpu_hour:g}/GPU-hour, {best.efficiency:.0%} efficient -- the "
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
