"""The replica invariant on HSDP (docs/invariants.md, "Replicas agree"): FSDP2 on a 2 x 2 device
mesh (replicate x shard) at 4 gloo ranks on CPU (tests/data/jobs/hsdp_train.py). Every parameter
is sharded, so without the mesh nothing would be compared; with each rank's mesh coordinates (the
agent's ``params`` line) each shard is compared between its two replicas. The clean run has no
finding; a drift on one replica (rank 2's shard of ``0.weight`` after step 3) is named at step 4
with its peer, rank 0. Slow: 4 ranks on 2 cores (about 20 s a run)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import report_evidence
from trainguard.session import check

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

JOBS = Path(__file__).resolve().parents[1] / "data" / "jobs"

JOB = f"""\
job:
  name: hsdp
  command: "python {JOBS / 'hsdp_train.py'} --steps {{steps}} --seed {{seed}} {{plant}}"
  world_size: 4
  env: {{OMP_NUM_THREADS: "1"}}
  metrics:
    loss: 'step (?P<step>\\d+) loss (?P<value>\\S+)'
  timeout: 180
  stall_timeout: 120
checks:
  invariants: {{steps: 6}}
"""


@pytest.mark.parametrize("plant", ["none", "replica_drift"])
def test_hsdp_replicas_are_compared_along_the_replicate_dimension(tmp_path: Path, plant: str) -> None:
    path = tmp_path / "trainguard.yaml"
    path.write_text(JOB.replace("{plant}", f"--plant {plant}"))
    (result,) = check(path, report_json=str(tmp_path / "report.json")).checks
    evidence = report_evidence(result)
    (replicas,) = [c for c in evidence["coverage"] if c["invariant"] == "replicas"]
    # 4 parameters, 2 replica groups each, 6 steps (the drift stops at its step)
    assert "4 sharded tensor(s) among the ranks holding the same shard" in replicas["what"], replicas
    if plant == "none":
        assert result.status == "passed" and evidence["findings"] == [], result.summary
        assert replicas["compared"] == 4 * 2 * 6, replicas
        return
    assert result.status == "failed", result.summary
    (first, *_) = evidence["findings"]
    assert (first["invariant"], first["step"], first["name"], first["ranks"]) == ("replicas", 4, "0.weight", [0, 2])
    assert "the parameter differs across replicas" in first["observation"], first
