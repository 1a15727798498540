"""``trainguard gate`` runs the invariants check by default (issue 45) on the run another check
makes: sched_train.py at 2 ranks under the determinism check alone (its two launches). A silent defect the loss does
not show (the last rank changes its first layer's weight outside DDP after step 5) blocks,
named at step 6; the clean job promotes with the invariants passed. Neither launches anything
for it: the gate's cost line says the seconds it read determinism's first run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.distributed.test_sched_job import job_file
from trainguard.cli import main

pytestmark = pytest.mark.timeout(240)

CHECKS = "  determinism: {steps: 8}\ngate:\n  require: [determinism]\n"


def gate(tmp_path: Path, args: str) -> tuple[int, dict, dict]:
    code = main(["gate", str(job_file(tmp_path, args, checks=CHECKS)), "-q"])
    data = json.loads((tmp_path / ".trainguard" / "gate" / "latest.json").read_text())
    checks = {c["name"]: c for c in data["checks"]}
    assert list(checks) == ["determinism", "invariants"], list(checks)
    assert data["cost"]["launches"] == 2 and set(data["cost"]["reads"]) == {"invariants"}, data["cost"]
    assert checks["invariants"]["evidence"]["shared_run"]
    return code, data, checks


def test_the_gate_blocks_a_silent_replica_drift_by_default(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, data, checks = gate(tmp_path, "--plant replica_drift")
    assert code == 1 and data["verdict"] == "block"
    assert checks["determinism"]["status"] == "passed"  # the drift is the same in both runs
    assert checks["invariants"]["status"] == "failed"
    first = checks["invariants"]["evidence"]["findings"][0]
    # the parameters before step 6 are those after step 5: the first step the drift shows
    assert (first["invariant"], first["step"], first["name"], first["ranks"]) == ("replicas", 6, "0.weight", [0, 1])
    assert "the parameter differs across replicas" in first["observation"], first
    assert any(r.startswith("invariants failed") for r in data["decision"]["reasons"]), data["decision"]
    assert "invariants failed" in capsys.readouterr().out


@pytest.mark.slow  # the default run's clean gates are test_gate_run.py's (the invariants skipped: no torch)
def test_the_clean_job_promotes_with_the_invariants_passed(tmp_path: Path) -> None:
    code, data, checks = gate(tmp_path, "")
    assert code == 0 and data["verdict"] == "promote", data["decision"]
    assert checks["invariants"]["status"] == "passed", checks["invariants"]["summary"]
