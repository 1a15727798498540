"""The promotion gate's policy (``gate:`` in the job file) and its decision.

:func:`decide` reads the results of the checks the gate ran (a :class:`~trainguard.report.Report`),
the sizing of the profile when there is one, and what this machine can do
(:class:`Capabilities`), and returns ``promote`` or ``block`` with every reason. It runs nothing:
running the checks is :func:`trainguard.gate.run.run_gate`'s job, so the decision is a pure
function that is tested on its own. The policy's schema lives with the job file's
(:mod:`trainguard.config.gate`).
"""

from __future__ import annotations

import copy
import os
import shutil
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from trainguard.config import GatePolicy, JobFile, Thresholds, gate_checks
from trainguard.config.checks import CheckSpec
from trainguard.drills.evidence import DrillEvidence, DrillReport, FaultNotSetUp
from trainguard.launch.pace import MIN_WINDOW_S, MIN_WINDOWS, WINDOW, RunPace
from trainguard.profiling.check import ProfileEvidence
from trainguard.profiling.sizing import Sizing, apply_measured_recovery
from trainguard.report import CheckId, CheckResult, Report

__all__ = [
    "Capabilities",
    "Decision",
    "configured_checks",
    "decide",
    "gate_checks_to_run",
    "judge_stragglers",
    "sizing_of",
]


@dataclass(frozen=True)
class Capabilities:
    """What this machine can do, as far as the checks care."""

    gpus: int
    root: bool
    ray: bool

    @classmethod
    def probe(cls) -> Capabilities:
        """Look: GPUs (trainguard._internal.machine), root (euid 0), Ray installed (find_spec)."""
        import importlib.util

        from trainguard._internal.machine import gpu_inventory

        try:
            gpus = gpu_inventory().count
        except Exception:  # no driver, no NVML: no GPUs
            gpus = 0
        return cls(
            gpus=gpus,
            root=hasattr(os, "geteuid") and os.geteuid() == 0,
            ray=importlib.util.find_spec("ray") is not None
            and (shutil.which("ray") is not None or (Path(sys.executable).parent / "ray").exists()),
        )

    def missing(self) -> list[str]:
        """The capabilities this machine lacks, as ``gate.on_missing`` names them."""
        return [name for name, have in (("gpu", self.gpus > 0), ("root", self.root), ("ray", self.ray)) if not have]


@dataclass
class Decision:
    """The gate's verdict and everything behind it."""

    verdict: Literal["promote", "block"]
    reasons: list[str] = field(default_factory=list)  # why it is blocked (empty on promote)
    notes: list[str] = field(default_factory=list)  # what passed, skips allowed by policy
    #: what does not block but should be read: a straggler named without gate.max_straggler_ratio
    warnings: list[str] = field(default_factory=list)
    fallbacks: list[str] = field(default_factory=list)  # every fallback that ran
    recommended_world_size: int | None = None

    @property
    def promoted(self) -> bool:
        """True when the verdict is ``promote``."""
        return self.verdict == "promote"

    def to_dict(self) -> dict[str, Any]:
        """The decision as plain JSON data (the gate report's ``decision``)."""
        return {
            "verdict": self.verdict,
            "reasons": list(self.reasons),
            "notes": list(self.notes),
            "warnings": list(self.warnings),
            "fallbacks": list(self.fallbacks),
            "recommended_world_size": self.recommended_world_size,
        }


def sizing_of(report: Report) -> Sizing | None:
    """The sizing of the report's profile check (None without one, or when it sized nothing),
    its goodput forecast recomputed with what the recover drills and soaks of the same report
    measured (:func:`~trainguard.profiling.sizing.apply_measured_recovery`)."""
    profile = next((c.evidence for c in report.checks if c.name == "profile"), None)
    if not isinstance(profile, ProfileEvidence) or not isinstance(profile.sizing, Sizing):
        return None
    # recomputed on a copy: the report keeps what its profile sized
    return apply_measured_recovery(copy.deepcopy(profile.sizing), report.checks)


def configured_checks(job_file: JobFile) -> list[str]:
    """The gate's names of what ``job_file`` configures: its checks, and ``drills`` for all its
    drills together (what ``gate.require`` names)."""
    names = [n for n, _ in job_file.enabled_checks() if not CheckId.parse(n).is_drill]
    return names + (["drills"] if job_file.checks.drills else [])


