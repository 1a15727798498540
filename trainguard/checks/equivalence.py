"""Equivalence checks: the same run twice, N ranks vs 1 (a killed-and-resumed run:
:mod:`trainguard.checks.resume`, judged by :mod:`trainguard.checks.resume_judge`).

Each compares metric trajectories step by step (exact by default, :func:`compare_trajectories`)
and, on a mismatch, names the first divergent step, the largest absolute and relative
difference, and the likely causes.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from trainguard.checks.accounting import (
    batch_order_difference,
    global_batches,
    sample_agreement,
)
from trainguard.checks.calibration import spread_note, tolerance_for
from trainguard.checks.context import CheckContext
from trainguard.checks.diagnosis import (
    data_order_note,
    first_different_batch,
    shared_shard_note,
)
from trainguard.checks.divergence import (
    Divergence,
    ObservedCause,
    observe_runs,
    observed_determinism_causes,
)
from trainguard.checks.divergence_noisy import (
    WORLD_SIZE_CAUSES,
    observe_noisy,
    observed_world_size_causes,
)
from trainguard.checks.equivalence_records import (
    DeterminismEvidence,
    ParallelEvidence,
    RunFailure,
    Tolerance,
    TrajectoryEvidence,
)
from trainguard.checks.step_compare import SsTolerance
from trainguard.config import DeterminismCheck, ParallelCheck
from trainguard.config.problems import one_process_problems
from trainguard.config.registry import Check, Run
from trainguard.evidence import StartedAhead
from trainguard.launch import RunResult
from trainguard.launch.metrics import aligned_trajectories
from trainguard.launch.samples import SampleBatch, read_samples
from trainguard.report import CheckResult
from trainguard.run.scheduling import AheadRun

__all__ = [
    "DETERMINISM",
    "PARALLEL",
    "TrajectoryDiff",
    "compare_trajectories",
    "failed_run",
    "observed_nondeterminism",
    "run_determinism",
    "run_parallel",
]

NONDETERMINISM_CAUSES = (
    "an unseeded RNG (python random, numpy, torch, a DataLoader generator or worker seeds)",
    "nondeterministic kernels (set torch.use_deterministic_algorithms(True); on GPU also "
    "CUBLAS_WORKSPACE_CONFIG=:4096:8 and cudnn.benchmark=False)",
    "data order from an unordered source (os.listdir, set iteration, multiple workers "
    "without a seeded sampler)",
    "thread-count dependent float reductions (pin OMP_NUM_THREADS in job.env)",
    "wall-clock or hostname dependent code paths",
)


@dataclass(frozen=True)
class TrajectoryDiff:
    """How two trajectories of one metric compare over the steps both should have."""

    metric: str
    compared_steps: int
    first_divergent_step: int | None
    max_abs_diff: float
    max_rel_diff: float
    missing_in_actual: list[int]
    missing_in_expected: list[int]
    first_values: tuple[float, float] | None = None

    @property
    def ok(self) -> bool:
        """Compared on at least one step, equal within the tolerance there, and no step missing
        from ``actual``: a trajectory of no common step is not a match (issue 42)."""
        return self.compared_steps > 0 and self.first_divergent_step is None and not self.missing_in_actual

    def missing_words(self) -> str:
        """Why a diff without a divergent step is not ok: ``is missing steps [6, 7]``, or no step."""
        if self.missing_in_actual:
            return f"is missing steps {self.missing_in_actual[:5]}"
        return f"has no step of {self.metric} in common with the run it is compared with: nothing was compared"

    def as_evidence(self) -> TrajectoryEvidence:
        return TrajectoryEvidence(
            self.metric, self.compared_steps, self.first_divergent_step,
            list(self.first_values) if self.first_values else None, self.max_abs_diff, self.max_rel_diff,
            self.missing_in_actual[:20])


def _close(a: float, b: float, rtol: float, atol: float, band: float = 0.0) -> bool:
    if math.isnan(a) and math.isnan(b):
        return True
    if math.isinf(a) or math.isinf(b):
        return a == b
    return abs(a - b) <= max(atol + rtol * abs(b), band)


def compare_trajectories(
    actual: Mapping[int, float],
    expected: Mapping[int, float],
    *,
    metric: str = "loss",
    steps: Iterable[int] | None = None,
    rtol: float = 0.0,
    atol: float = 0.0,
    band: Mapping[int, float] | None = None,
) -> TrajectoryDiff:
    """Compare ``actual`` with ``expected`` on ``steps`` (default: every step of ``expected``);
    ``band``: step -> an absolute difference allowed there besides rtol/atol (a calibration's)."""
    wanted = sorted(expected if steps is None else steps)
    first: int | None = None
    first_values = None
    max_abs = 0.0
    max_rel = 0.0
    missing_actual = [s for s in wanted if s not in actual and s in expected]
    missing_expected = [s for s in wanted if s not in expected]
    compared = 0
    for step in wanted:
        if step not in actual or step not in expected:
            continue
        a, b = actual[step], expected[step]
        compared += 1
        if not (math.isnan(a) or math.isnan(b)):
            diff = abs(a - b)
            max_abs = max(max_abs, diff)
            if b != 0:
                max_rel = max(max_rel, diff / abs(b))
        if first is None and not _close(a, b, rtol, atol, band.get(step, 0.0) if band else 0.0):
            first, first_values = step, (a, b)
    return TrajectoryDiff(
        metric, compared, first, max_abs, max_rel, missing_actual, missing_expected, first_values
    )


#: the labels of determinism's and parallel's declared runs
REPEAT = "repeat, same seed"
ONE_RANK = "1 rank"


def _n_ranks(spec: ParallelCheck) -> str:
    return f"{spec.world_size} ranks"


def failed_run(name: str, result: RunResult, started: float, reproduce: str) -> CheckResult:
    return CheckResult(
        name=name,
        status="error",
        summary=f"the job did not complete: {result.reason}",
        evidence=RunFailure(result.outcome, result.reason, result.failed_rank, result.stderr_tail,
                            str(result.run_dir), launcher=dict(result.evidence)),
        duration_s=time.monotonic() - started,
        reproduce=reproduce,
    )


def run_determinism(ctx: CheckContext[DeterminismCheck]) -> CheckResult:
    """The job twice with the same seed: every metric's trajectory must match (exact by
    default, ``rtol``/``atol`` when set)."""
    started = time.monotonic()
    spec, job, request = ctx.spec, ctx.job_file.job, ctx.request
    reproduce = f"run twice and diff: {ctx.command_line()}"
    ctx.prefetch()  # the two runs are independent: their start-ups may overlap
    try:
        # the second run may have started early beside the checks before this one (lane_plan)
        second = ctx.take_ahead(REPEAT) or ctx.run(REPEAT, label="determinism-repeat")
    except BaseException:
        ctx.stop_background("the determinism check was interrupted")
        raise
    first = ctx.reference()
    if not first.ok:
        return failed_run("determinism", first, started, reproduce)
    if not second.ok:
        return failed_run("determinism", second, started, reproduce)
    diffs = []
    for metric in job.metrics:
        actual, expected = aligned_trajectories(second.points, first.points, metric)
        if not expected:
            continue
        diffs.append(
            compare_trajectories(actual, expected, metric=metric, rtol=spec.rtol, atol=spec.atol)
        )
    evidence = DeterminismEvidence(
        seed=request.seed, steps=spec.steps, tolerance=Tolerance(spec.rtol, spec.atol),
        metrics=[d.as_evidence() for d in diffs], run_dirs=[str(first.run_dir), str(second.run_dir)],
    )
    ahead = {str(run.run_dir): StartedAhead.from_dict(run.evidence["started_ahead"]) for run in (first, second)
             if "started_ahead" in run.evidence}
    if ahead:
        evidence.started_ahead = ahead
    duration = time.monotonic() - started
    if not diffs:
        return CheckResult(
            "determinism",
            "failed",
            "the job printed no metric line matching job.metrics, so there is nothing to compare",
            evidence,
            duration,
            reproduce,
        )
    bad = [d for d in diffs if not d.ok]
    if not bad:
        steps = max(d.compared_steps for d in diffs)
        return CheckResult(
            "determinism",
            "passed",
            f"two runs with seed {request.seed} match on all {steps} steps of "
            + ", ".join(d.metric for d in diffs),
            evidence,
            duration,
            reproduce,
        )
    # a metric that really diverges says more than one that only misses steps
    worst = min(
        bad,
        key=lambda d: (d.first_divergent_step is None, d.first_divergent_step or 0),
    )
    if worst.first_divergent_step is None:
        summary = (
            f"{worst.metric}: the second run {worst.missing_words()} "
            "that the first run printed"
        )
    else:
        a, b = worst.first_values or (math.nan, math.nan)
        summary = (
            f"{worst.metric} differs from step {worst.first_divergent_step} on "
            f"({b!r} then {a!r}; max abs diff {worst.max_abs_diff:.3g}) with the same seed "
            f"{request.seed}"
        )
    causes = list(NONDETERMINISM_CAUSES)
    drawn = read_samples(first.run_dir).get(0, []), read_samples(second.run_dir).get(0, [])
    note = data_order_note(*drawn)
    recorded = ctx.recorded(first)  # the profile's timed run, shared, has no step records
    observed, most_likely = observed_nondeterminism(recorded.run_dir, second.run_dir, evidence,
                                                    sorted(recorded.trajectory(ctx.metric)))
    if note is not None:
        evidence.samples = note
        unseeded, unordered = NONDETERMINISM_CAUSES[0], NONDETERMINISM_CAUSES[2]
        if first_different_batch(*drawn) is None:  # the same samples: not the data order
            causes.remove(unordered)
        elif not observed or observed[0].startswith(unordered):  # the data order differs: say so first
            summary += f". Most likely the data order: {note}"
            most_likely = ""  # the records say the same, step by step
            causes = [unordered, unseeded, *(c for c in causes if c not in (unordered, unseeded))]
    if observed:  # what the step records show, first, with the observation
        summary += f". {most_likely}" if most_likely else ""
        causes = observed + [c for c in causes if not any(o.startswith(c) for o in observed)]
    evidence.likely_causes = causes
    summary += spread_note(ctx.job_file, request)  # never loosened: only the noise measured
    return CheckResult("determinism", "failed", summary, evidence, duration, reproduce)


#: the determinism causes the step records show (:func:`observed_determinism_causes`), by key
_OBSERVED_CAUSE = {"seed": 0, "kernels": 1, "data_order": 2, "wall_clock": 4}


def observed_nondeterminism(first: Path, second: Path, evidence: DeterminismEvidence,
                            printed: Sequence[int] = ()) -> tuple[list[str], str]:
    """(the causes two runs' step records show, each a :data:`NONDETERMINISM_CAUSES` entry with
    its observation, most telling first; the summary's "Most likely ..." or ""); where the
    records first differ (or why they were not compared) is set on ``evidence``; ``printed``:
    the steps the first run printed (its steps are named so). Nothing without step records."""
    runs = observe_runs(first, second, counted_from=min(printed, default=1),
                        last_printed=max(printed) if printed else None)
    if runs is None:
        return [], ""
    evidence.first_divergence = runs.divergence.as_evidence("the second run")
    if not isinstance(runs.divergence, Divergence):
        return [], ""
    observed = observed_determinism_causes(runs.divergence, runs.reference, runs.other)
    if not observed:
        return [], ""
    general = [NONDETERMINISM_CAUSES[_OBSERVED_CAUSE[c.key]] for c in observed]
    return ([f"{text}: {c.observation}" for text, c in zip(general, observed, strict=True)],
            f"Most likely {general[0].split(' (')[0]}: {observed[0].observation}")


#: N ranks drew other global batches than 1 rank did, of the same size
PARALLEL_ORDER_CAUSE = ("a data order that depends on the world size (each rank shuffles its own shard, a "
                        "permutation seeded with the rank, or a shard split that changes with the ranks)")
PARALLEL_CAUSES = (
    "each rank reads the same shard (no DistributedSampler, or set_epoch not called)",
    "gradients summed instead of averaged across ranks (all_reduce without dividing by world size)",
    "the per-rank batch is not global_batch / world_size",
    "dropout or augmentation RNG differs per rank (pass args that disable it for this check)",
    "BatchNorm statistics computed per rank (use SyncBatchNorm or compare without BatchNorm)",
)


def run_parallel(ctx: CheckContext[ParallelCheck]) -> CheckResult:
    """The job at ``world_size`` N vs 1 rank with the same global batch: the per-step mean of
    the ranks' metric must match the single rank's within ``rtol``/``atol``."""
    started = time.monotonic()
    spec, metric = ctx.spec, ctx.metric
    single, multi = ctx.declared(ONE_RANK).request, ctx.declared(_n_ranks(spec)).request
    reproduce = f"compare: {ctx.command_line(single)}  vs  {ctx.command_line(multi)}"
    # the N-rank run: started early beside the checks before this one (lane_plan), else now in
    # the background while the 1-rank run runs in the foreground
    pending = ctx.run_for(_n_ranks(spec))
    try:
        one = ctx.reference(ONE_RANK)
        many = pending.result()
    except BaseException:
        ctx.stop_background("the parallel check was interrupted")
        raise
    if not one.ok:
        return failed_run("parallel", one, started, reproduce)
    if not many.ok:
        return failed_run("parallel", many, started, reproduce)
    tol = tolerance_for(ctx.job_file, spec, multi, "parallel")  # the N-rank run's own noise, when calibrated
    diff = compare_trajectories(many.trajectory(metric), one.trajectory(metric), metric=metric,
                                rtol=spec.rtol, atol=spec.atol, band=tol.band(metric))
    ranks_reporting = sorted({p.rank for p in many.points if p.name == metric})
    evidence = ParallelEvidence(
        world_size=spec.world_size, ranks_reporting=ranks_reporting, tolerance=tol.as_evidence(),
        trajectory=diff.as_evidence(), run_dirs={"1": str(one.run_dir), str(spec.world_size): str(many.run_dir)},
    )
    if "started_ahead" in many.evidence:
        evidence.started_ahead = {str(spec.world_size): StartedAhead.from_dict(many.evidence["started_ahead"])}
    duration = time.monotonic() - started
    if diff.compared_steps == 0:
        return CheckResult(
            "parallel", "failed", f"no `{metric}` steps to compare", evidence, duration, reproduce
        )
    if diff.ok:
        return CheckResult(
            "parallel",
            "passed",
            f"{spec.world_size} ranks match 1 rank on {diff.compared_steps} steps of {metric} "
            f"(max abs diff {diff.max_abs_diff:.3g}, rtol {spec.rtol:g}, atol {spec.atol:g})",
            evidence,
            duration,
            reproduce,
        )
    evidence.likely_causes = list(PARALLEL_CAUSES)
    shared = shared_shard_note(read_samples(many.run_dir))
    if shared is not None:  # decisive: put the shard cause first with what shows it
        evidence.samples = shared
        evidence.likely_causes = [PARALLEL_CAUSES[0] + f": {shared}", *PARALLEL_CAUSES[1:]]
    if diff.first_divergent_step is None:
        summary = f"the {spec.world_size}-rank run {diff.missing_words()}"
    else:
        a, b = diff.first_values or (math.nan, math.nan)
        summary = (
            f"{spec.world_size} ranks diverge from 1 rank at step {diff.first_divergent_step} "
            f"({metric} {a!r} vs {b!r}; max abs diff {diff.max_abs_diff:.3g}, "
            f"tolerance rtol {spec.rtol:g} atol {spec.atol:g})"
        )
    observed = _observed_parallel(ctx.recorded(one).run_dir, many.run_dir, tol.ss_tolerance(), spec.world_size,
                                  evidence)
    if shared is not None:
        summary += f". Most likely {shared}"
    elif observed:  # what the step records show, first, with the observation
        texts = [_parallel_text(c) for c in observed]
        evidence.likely_causes = [*(f"{t}: {c.observation}" for t, c in zip(texts, observed, strict=True)),
                                  *(c for c in evidence.likely_causes if c not in texts)]
        summary += f". Most likely {texts[0].split(' (')[0]}: {observed[0].observation}"
    elif (found := parallel_sample_cause(read_samples(one.run_dir), read_samples(many.run_dir),
                                         steps=spec.steps, world_size=spec.world_size)) is not None:
        cause, evidence.samples = found
        evidence.likely_causes = [f"{cause}: {evidence.samples}", *(c for c in PARALLEL_CAUSES if c != cause)]
        summary += f". Most likely {cause.split(' (')[0]}: {evidence.samples}"
    return CheckResult("parallel", "failed", summary, evidence, duration, reproduce)


def _observed_parallel(one: Path, many: Path, tolerance: SsTolerance, world_size: int,
                       evidence: ParallelEvidence) -> list[ObservedCause]:
    """The causes the step records of the 1-rank and the N-rank run show, most telling first;
    where they first differ is set on ``evidence``."""
    runs = observe_noisy(one, many, tolerance=tolerance)
    if runs is None:
        return []
    other = f"the {world_size}-rank run"
    evidence.first_divergence = runs.evidence(other)
    return observed_world_size_causes(runs, world_size, other)


def _parallel_text(cause: ObservedCause) -> str:
    return PARALLEL_CAUSES[1] if cause.key == "summed" else WORLD_SIZE_CAUSES[cause.key]


def parallel_sample_cause(one: Mapping[int, Sequence[SampleBatch]], many: Mapping[int, Sequence[SampleBatch]], *,
                          steps: int, world_size: int) -> tuple[str, str] | None:
    """(cause, what shows it) when the N ranks together drew other samples per step than the
    one rank did: a batch of another size, or another order; None when they drew the same."""
    agreement = sample_agreement(global_batches(one, first_step=1, steps=steps),
                                 global_batches(many, first_step=1, steps=steps))
    if agreement is not None and agreement.same and (order := batch_order_difference(one, many, steps=steps)):
        return PARALLEL_ORDER_CAUSE, (
            f"the {world_size} ranks drew the same samples per printed step as 1 rank, but not batch by batch "
            f"(first at batch {order[0]}, of {order[1]} a step): that order counts where the job updates "
            "its weights more often than it prints a step (a printed step is an epoch)")
    if agreement is None or agreement.same:
        return None
    cause = PARALLEL_CAUSES[2] if agreement.resumed_size != agreement.reference_size else PARALLEL_ORDER_CAUSE
    return cause, agreement.sentence(1, world_size, resumed=False)


#: determinism: two runs with one seed must match (docs/equivalence.md)
DETERMINISM: Check[DeterminismCheck] = Check(
    "determinism", DeterminismCheck, run=run_determinism,
    runs=lambda spec, ctx: ([Run("reference", reference=True), Run(REPEAT)], "the two must match"),
    lane=True,
    ahead=lambda ctx: AheadRun("determinism", ctx.declared(REPEAT).request, "determinism-repeat"),
    ahead_words="determinism's second run",
    evidence=(DeterminismEvidence, RunFailure),
)

#: parallel: N ranks must train like one (docs/equivalence.md)
PARALLEL: Check[ParallelCheck] = Check(
    "parallel", ParallelCheck, run=run_parallel,
    runs=lambda spec, ctx: ([Run(ONE_RANK, 1, reference=True), Run(_n_ranks(spec), spec.world_size, reference=True)],
                            "N ranks must train like one"),
    requires=lambda spec, facts: one_process_problems(facts, [("checks.parallel.world_size", spec.world_size)]),
    lane=True,
    # its N-rank run; the check runs the 1-rank one meanwhile
    ahead=lambda ctx: AheadRun("parallel", ctx.declared(_n_ranks(ctx.spec)).request, "reference", reference=True),
    ahead_words="parallel's N-rank run",
    ahead_reference=True,
    marks=lambda spec: [("parallel", ()), ("ddp", ())],
    calibrates=lambda spec: [spec.world_size],
    evidence=(ParallelEvidence, RunFailure),
)
