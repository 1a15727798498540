"""The gate's decision: every required check, every capability rule, every threshold."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from tests.helpers import drill_report, make_sizing, profile_evidence
from trainguard.config import GatePolicy
from trainguard.config.records import load_report as load_registered
from trainguard.evidence import Recorded
from trainguard.gate.policy import Capabilities, decide, sizing_of
from trainguard.profiling.sizing import Sizing
from trainguard.report import CheckResult, Report, SkipReason, load_report

NO_ROOT = Capabilities(gpus=0, root=False, ray=True)


def report(*results: CheckResult) -> Report:
    return Report(job="toy", checks=list(results))


def passed(name: str, **evidence: Any) -> CheckResult:
    return CheckResult(name, "passed", f"{name} fine", evidence=Recorded(evidence))


def sizing(efficiency: float = 0.9, cost: float = 100.0, hours: float = 5.0) -> Sizing:
    return make_sizing(efficiency=efficiency, cost=cost, hours=hours, hours_with_failures=hours)


def policy(**data: Any) -> GatePolicy:
    return GatePolicy.model_validate({"require": ["smoke", "canary", "drills"], **data})


def test_everything_passed_promotes_and_says_why() -> None:
    decision = decide(report(passed("smoke"), passed("canary"), passed("drill:kill")), policy(), NO_ROOT)
    assert decision.promoted and decision.reasons == []
    assert any("drill:kill passed" in note for note in decision.notes)


def test_a_failed_required_check_blocks_naming_it() -> None:
    failing = CheckResult("canary", "failed", "loss fell 2% (min 30%)")
    decision = decide(report(passed("smoke"), failing, passed("drill:kill")), policy(), NO_ROOT)
    assert decision.verdict == "block"
    assert decision.reasons == ["canary failed: loss fell 2% (min 30%)"]


def test_a_required_check_that_is_not_configured_blocks_with_the_fix() -> None:
    decision = decide(report(passed("smoke"), passed("canary")), policy(), NO_ROOT,
                      configured=["smoke", "canary"])
    assert decision.verdict == "block"
    assert "required check drills is not configured" in decision.reasons[0]
    assert "gate.require" in decision.reasons[0]


@pytest.mark.parametrize(("rule", "verdict"), [("skip", "promote"), ("block", "block")])
def test_a_skip_for_a_missing_capability_follows_the_policy(rule: str, verdict: str) -> None:
    skipped = CheckResult("drill:disk", "skipped", "a tmpfs could not be mounted",
                          skip_reason=SkipReason.NEEDS_ROOT)
    decision = decide(report(passed("smoke"), passed("canary"), skipped),
                      policy(on_missing={"root": rule}), NO_ROOT)
    assert decision.verdict == verdict
    text = " ".join(decision.notes + decision.reasons)
    assert "gate.on_missing.root" in text


@pytest.mark.parametrize(("reason", "capability"), [
    (SkipReason.NEEDS_ROOT, "root"), (SkipReason.NEEDS_GPU, "gpu"), (SkipReason.NEEDS_RAY, "ray"),
])
def test_the_skip_reason_alone_picks_the_rule(reason: SkipReason, capability: str) -> None:
    """The summary's words play no part: a summary that names root under a GPU reason follows
    gate.on_missing.gpu."""
    skipped = CheckResult("drill:x", "skipped", "root cgroup tmpfs mount ray cuda", skip_reason=reason)
    rules = {"root": "block", "gpu": "block", "ray": "block", capability: "skip"}
    decision = decide(report(passed("smoke"), passed("canary"), skipped), policy(on_missing=rules), NO_ROOT)
    assert decision.promoted, decision.reasons
    assert any(f"gate.on_missing.{capability}" in note for note in decision.notes)


@pytest.mark.parametrize("reason", [None, SkipReason.UNAVAILABLE, SkipReason.JOB_KIND,
                                    SkipReason.NOT_IN_THIS_VERSION])
def test_a_skip_no_capability_explains_blocks_whatever_its_summary_says(reason: SkipReason | None) -> None:
    skipped = CheckResult("drill:x", "skipped", "needs root to mount a tmpfs on the gpu", skip_reason=reason)
    everything = {"root": "skip", "gpu": "skip", "ray": "skip"}
    decision = decide(report(passed("smoke"), passed("canary"), skipped), policy(on_missing=everything), NO_ROOT)
    assert decision.verdict == "block"
    assert "no policy allows this skip" in decision.reasons[0]


def test_the_skip_reason_travels_through_the_report_json_on_skipped_checks_only(tmp_path: Path) -> None:
    skipped = CheckResult("drill:x", "skipped", "no cgroups", skip_reason=SkipReason.NEEDS_ROOT)
    path = tmp_path / "report.json"
    report(passed("smoke"), skipped).write(path)
    entries = load_report(path).to_dict()["checks"]
    assert "skip_reason" not in entries[0] and entries[1]["skip_reason"] == "needs_root"
    assert load_report(path).checks[1].skip_reason is SkipReason.NEEDS_ROOT


def test_fallbacks_that_ran_are_listed() -> None:
    drill = CheckResult("drill:disk", "passed", "fine",
                        drill_report(fault_evidence={"fallback": "disk_full ran in hook mode (not root)"}))
    decision = decide(report(passed("smoke"), passed("canary"), drill), policy(), NO_ROOT)
    assert decision.promoted
    assert decision.fallbacks == ["drill:disk: disk_full ran in hook mode (not root)"]


def test_thresholds_judge_the_recommended_world_size() -> None:
    checks = report(passed("smoke"), passed("canary"), passed("drill:kill"))
    strict = policy(thresholds={"min_scaling_efficiency": 0.8, "max_cost": 500, "max_predicted_hours": 10})
    assert decide(checks, strict, NO_ROOT, sizing=sizing()).promoted
    blocked = decide(checks, strict, NO_ROOT, sizing=sizing(efficiency=0.6, cost=900.0))
    assert blocked.verdict == "block"
    assert any("scaling efficiency 0.60 at 4 GPUs is below the minimum 0.80" in r for r in blocked.reasons)
    assert any("predicted cost 900.00" in r for r in blocked.reasons)
    assert decide(checks, strict, NO_ROOT).verdict == "block"  # thresholds but no sizing


def test_no_recommended_size_blocks_with_the_sizing_reason() -> None:
    checks = report(passed("smoke"), passed("canary"), passed("drill:kill"))
    none = dataclasses.replace(sizing(), recommended=None, candidates=[],
                               recommendation="no world size meets the 2 h deadline")
    decision = decide(checks, policy(), NO_ROOT, sizing=none)
    assert decision.verdict == "block" and "2 h deadline" in decision.reasons[0]


def test_the_sizing_travels_through_the_report_as_json_and_comes_back_equal(tmp_path: Path) -> None:
    profile = CheckResult("profile", "passed", "sized", profile_evidence(sizing(efficiency=0.7)))
    path = tmp_path / "report.json"
    report(passed("smoke"), profile).write(path)
    read = load_registered(path)
    assert sizing_of(read) == sizing(efficiency=0.7)
    assert sizing_of(report(passed("smoke"))) is None


def test_the_policy_rejects_unknown_checks_and_keys() -> None:
    with pytest.raises(ValidationError):
        GatePolicy.model_validate({"require": ["smok"]})
    with pytest.raises(ValidationError):
        GatePolicy.model_validate({"thresholds": {"max_costs": 3}})


@pytest.mark.parametrize("status", ["failed", "error"])
@pytest.mark.parametrize("require", [[], ["smoke"]])
def test_a_failed_check_blocks_whatever_require_names(status: str, require: list[str]) -> None:
    """``require`` says which checks must be there, never which results count: ``require: []``
    beside a FAILED resume in the same report blocks (issue 42: it promoted)."""
    failing = CheckResult("resume", status, "steps 6-10 differ")  # type: ignore[arg-type]
    decision = decide(report(passed("smoke"), failing), GatePolicy.model_validate({"require": require}), NO_ROOT)
    assert decision.verdict == "block"
    assert any(r.startswith(f"resume {status} (not in gate.require") for r in decision.reasons), decision.reasons


def test_checks_outside_require_that_passed_or_skipped_do_not_block() -> None:
    skipped = CheckResult("drill:disk", "skipped", "no tmpfs", skip_reason=SkipReason.NEEDS_ROOT)
    decision = decide(report(passed("smoke"), passed("resume"), skipped),
                      GatePolicy.model_validate({"require": ["smoke"]}), NO_ROOT)
    assert decision.promoted, decision.reasons
