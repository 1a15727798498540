"""The invariants check end to end (docs/invariants.md): tests/data/jobs/sched_train.py at 2 ranks
(gloo, CPU), clean and with a planted defect its loss does not show: ``--plant replica_drift`` (the
last rank alone adds to its first layer's weight after step 5, outside DDP) must fail naming step 6,
the weight and the ranks. One launch of 2 ranks each (3-5 s on 2 cores, 15 s on a busy machine).

The default run catches the replica drift through the gate's default invariants check
(tests/distributed/test_invariants_gate.py, on determinism's run: no launch of its own), so this
file's cases are ``slow``: the drift and the clean job here, and the other plants: a second loss through the module inside
DDP on one rank (``ddp_bypassed``: its gradients at step 5) and a sampler whose ``set_epoch`` is
never called (``set_epoch_never``: the second epoch)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.distributed.test_sched_job import job_file
from tests.helpers import report_evidence
from trainguard.report import CheckResult
from trainguard.session import check


def invariants_of(tmp_path: Path, args: str = "", steps: int = 8) -> CheckResult:
    checks = f"  invariants: {{steps: {steps}}}\n"
    report = check(job_file(tmp_path, args, checks=checks), report_json=str(tmp_path / "report.json"))
    (result,) = report.checks
    return result


@pytest.mark.slow  # the default run's replica drift is caught through the gate (test_invariants_gate.py)
@pytest.mark.parametrize("plant", ["none", "replica_drift"])
def test_a_replica_one_rank_changed_is_caught_and_the_clean_run_passes(tmp_path: Path, plant: str) -> None:
    result = invariants_of(tmp_path, f"--plant {plant}")
    evidence = report_evidence(result)
    compared = {c["invariant"]: c["compared"] for c in evidence["coverage"]}
    assert compared["replicas"] > 0 and compared["data"] > 0, evidence["coverage"]
    if plant == "none":
        assert result.status == "passed" and evidence["findings"] == [], result.summary
        return
    assert result.status == "failed", result.summary
    first = evidence["findings"][0]
    # the parameters before step 6 are those after step 5: the first step the drift shows
    assert (first["invariant"], first["step"], first["name"], first["ranks"]) == ("replicas", 6, "0.weight", [0, 1])
    assert "the parameter differs across replicas" in first["observation"], first
    assert result.summary.startswith("replicas: 0.weight at step 6"), result.summary


@pytest.mark.slow
def test_a_forward_that_bypasses_ddp_on_one_rank_is_named_at_its_step(tmp_path: Path) -> None:
    result = invariants_of(tmp_path, "--plant ddp_bypassed")
    assert result.status == "failed", result.summary
    findings = report_evidence(result)["findings"]
    # the weights agree before step 5; its gradients, unreduced on rank 1, do not
    assert {(f["step"], f["observation"].split(" differs")[0]) for f in findings} == {(5, "the gradient")}, findings
    assert {f["name"] for f in findings} == {"0.weight", "0.bias", "3.weight", "3.bias", "6.weight", "6.bias"}


@pytest.mark.slow
def test_a_sampler_whose_set_epoch_is_never_called_is_named_at_the_second_epoch(tmp_path: Path) -> None:
    # 12 steps an epoch at 2 ranks: the second epoch starts at step 13
    result = invariants_of(tmp_path, "--plant set_epoch_never", steps=16)
    assert result.status == "failed", result.summary
    (found,) = report_evidence(result)["findings"]
    assert (found["invariant"], found["epoch"], found["ranks"]) == ("data", 1, [0, 1]), found
    assert found["name"] == "loader 0 (TensorDataset(384))" and "set_epoch" in found["fix"], found


@pytest.mark.slow
def test_the_profiles_timed_run_is_launched_again_with_records_for_the_invariants(tmp_path: Path) -> None:
    """The profile's 2-rank timed run records no steps and is the session's shared reference of
    that request: the invariants check reads a run launched again with records, never errors on
    the one without them."""
    checks = "  profile: {steps: 12, world_sizes: [2], warmup_steps: 2}\n  invariants: {steps: 12}\n"
    report = check(job_file(tmp_path, "--plant replica_drift", checks=checks), only=["profile", "invariants"])
    result = {c.name: c for c in report.checks}["invariants"]
    assert result.status == "failed", result.summary
    assert "-reference-recorded" in report_evidence(result)["run_dir"], report_evidence(result)["run_dir"]
