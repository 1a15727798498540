"""The canary check: the real job on real data learns, within strict limits.

One run of ``steps`` steps, bounded by ``max_seconds`` (the run's timeout) and ``max_memory_mb``
(per rank's process tree, enforced live by the launcher). Its loss must be finite at every step,
fall by ``min_loss_drop`` and never spike. Losses are noisy, so no single step decides anything:

* the drop compares the **median** of an early window of steps with the median of a late window
  (window = max(3, 10% of the steps)): one lucky or unlucky batch moves neither;
* a spike is a value above ``spike_factor`` x the median of the window of steps before it (the
  steps before it, for the first steps), so an explosion at step 2 is caught as well as one late
  in the run.

Every limit that is hit fails the check and says by how much.

With a saved baseline (trainguard.checks.baseline, docs/baselines.md) the run must also stay inside the
band around the baseline's trajectory; ``--save-baseline`` makes a passing run the new baseline.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from trainguard.checks.baseline import NOT_SAVED_FAILED, BaselineEvidence, canary_baseline
from trainguard.checks.calibration import canary_calibrated
from trainguard.checks.context import CheckContext
from trainguard.config import CanaryCheck
from trainguard.config.problems import DEFAULT_REGEX_HINT, metric_problems
from trainguard.config.registry import Check, JobFacts, Run
from trainguard.evidence import MERGED, UNSET, Evidence, StartedAhead, Unset, known
from trainguard.launch import Launcher, MetricPoint, RunResult
from trainguard.report import CheckResult
from trainguard.run.request import RunRequest
from trainguard.run.scheduling import AheadRun

__all__ = [
    "CANARY",
    "CanaryEvidence",
    "GradNormEvidence",
    "LossEvidence",
    "LossVerdict",
    "Spike",
    "first_non_finite",
    "first_out_of_range",
    "first_spike",
    "judge_loss",
    "run_canary",
    "window_size",
]

NOT_LEARNING_CAUSES = (
    "parameters never updated (optimizer.step() missing, or an optimizer built over no or "
    "frozen parameters)",
    "a learning rate of 0, or a schedule stuck at 0",
    "the loss computed on detached outputs or labels that do not match the inputs",
)


def window_size(steps: int) -> int:
    """Steps per early/late window: max(3, 10% of ``steps``, rounded up)."""
    return max(3, math.ceil(0.1 * steps))


def _span(steps: Sequence[int]) -> str:
    return f"{steps[0]}-{steps[-1]}" if len(steps) > 1 else str(steps[0])


def first_non_finite(values: Mapping[int, float]) -> tuple[int, float] | None:
    """(step, value) of the first NaN or infinite value, in step order."""
    for step in sorted(values):
        if not math.isfinite(values[step]):
            return step, values[step]
    return None


def first_out_of_range(values: Mapping[int, float], low: float, high: float) -> tuple[int, float] | None:
    """(step, value) of the first value outside ``[low, high]`` (NaN counts as outside)."""
    for step in sorted(values):
        value = values[step]
        if not low <= value <= high:
            return step, value
    return None


def first_spike(
    values: Mapping[int, float], factor: float, window: int
) -> tuple[int, float, float, str] | None:
    """(step, value, reference median, reference steps) of the first value above ``factor`` x
    the median of the ``window`` finite values before it (fewer at the start of the run).

    Only positive references are judged: "10x the median" means nothing around zero or below.
    """
    steps = sorted(values)
    for i in range(1, len(steps)):
        value = values[steps[i]]
        if not math.isfinite(value):
            continue  # reported as non-finite, not as a spike
        before = [s for s in steps[max(0, i - window) : i] if math.isfinite(values[s])]
        if not before:
            continue
        reference = statistics.median(values[s] for s in before)
        if reference > 0 and value > factor * reference:
            return steps[i], value, reference, _span(before)
    return None


@dataclass
class LossVerdict:
    """What the loss statistics say about one trajectory; ``problems`` empty means learning."""

    metric: str
    steps_seen: int
    window: int
    min_drop: float
    early_steps: str | None = None
    late_steps: str | None = None
    early_median: float | None = None
    late_median: float | None = None
    drop: float | None = None
    first_non_finite: tuple[int, float] | None = None
    spike: tuple[int, float, float, str] | None = None
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def as_evidence(self) -> LossEvidence:
        return LossEvidence(
            self.metric, self.steps_seen, self.window, self.early_steps, self.early_median, self.late_steps,
            self.late_median, None if self.drop is None else round(self.drop, 4), self.min_drop,
            list(self.first_non_finite) if self.first_non_finite else None,
            Spike(*self.spike) if self.spike else None)


@dataclass
class Spike(Evidence):
    """A loss value far above the median of the steps before it."""

    step: int
    value: float
    reference_median: float
    #: the steps the median was taken over, as a span
    reference_steps: str


@dataclass
class LossEvidence(Evidence):
    """What the loss statistics said, in the report (:meth:`LossVerdict.as_evidence`)."""

    metric: str
    steps_seen: int
    window: int
    early_steps: str | None
    early_median: float | None
    late_steps: str | None
    late_median: float | None
    drop: float | None
    min_drop: float
    #: [step, value] of the first value that is not finite
    first_non_finite: list[float] | None
    spike: Spike | None


def judge_loss(
    values: Mapping[int, float],
    *,
    min_drop: float,
    spike_factor: float | None = 10.0,
    window: int | None = None,
    metric: str = "loss",
    option: str = "min_loss_drop",
) -> LossVerdict:
    """Judge a per-step trajectory: finite everywhere, no spike above ``spike_factor`` x the
    running median (``None``: not checked), and a relative drop of at least ``min_drop``
    between the median of the first ``window`` and of the last ``window`` values (default
    :func:`window_size` of the number of values)."""
    steps = sorted(values)
    size = window if window is not None else window_size(len(steps))
    verdict = LossVerdict(metric, len(steps), size, min_drop)
    if not steps:
        verdict.problems.append(f"the job printed no `{metric}` value")
        return verdict
    verdict.first_non_finite = first_non_finite(values)
    finite_prefix = {
        s: values[s] for s in steps
        if verdict.first_non_finite is None or s < verdict.first_non_finite[0]
    }
    if spike_factor is not None:
        verdict.spike = first_spike(finite_prefix, spike_factor, size)
    if verdict.spike is not None:
        step, value, reference, ref_steps = verdict.spike
        verdict.problems.append(
            f"{metric} spiked at step {step}: {value:.4g} is {value / reference:.1f}x the median "
            f"{reference:.4g} of steps {ref_steps} (spike_factor {spike_factor:g}); a learning "
            "rate too high, or a bad batch?"
        )
    if verdict.first_non_finite is not None:
        step, value = verdict.first_non_finite
        verdict.problems.append(
            f"{metric} is {value} at step {step} (the first non-finite value"
            + (f"; finite up to step {max(finite_prefix)})" if finite_prefix else ")")
        )
        return verdict  # medians of a trajectory with NaN in it mean nothing
    if len(steps) < 2 * size:
        verdict.problems.append(
            f"only {len(steps)} `{metric}` value(s): comparing an early and a late window of "
            f"{size} steps needs at least {2 * size}; raise checks.canary.steps"
        )
        return verdict
    early, late = steps[:size], steps[-size:]
    verdict.early_steps, verdict.late_steps = _span(early), _span(late)
    verdict.early_median = statistics.median(values[s] for s in early)
    verdict.late_median = statistics.median(values[s] for s in late)
    scale = abs(verdict.early_median)
    verdict.drop = (verdict.early_median - verdict.late_median) / scale if scale else 0.0
    if verdict.drop < min_drop:
        how = (
            f"fell by only {verdict.drop:.1%}" if verdict.drop > 0
            else f"did not fall (changed by {-verdict.drop:+.1%})"
        )
        verdict.problems.append(
            f"{metric} {how}: median {verdict.early_median:.4g} over steps {verdict.early_steps} "
            f"-> {verdict.late_median:.4g} over steps {verdict.late_steps}; {option} is "
            f"{min_drop:.0%}"
        )
    return verdict


@dataclass
class CanaryLimits(Evidence):
    """The limits the canary's run ran under (``run_timeout_s``: the launcher's, scaled)."""

    steps: int
    max_seconds: float | None
    max_memory_mb: float | None
    run_timeout_s: float


@dataclass
class GradNormEvidence(Evidence):
    """``grad_norm`` against ``grad_norm_range``, over the steps it was printed."""

    metric: str
    #: [low, high]
    range: list[float]
    steps_seen: int
    min: float | None
    max: float | None


@dataclass
class CanaryEvidence(Evidence):
    """The canary's evidence (docs/smoke-and-canary.md)."""

    steps: int
    outcome: str
    duration_s: float
    launch_to_first_metric_s: float | None
    last_step: int | None
    limits: CanaryLimits
    #: peak RSS (MB) per rank, keyed by the rank's number as text
    peak_rss_mb: dict[str, float]
    #: :meth:`LossVerdict.as_evidence` of the loss
    loss: LossEvidence
    run_dir: str
    #: the run started beside the check before it: its time is not an idle figure
    started_ahead: StartedAhead | Unset = UNSET
    #: the run was another check's uninterrupted run of the same request (limits judged after it)
    shared_run: str | Unset = UNSET
    peak_gpu_mb: dict[str, float] | Unset = UNSET
    #: what the launcher found on a run that hit a limit (its stacks aside)
    launcher: dict[str, Any] = field(default_factory=dict, metadata=MERGED)
    stderr_tail: str | Unset = UNSET
    likely_causes: list[str] | Unset = UNSET
    val: LossEvidence | Unset = UNSET
    grad_norm: GradNormEvidence | Unset = UNSET
    baseline: BaselineEvidence | Unset = UNSET
    plots: list[str] | Unset = UNSET


