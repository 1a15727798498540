"""The invariants check end to end (docs/invariants.md): tests/data/jobs/sched_train.py at 2 ranks
(gloo, CPU) for 8 steps, clean and with ``--plant replica_drift`` (the last rank alone adds to its
first layer's weight after step 5, outside DDP). The clean run passes with every invariant compared
and no finding; the planted one fails naming step 6, the weight and the ranks, while its loss still
falls. One real launch of 2 ranks each (~5 s on 2 quiet cores, 15 s on a busy one). The default
run keeps the planted case; the clean job's invariants are checked there by
tests/distributed/test_sched_job.py's clean test, on determinism's run (no launch of its own), so
this file's clean case is ``slow``."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.distributed.test_sched_job import job_file
from tests.helpers import report_evidence
from trainguard.report import CheckResult
from trainguard.session import check

CHECKS = "  invariants: {steps: 8}\n"


def invariants_of(tmp_path: Path, args: str = "") -> CheckResult:
    report = check(job_file(tmp_path, args, checks=CHECKS), report_json=str(tmp_path / "report.json"))
    (result,) = report.checks
    return result


@pytest.mark.ddp
@pytest.mark.parametrize("plant", [pytest.param("none", marks=pytest.mark.slow), "replica_drift"])
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
