"""The smoke check: the job end to end for a few steps, every stage accounted for."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from trainguard.config import SmokeCheck
from trainguard.report import CheckResult
from trainguard.runner import JobRunner

__all__ = ["run_smoke"]


def _checkpoint_files(directory: Path) -> list[Path]:
    if not directory.is_dir():
        return []
    return sorted(p for p in directory.rglob("*") if p.is_file() and not p.name.startswith("."))


def run_smoke(runner: JobRunner, spec: SmokeCheck) -> CheckResult:
    """Passes when the job exits 0 within its limit, printed a metric for every step and (when
    it is given ``{checkpoint_dir}``) wrote a checkpoint there."""
    started = time.monotonic()
    job_file = runner.job_file
    job = job_file.job
    request = runner.request_for(spec)
    reproduce = runner.command_line(request)
    result = runner.run(request, label="smoke")
    problems: list[str] = []
    stages: dict[str, Any] = {
        "launch_to_first_metric_s": result.first_metric_s,
        "total_s": round(result.duration_s, 3),
    }
    if result.points:
        last = max(p.t for p in result.points)
        stages["first_to_last_metric_s"] = round(last - (result.first_metric_s or 0.0), 3)
        stages["last_metric_to_exit_s"] = round(result.duration_s - last, 3)
    if not result.ok:
        problems.append(f"the job did not complete: {result.reason}")
    metric = "loss" if "loss" in job.metrics else next(iter(job.metrics))
    seen = set(result.trajectory(metric))
    missing = [s for s in range(1, spec.steps + 1) if s not in seen]
    if missing:
        problems.append(
            f"no `{metric}` line for step(s) {missing[:10]}{' ...' if len(missing) > 10 else ''} "
            f"(check job.metrics.{metric} against the job's output in {result.run_dir})"
        )
    checkpoint_dir = Path(result.evidence["checkpoint_dir"])
    uses_checkpoints = any(
        "{checkpoint_dir}" in t for t in [*job.command, *job.resume_args, *job.env.values()]
    )
    files = _checkpoint_files(checkpoint_dir)
    if uses_checkpoints and result.ok and not files:
        problems.append(f"no checkpoint was written to {checkpoint_dir}")
    evidence = {
        "steps": spec.steps,
        "outcome": result.outcome,
        "exits": [e.describe for e in result.exits],
        "stages": stages,
        "metric_steps_seen": len(seen),
        "checkpoint_files": [str(p) for p in files[-5:]],
        "run_dir": str(result.run_dir),
    }
    if not result.ok:
        evidence["stderr_tail"] = result.stderr_tail
    duration = time.monotonic() - started
    if problems:
        return CheckResult("smoke", "failed", "; ".join(problems), evidence, duration, reproduce)
    return CheckResult(
        "smoke",
        "passed",
        f"{spec.steps} steps in {result.duration_s:.1f} s, metrics for every step"
        + (f", {len(files)} checkpoint file(s)" if files else ""),
        evidence,
        duration,
        reproduce,
    )