def _limit_problem(result: RunResult, spec: CanaryCheck, scale: float) -> str | None:
    """The limit the run hit, by how much; None when it hit none."""
    if result.outcome == "stopped":
        return f"limit steps ({spec.steps}) exceeded: {result.reason}; does job.command pass {{steps}} to the script?"
    past = min((p.step for p in result.points if p.name == "loss" and p.step > spec.steps), default=None)
    if past is not None:  # it ended before the launcher could stop it (its lines read late)
        return (f"limit steps ({spec.steps}) exceeded: the job printed step {past}, past the limit of "
                f"{spec.steps} steps (it ended at step {result.last_step} before it could be stopped); "
                "does job.command pass {steps} to the script?")
    if "memory_limit" in result.evidence:
        return f"limit max_memory_mb ({spec.max_memory_mb:g}) exceeded: {result.reason}"
    if spec.max_seconds is None or result.outcome != "timeout":
        return None
    # TRAINGUARD_TIMEOUT_SCALE (slow CI runners) scales this limit like every timeout
    limit_s = spec.max_seconds * scale
    scaled = f" x timeout scale {scale:g} = {limit_s:g} s" if scale != 1 else ""
    loss = result.trajectory("loss")
    done = max(loss) if loss else 0
    text = (
        f"limit max_seconds ({spec.max_seconds:g}{scaled}) exceeded: the run was stopped after "
        f"{result.duration_s:.1f} s "
        + (f"at step {done} of {spec.steps}" if done else "before its first step")
    )
    times = sorted(p.t for p in result.points if p.name == "loss")
    if len(times) >= 2 and done:
        per_step = (times[-1] - times[0]) / (len(times) - 1)
        needed = times[-1] + (spec.steps - done) * per_step
        text += (
            f"; at its pace ({per_step:.2f} s per step) it needed about {needed:.0f} s, "
            f"{needed - limit_s:.0f} s over"
        )
    return text