def gate_checks_to_run(job_file: JobFile) -> list[tuple[str, CheckSpec]]:
    """What the gate runs: the checks ``job_file`` configures, and ``invariants`` with its
    defaults when the job file does not configure it, records steps, and another of its checks
    makes an uninterrupted run of the same job for it to read (no launch of its own). A finding
    fails it and blocks (as any failed check does); it is not in the default ``gate.require``,
    and a run with no step records makes it a skip (``missing_records: skip``): the job file did
    not ask for it (docs/invariants.md, "In the gate")."""
    from trainguard.checks.invariants_check import InvariantsCheck, shared_reference

    checks = job_file.enabled_checks()
    if job_file.checks.get("invariants") is not None or not job_file.job.record_steps:
        return checks
    spec = InvariantsCheck.model_validate({"missing_records": "skip"})
    if shared_reference(spec, job_file, checks) is None:
        return checks
    return [*checks, ("invariants", spec)]


def _results_for(name: str, checks: Iterable[CheckResult]) -> list[CheckResult]:
    if name == "drills":
        return [c for c in checks if c.check_id.is_drill]
    return [c for c in checks if c.name == name]


def _fallbacks(result: CheckResult) -> list[str]:
    """The named fallback the check's fault ran instead of the real fault (``fault_evidence``)."""
    found = result.evidence.found if isinstance(result.evidence, DrillReport) else None
    if not isinstance(found, DrillEvidence | FaultNotSetUp):
        return []
    fallback = found.fault_evidence.get("fallback")
    return [f"{result.name}: {fallback}"] if isinstance(fallback, str) and fallback else []


def decide(
    report: Report,
    policy: GatePolicy,
    capabilities: Capabilities,
    *,
    sizing: Sizing | None = None,
    configured: Iterable[str] | None = None,
    paces: Sequence[RunPace] | None = (),
) -> Decision:
    """``promote`` when every required check passed (or was skipped for a capability the policy
    lets go) and the sizing meets every threshold; otherwise ``block`` with every reason.
    ``configured`` names the checks the job file configures (a required check it lacks blocks:
    nothing can vouch for it). ``paces``: the judged multi-rank runs' pace; a straggler named in
    one is a warning, or a reason over ``gate.max_straggler_ratio`` (:func:`judge_stragglers`);
    None: the runs were made in another process (pytest-xdist's workers), not judged here.

    ``require`` says which checks must be there, never which results count: a check of the report
    that failed or errored blocks whether it is required or not (``gate: {require: []}`` does not
    promote a FAILED resume)."""
    decision = Decision("promote")
    configured = set(gate_checks() if configured is None else configured)
    judged: set[int] = set()
    for name in policy.require:
        results = _results_for(name, report.checks)
        if not results:
            why = "is not configured in the job file" if name not in configured else "did not run"
            decision.reasons.append(f"required check {name} {why}; add it under `checks:` or drop it from gate.require")
            continue
        judged.update(id(r) for r in results)
        for result in results:
            decision.fallbacks += _fallbacks(result)
            if result.status == "passed":
                decision.notes.append(f"{result.name} passed: {result.summary}")
            elif result.status == "skipped":
                capability = result.skip_reason.capability if result.skip_reason is not None else None
                rule = getattr(policy.on_missing, capability) if capability else "block"
                if rule == "skip":
                    decision.notes.append(f"{result.name} skipped (allowed by gate.on_missing.{capability}): {result.summary}")
                else:
                    where = f"gate.on_missing.{capability} is block" if capability else "no policy allows this skip"
                    decision.reasons.append(f"{result.name} was skipped ({where}): {result.summary}")
            else:
                decision.reasons.append(f"{result.name} {result.status}: {result.summary}")
    for result in report.checks:
        if id(result) not in judged and result.status in ("failed", "error"):
            decision.reasons.append(f"{result.name} {result.status} (not in gate.require, but a failed or "
                                    f"errored check blocks whatever require says): {result.summary}")
    if paces is not None:
        judge_stragglers(paces, policy.max_straggler_ratio, decision)
    elif policy.max_straggler_ratio is not None:
        decision.notes.append("gate.max_straggler_ratio not judged: the runs were made in other processes "
                              "(pytest-xdist workers); `trainguard gate` judges it")
    if sizing is not None:
        _judge_sizing(sizing, policy.thresholds, decision)
    elif any(v is not None for v in policy.thresholds.model_dump().values()):
        decision.reasons.append("gate.thresholds are set but there is no profile sizing to judge them; "
                                "configure checks.profile and target:")
    if decision.reasons:
        decision.verdict = "block"
    return decision


