"""The ``profile`` check: profile, size, compare, write the reports, return a CheckResult.

The check fails when a world size did not run (or printed too few steps to time) or when a
``compare`` expression found a regression against this machine's latest profile baseline.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from trainguard.checks.context import CheckContext
from trainguard.config import ProfileCheck
from trainguard.config.problems import one_process_problems, profile_problems
from trainguard.config.registry import Check, JobFacts, PlanContext, Run
from trainguard.evidence import UNSET, Evidence, Unset
from trainguard.profiling.compare import parse_regressions
from trainguard.profiling.measure import batch_size_for
from trainguard.profiling.profile import Profile, run_profile
from trainguard.profiling.render import write_reports
from trainguard.profiling.sizing import Sizing
from trainguard.report import CheckResult, CheckStatus
from trainguard.run.runner import JobRunner
from trainguard.tracking import tracker_of

__all__ = ["PROFILE", "ProfileEvidence", "profile_job", "run_profile_check", "summarise"]


@dataclass
class ProfileEvidence(Evidence):
    """The profile check's evidence (docs/profiling.md); the reports hold the rest."""

    report_html: str
    report_json: str
    #: how throughput scales, in words
    scaling: str | None
    #: world size -> samples (or tokens) per second, and median step seconds
    throughput_sps: dict[int, float | None]
    p50_step_s: dict[int, float]
    run_dir: str
    #: the regressions found against the baseline, described
    compare: list[str] | Unset = UNSET
    headroom: dict[str, Any] | Unset = UNSET
    recommendation: str | Unset = UNSET
    #: the sizing report (the gate judges its thresholds on this)
    sizing: Sizing | Unset = UNSET
    #: why the first failed world size failed
    reason: str | Unset = UNSET


def profile_job(
    runner: JobRunner,
    spec: ProfileCheck,
    *,
    compare: Sequence[str] = (),
    save: bool | None = None,
    world_sizes: list[int] | None = None,
    headroom: bool | None = None,
) -> tuple[Profile, dict[str, str]]:
    """Run the profile (``spec.compare`` plus ``compare`` expressions), write every report.
    ``save`` defaults to the ``save_baseline`` setting; ``headroom=False`` skips the memory
    headroom search of ``spec.headroom``. Bad expressions raise before any run."""
    checks = parse_regressions([*spec.compare, *compare])
    job_file = runner.job_file
    profile = run_profile(
        runner, spec, target=job_file.target, compare=checks,
        save=runner.settings.save_baseline if save is None else save, world_sizes=world_sizes,
        headroom=headroom,
    )
    runner.pool.state.timed_runs_done()  # the untimed runs of later checks may start while it writes its reports
    data = profile.to_dict()
    data["check_curves"] = [
        {"label": c.label, "world_size": c.world_size, "metric": c.metric, "outcome": c.outcome,
         "values": {str(k): v for k, v in c.values.items()}}
        for c in runner.curves if not c.label.startswith(("profile", "headroom"))
    ]
    paths = write_reports(data, profile.run_dir, job_file.state_dir / "profile")
    tracker = tracker_of(runner)
    if tracker is not None:
        handle = tracker.check_run or tracker.session
        if handle is not None:
            for kind in ("json", "markdown", "html"):
                tracker.log_artifact(handle, paths[kind], "profile")
    return profile, paths