def _limits_after(result: RunResult, spec: CanaryCheck, scale: float) -> str | None:
    """The limit a shared run (launched without the canary's limits) went past, judged when it
    ended: what the launcher would have stopped the canary's own run for."""
    if result.last_step is not None and result.last_step > spec.steps:
        return (f"limit steps ({spec.steps}) exceeded: the job printed step {result.last_step}; does job.command "
                "pass {steps} to the script?")
    peak = max(result.peak_rss_mb.items(), key=lambda kv: kv[1], default=None)
    if spec.max_memory_mb is not None and peak is not None and peak[1] > spec.max_memory_mb:
        return (f"limit max_memory_mb ({spec.max_memory_mb:g}) exceeded: rank {peak[0]}'s processes used "
                f"{peak[1]:.0f} MB of memory (RSS), {peak[1] - spec.max_memory_mb:.0f} MB over")
    took = result.duration_s - sum(end - start for start, end in result.pauses)
    if spec.max_seconds is not None and took > spec.max_seconds * scale:
        return f"limit max_seconds ({spec.max_seconds * scale:g}) exceeded: the run took {took:.1f} s"
    return None


def canary_request(request: RunRequest, spec: CanaryCheck) -> RunRequest:
    """The canary's run (``request``: its spec's) with its time and memory limits."""
    return dataclasses.replace(
        request,
        timeout=spec.max_seconds if spec.max_seconds is not None else spec.timeout,
        max_rss_mb=spec.max_memory_mb,
    )


def canary_on_metric(spec: CanaryCheck) -> Callable[[MetricPoint, Launcher], None]:
    """Stops a job that runs past the canary's steps (it ignored ``--steps``)."""

    def steps_limit(point: MetricPoint, launcher: Launcher) -> None:
        # asked again for each later line; the launcher keeps the first reason (the first step past)
        if point.name == "loss" and point.step > spec.steps:
            launcher.stop(f"the job printed step {point.step}, past the limit of {spec.steps} steps")

    return steps_limit


