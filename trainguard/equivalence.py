"""Equivalence checks: the same run twice, a killed-and-resumed run, N ranks vs 1.

Each compares metric trajectories step by step (exact by default) and, on a mismatch, names the
first divergent step, the largest absolute and relative difference, and the likely causes.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from trainguard.config import DeterminismCheck
from trainguard.launch import RunResult
from trainguard.report import CheckResult
from trainguard.runner import JobRunner, RunRequest

__all__ = ["TrajectoryDiff", "compare_trajectories", "run_determinism"]

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
        return self.first_divergent_step is None and not self.missing_in_actual

    def as_evidence(self) -> dict[str, Any]:
        return {
            "metric": self.metric,
            "compared_steps": self.compared_steps,
            "first_divergent_step": self.first_divergent_step,
            "values_at_first_divergence": list(self.first_values) if self.first_values else None,
            "max_abs_diff": self.max_abs_diff,
            "max_rel_diff": self.max_rel_diff,
            "missing_steps": self.missing_in_actual[:20],
        }


def _close(a: float, b: float, rtol: float, atol: float) -> bool:
    if math.isnan(a) and math.isnan(b):
        return True
    if math.isinf(a) or math.isinf(b):
        return a == b
    return abs(a - b) <= atol + rtol * abs(b)


def compare_trajectories(
    actual: Mapping[int, float],
    expected: Mapping[int, float],
    *,
    metric: str = "loss",
    steps: Iterable[int] | None = None,
    rtol: float = 0.0,
    atol: float = 0.0,
) -> TrajectoryDiff:
    """Compare ``actual`` with ``expected`` on ``steps`` (default: every step of ``expected``)."""
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
        if first is None and not _close(a, b, rtol, atol):
            first, first_values = step, (a, b)
    return TrajectoryDiff(
        metric, compared, first, max_abs, max_rel, missing_actual, missing_expected, first_values
    )


def _failed_run(name: str, result: RunResult, started: float, reproduce: str) -> CheckResult:
    return CheckResult(
        name=name,
        status="error",
        summary=f"the job did not complete: {result.reason}",
        evidence={
            "outcome": result.outcome,
            "reason": result.reason,
            "failed_rank": result.failed_rank,
            "stderr_tail": result.stderr_tail,
            "run_dir": str(result.run_dir),
            **result.evidence,
        },
        duration_s=time.monotonic() - started,
        reproduce=reproduce,
    )


def run_determinism(runner: JobRunner, spec: DeterminismCheck) -> CheckResult:
    """The job twice with the same seed: every metric's trajectory must match (exact by
    default, ``rtol``/``atol`` when set)."""
    started = time.monotonic()
    job = runner.job_file.job
    request = RunRequest.make(
        steps=spec.steps,
        seed=spec.seed if spec.seed is not None else runner.settings.seed,
        world_size=job.world_size,
        args=spec.args,
        env=spec.env,
        timeout=spec.timeout,
    )
    reproduce = f"run twice and diff: {runner.command_line(request)}"
    first = runner.reference(request)
    if not first.ok:
        return _failed_run("determinism", first, started, reproduce)
    second = runner.run(request, label="determinism-repeat")
    if not second.ok:
        return _failed_run("determinism", second, started, reproduce)
    diffs = []
    for metric in job.metrics:
        expected = first.trajectory(metric)
        if not expected:
            continue
        diffs.append(
            compare_trajectories(
                second.trajectory(metric), expected, metric=metric, rtol=spec.rtol, atol=spec.atol
            )
        )
    evidence: dict[str, Any] = {
        "seed": request.seed,
        "steps": spec.steps,
        "tolerance": {"rtol": spec.rtol, "atol": spec.atol},
        "metrics": [d.as_evidence() for d in diffs],
        "run_dirs": [str(first.run_dir), str(second.run_dir)],
    }
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
    worst = min(bad, key=lambda d: d.first_divergent_step or 0)
    if worst.first_divergent_step is None:
        summary = (
            f"{worst.metric}: the second run is missing steps {worst.missing_in_actual[:5]} "
            "that the first run printed"
        )
    else:
        a, b = worst.first_values or (math.nan, math.nan)
        summary = (
            f"{worst.metric} differs from step {worst.first_divergent_step} on "
            f"({b!r} then {a!r}; max abs diff {worst.max_abs_diff:.3g}) with the same seed "
            f"{request.seed}"
        )
    evidence["likely_causes"] = list(NONDETERMINISM_CAUSES)
    return CheckResult("determinism", "failed", summary, evidence, duration, reproduce)