def judge_stragglers(paces: Sequence[RunPace], limit: float | None, decision: Decision) -> None:
    """Each rank named a straggler in ``paces`` (docs/drills.md "Stragglers"): a reason when its
    ratio exceeds ``limit`` (``gate.max_straggler_ratio``), else a warning. With a limit and no
    run judged, nothing was compared: a reason, never a pass."""
    judged = [p for p in paces if p.report.judged]
    for run in judged:
        for rank in run.report.stragglers:
            words = (f"rank {rank.rank} of {run.world_size} is a straggler in {run.label}: "
                     f"{rank.ratio:.2f}x as busy as the busiest other rank (named at step {rank.named_at_step})")
            if limit is not None and rank.ratio > limit:
                decision.reasons.append(f"{words}, over gate.max_straggler_ratio {limit:g}")
            else:
                decision.warnings.append(words + (f", within gate.max_straggler_ratio {limit:g}" if limit is not None
                                                  else "; set gate.max_straggler_ratio to block on it"))
        decision.notes += [f"{run.label}: rank {w.rank} alone busy at {len(w.steps)} steps (single-rank "
                           "work, not a straggler)" for w in run.report.single_rank_work]
    if limit is None:
        return
    if not judged:
        decision.reasons.append(
            f"gate.max_straggler_ratio is set but no multi-rank run was judged (one needs {MIN_WINDOWS} windows "
            f"of {WINDOW}+ steps and {MIN_WINDOW_S:g}+ s); give a multi-rank check or the profile more steps, or "
            "drop gate.max_straggler_ratio")
    elif not any(r.ratio > limit for p in judged for r in p.report.stragglers):
        decision.notes.append(f"gate.max_straggler_ratio {limit:g}: no straggler over it in "
                              f"{len(judged)} judged multi-rank run(s)")


def _judge_sizing(sizing: Sizing, limits: Thresholds, decision: Decision) -> None:
    recommended = sizing.recommended
    decision.recommended_world_size = recommended
    if recommended is None:
        decision.reasons.append(f"the sizing recommends no world size: {sizing.recommendation or 'no reason given'}")
        return
    candidate = sizing.candidate(recommended)
    if candidate is None:
        decision.reasons.append(f"the sizing recommends {recommended} GPUs but has no prediction for them")
        return
    checks = (
        ("min_scaling_efficiency", "efficiency", lambda v, lim: v >= lim, "scaling efficiency {v:.2f} at {n} GPUs is below the minimum {lim:.2f}"),
        ("max_cost", "cost", lambda v, lim: v <= lim, "predicted cost {v:,.2f} at {n} GPUs exceeds the maximum {lim:,.2f}"),
        ("max_predicted_hours", "hours_with_failures", lambda v, lim: v <= lim, "predicted {v:.1f} h at {n} GPUs exceeds the maximum {lim:.1f} h"),
        ("min_goodput", "goodput", lambda v, lim: v >= lim, "predicted goodput {v:.1%} at {n} GPUs is below "
         "gate.thresholds.min_goodput {lim:.1%} (see the sizing's failure inputs and checkpoint interval)"),
    )
    for key, field_name, ok, message in checks:
        limit = getattr(limits, key)
        value = getattr(candidate, field_name)
        if limit is None or value is None:
            continue
        if ok(value, limit):
            shown = f"{value:.2%}" if key == "min_goodput" else f"{value:.3g}"
            decision.notes.append(f"gate.thresholds.{key}: {field_name} {shown} within {limit:g}")
        else:
            decision.reasons.append(message.format(v=value, lim=limit, n=recommended))