def run_canary(ctx: CheckContext[CanaryCheck]) -> CheckResult:
    """Run the job for ``steps`` steps within ``max_seconds`` and ``max_memory_mb``; its loss
    must stay finite, never spike above ``spike_factor`` x its running median and fall by
    ``min_loss_drop`` (median of an early window vs a late one); ``val_metric`` must fall by
    ``min_val_drop`` and ``grad_norm`` stay inside ``grad_norm_range`` when configured."""
    started = time.monotonic()
    spec, settings = ctx.spec, ctx.settings
    request = canary_request(ctx.declared().request, spec)
    reproduce = ctx.command_line(request)
    # the uninterrupted run of its request when one ran already (the profile's, run first), its
    # limits judged after the fact; else started early beside the checks before it
    # (trainguard.session.lane_plan), else now; determinism/resume/parallel of the same run reuse it
    result, shared = ctx.run_as_reference(request, label="canary", on_metric=canary_on_metric(spec))
    limit_s = (request.timeout or ctx.job_file.job.timeout) * settings.timeout_scale
    loss = judge_loss(
        result.trajectory("loss"),
        min_drop=spec.min_loss_drop,
        spike_factor=spec.spike_factor,
        window=window_size(spec.steps),
    )
    evidence = _canary_evidence(result, spec, loss, limit_s)
    problems: list[str] = []
    limit = _limit_problem(result, spec, settings.timeout_scale)
    if limit is None and shared:
        limit = _limits_after(result, spec, settings.timeout_scale)
        evidence.shared_run = f"{result.run_dir.name}: the uninterrupted run of this request, launched once for every check"
    if limit is not None:
        problems.append(limit)
        evidence.launcher = {k: v for k, v in result.evidence.items() if k != "stacks"}
    elif not result.ok:
        problems.append(f"the job did not complete: {result.reason}")
    if not result.ok:
        evidence.stderr_tail = result.stderr_tail
        if limit is None:
            # a job that raises on a NaN or exploded loss: what it printed says why
            problems += [p for p in loss.problems if p.startswith(("loss is ", "loss spiked"))]
    else:
        problems += loss.problems
        if loss.drop is not None and loss.drop < spec.min_loss_drop and not loss.spike:
            evidence.likely_causes = list(NOT_LEARNING_CAUSES)
        problems += _val_problems(result, spec, evidence)
        problems += _grad_norm_problems(result, spec, evidence)
    baseline_note = ""
    refused: list[str] = []  # a baseline not compared with: an error, not a failure
    if result.ok and loss.first_non_finite is None:
        outcome = canary_calibrated(ctx.job_file, settings.save_baseline, spec, request, result) or \
            canary_baseline(ctx.job_file, settings.save_baseline, spec, request, result, canary_ok=not problems)
        evidence.baseline = outcome.evidence
        if outcome.plots:
            evidence.plots = list(outcome.plots)
        (refused if outcome.refused else problems).extend(outcome.problems)
        baseline_note = f"; {outcome.note}" if outcome.note else ""
    elif settings.save_baseline:
        evidence.baseline = BaselineEvidence("not_saved", reason=NOT_SAVED_FAILED)
        baseline_note = "; baseline not saved (the canary failed)"
    duration = time.monotonic() - started
    if problems or refused:
        # a baseline that could not be compared with is an error: the band was not checked
        summary = "; ".join(problems + refused)
        if baseline_note.startswith("; baseline not saved"):
            summary += baseline_note
        return CheckResult("canary", "failed" if problems else "error", summary, evidence, duration,
                           reproduce)
    return CheckResult("canary", "passed", _passed_summary(result, spec, loss, evidence, limit_s) + baseline_note,
                       evidence, duration, reproduce)


def _canary_evidence(result: RunResult, spec: CanaryCheck, loss: LossVerdict, limit_s: float) -> CanaryEvidence:
    """What the run did against its limits, and its loss verdict; the judgements that follow add
    to it."""
    evidence = CanaryEvidence(
        steps=spec.steps, outcome=result.outcome, duration_s=round(result.duration_s, 2),
        launch_to_first_metric_s=None if result.first_metric_s is None else round(result.first_metric_s, 2),
        last_step=result.last_step,
        limits=CanaryLimits(spec.steps, spec.max_seconds, spec.max_memory_mb, limit_s),
        peak_rss_mb={str(r): mb for r, mb in sorted(result.peak_rss_mb.items())},
        loss=loss.as_evidence(), run_dir=str(result.run_dir),
        started_ahead=StartedAhead.from_dict(result.evidence["started_ahead"])
        if "started_ahead" in result.evidence else UNSET,
    )
    if result.peak_gpu_mb:
        evidence.peak_gpu_mb = {str(r): mb for r, mb in sorted(result.peak_gpu_mb.items())}
    return evidence