def summarise(profile: Profile) -> tuple[CheckStatus, str]:
    """(status, one line) of a profile."""
    parts = []
    if profile.phrase:
        parts.append(profile.phrase)
    for s in profile.ok_sizes:
        if len(profile.ok_sizes) == 1 and s.step is not None:
            parts.append(f"{s.throughput_sps:.1f} {profile.unit}, p50 step {s.step.p50_s * 1000:.1f} ms")
    if profile.sizing is not None:
        rec = profile.sizing.recommended
        unit = "GPU(s)" if profile.device == "gpu" else "rank(s)"
        parts.append(f"sizing: {rec} {unit} recommended" if rec else "sizing: no size meets the target")
    if profile.headroom is not None and not profile.headroom.failed:
        parts.append(profile.headroom.summary())
    if profile.device == "cpu":
        parts.append("measured on CPU")
    problems = [f"world size {s.world_size} {s.outcome}: {s.reason}" for s in profile.failed_sizes]
    problems += [r.describe() for r in profile.regressed]
    if profile.headroom is not None and profile.headroom.failed:
        problems.append(profile.headroom.summary())
    if problems:
        return "failed", "; ".join(problems)
    return "passed", "; ".join(parts) or "profiled"


def run_profile_check(ctx: CheckContext[ProfileCheck]) -> CheckResult:
    """The profile check on the runner of the context's pool; it says when its timed runs are
    done through the session state (the untimed runs of later checks may start then)."""
    return ctx.drive(_run_profile_check)


def _run_profile_check(runner: JobRunner, spec: ProfileCheck) -> CheckResult:
    """The registry entry of ``checks.profile``."""
    profile, paths = profile_job(runner, spec)
    status, summary = summarise(profile)
    evidence = ProfileEvidence(
        report_html=paths["html"], report_json=paths["json"], scaling=profile.phrase,
        throughput_sps={s.world_size: s.throughput_sps for s in profile.ok_sizes},
        p50_step_s={s.world_size: s.step.p50_s for s in profile.ok_sizes if s.step},
        run_dir=str(profile.run_dir),
    )
    if profile.regressions:
        evidence.compare = [r.describe() for r in profile.regressions]
    if profile.headroom is not None:
        evidence.headroom = {k: v for k, v in profile.headroom.to_dict().items() if k not in ("probes", "notes")}
    if profile.sizing is not None:
        evidence.recommendation = profile.sizing.recommendation
        evidence.sizing = copy.deepcopy(profile.sizing)  # the report's: what the profile sized
    if profile.failed_sizes:
        evidence.reason = profile.failed_sizes[0].reason
    result = CheckResult("profile", status, summary, evidence)
    if status == "failed":
        result.reproduce = f"trainguard profile {runner.job_file.path}"
    return result


def _profile_runs(spec: ProfileCheck, ctx: PlanContext) -> tuple[list[Run], str]:
    job_file = ctx.job_file
    # at the job's own batch size a timed run is the uninterrupted run of its request, shared
    runs = [Run(f"timed, {n} rank(s)", n, reference=batch_size_for(job_file, spec, n) in (None, job_file.job.batch_size))
            for n in spec.world_sizes]
    if spec.headroom is not None:
        runs += [Run(f"memory probe {i + 1}", spec.headroom.world_size, steps=spec.headroom.steps)
                 for i in range(spec.headroom.max_probes)]
    return runs, "step times and scaling per world size" + (
        "; the headroom search makes at most max_probes probes" if spec.headroom else "")


def _profile_requires(spec: ProfileCheck, facts: JobFacts) -> list[tuple[str, str]]:
    asks = [("checks.profile.world_sizes", max(spec.world_sizes))]
    if spec.headroom is not None:
        asks.append(("checks.profile.headroom.world_size", spec.headroom.world_size))
    return profile_problems(facts.job_file, spec, set(facts.used)) + one_process_problems(facts, asks)


#: the profile: step times, throughput, memory and scaling per world size, the sizing
#: (docs/profiling.md); it measures speed, so nothing runs beside it. A headroom search makes its
#: pytest item ``slow`` (its probes take minutes)
PROFILE: Check[ProfileCheck] = Check(
    "profile", ProfileCheck, run=run_profile_check, runs=_profile_runs, requires=_profile_requires, first=True,
    marks=lambda spec: [("profile", ())] + ([("slow", ())] if spec.headroom is not None else []),
    evidence=(ProfileEvidence,),
)