def _val_problems(result: RunResult, spec: CanaryCheck, evidence: CanaryEvidence) -> list[str]:
    """``val_metric`` judged like the loss (its drop, its non-finite values), without the spike
    test: a validation metric is printed too seldom for a running median."""
    if spec.val_metric is None:
        return []
    val_values = result.trajectory(spec.val_metric)
    val = judge_loss(
        val_values,
        min_drop=spec.min_val_drop,
        spike_factor=None,
        window=max(1, min(3, len(val_values) // 2)),
        metric=spec.val_metric,
        option="min_val_drop",
    )
    evidence.val = val.as_evidence()
    return val.problems


def _grad_norm_problems(result: RunResult, spec: CanaryCheck, evidence: CanaryEvidence) -> list[str]:
    """``grad_norm`` inside ``grad_norm_range`` at every step it was printed, when both are set."""
    if spec.grad_norm is None or spec.grad_norm_range is None:
        return []
    low, high = spec.grad_norm_range
    norms = result.trajectory(spec.grad_norm)
    outside = first_out_of_range(norms, low, high)
    evidence.grad_norm = GradNormEvidence(spec.grad_norm, [low, high], len(norms),
                                          min(norms.values()) if norms else None,
                                          max(norms.values()) if norms else None)
    if not norms:
        return [f"the job printed no `{spec.grad_norm}` value (checks.canary.grad_norm)"]
    if outside is not None:
        step, value = outside
        return [f"{spec.grad_norm} is {value:.4g} at step {step}, outside grad_norm_range [{low:g}, {high:g}]"]
    return []


def _passed_summary(result: RunResult, spec: CanaryCheck, loss: LossVerdict, evidence: CanaryEvidence,
                    limit_s: float) -> str:
    """How far the loss (and ``val_metric``) fell, and the time and memory the run took of its
    limits."""
    assert loss.drop is not None  # no problem: the windows were compared
    peak = max(result.peak_rss_mb.values(), default=None)
    memory = (
        f"peak RSS {peak:.0f} MB" + (f" of {spec.max_memory_mb:g}" if spec.max_memory_mb else "")
        if peak is not None else "RSS not sampled"
    )
    seconds = f"{result.duration_s:.1f} s" + (f" of {limit_s:g}" if spec.max_seconds else "")
    val = known(evidence.val)
    val_note = f"; {spec.val_metric} fell {val.drop:.0%}" if val is not None and val.drop is not None else ""
    return (f"loss fell {loss.drop:.0%} (median {loss.early_median:.4g} over steps {loss.early_steps} "
            f"-> {loss.late_median:.4g} over steps {loss.late_steps}; min {spec.min_loss_drop:.0%}), "
            f"finite, no spike{val_note}; {spec.steps} steps in {seconds}, {memory}")


def _canary_requires(spec: CanaryCheck, facts: JobFacts) -> list[tuple[str, str]]:
    metrics = facts.job_file.job.metrics
    problems = []
    if "loss" not in metrics:
        problems.append(("job.metrics", "checks.canary judges the `loss` metric, but job.metrics has none "
                         f"(it has: {', '.join(metrics)}). Fix: add {DEFAULT_REGEX_HINT}"))
    for key in ("val_metric", "grad_norm"):
        problems += metric_problems(facts, f"checks.canary.{key}", getattr(spec, key))
    return problems


#: the canary (docs/smoke-and-canary.md)
CANARY: Check[CanaryCheck] = Check(
    "canary", CanaryCheck, run=run_canary,
    runs=lambda spec, ctx: ([Run("the uninterrupted run", reference=True)],
                            "loss must fall by min_loss_drop, with no spike or NaN"),
    requires=_canary_requires,
    lane=True,
    ahead=lambda ctx: AheadRun("canary", canary_request(ctx.declared().request, ctx.spec), "canary",
                               on_metric=canary_on_metric(ctx.spec), reference=True),
    ahead_words="the canary's run",
    ahead_reference=True,
    calibrates=lambda spec: [None],
    evidence=(CanaryEvidence,),
)
