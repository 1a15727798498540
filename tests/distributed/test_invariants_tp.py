"""The replica invariant on tensor parallelism (docs/invariants.md, "Replicas agree"), on
tests/data/jobs/tp_train.py over gloo on CPU, 6 steps each:

* DTensor TP at 2 ranks (a 1-D ``tp`` mesh): the row-parallel layer's bias and the head are
  ``Replicate()``, compared across both ranks; the shards are not replicas;
* DTensor TP under torch's ``replicate`` on the ``dp`` dimension of a 2 x 2 mesh: every shard is
  compared among its two replicas (the ``Replicate`` dimension), the whole tensors on all 4 ranks;
* DTensor TP under DDP on the ``dp`` mesh (torch's ``_pre_dp_module_transform`` recipe: the
  parameters are plain local shards, the module holds other objects over them) and Megatron-style
  plain-tensor TP under ``DistributedDataParallel(process_group=dp group)``: compared within each
  DDP process group (the ``params`` line's ``dp_ranks``), named by the module's names.

A clean run has no finding; a drift on the last rank after step 3 is named at step 4 with the
tensor and its replicas. Slow: 2 to 4 ranks on 2 cores (20 to 50 s a run)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import report_evidence
from trainguard.session import check

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

JOBS = Path(__file__).resolve().parents[1] / "data" / "jobs"

JOB = f"""\
job:
  name: tp
  command: "python {JOBS / 'tp_train.py'} --steps {{steps}} --seed {{seed}} {{args}}"
  world_size: {{world}}
  env: {{OMP_NUM_THREADS: "1"}}
  metrics:
    loss: 'step (?P<step>\\d+) loss (?P<value>\\S+)'
  timeout: 240
  stall_timeout: 180
checks:
  invariants: {{steps: 6}}
"""

#: (world, the job's arguments, what the replicas' coverage says, tensor-steps compared)
LAYOUTS = {
    "tp2": (2, "--tp dtensor", "tensor-steps compared across 2 ranks", 3 * 6),
    "tp_replicate": (4, "--tp dtensor --dp fsdp",
                     "3 sharded tensor(s) among the ranks holding the same shard", (3 + 3 * 2) * 6),
    "tp_ddp": (4, "--tp dtensor --dp ddp", "6 tensor(s) within their data-parallel groups", 6 * 2 * 6),
    "plain_ddp": (4, "--tp plain", "6 tensor(s) within their data-parallel groups", 6 * 2 * 6),
}

#: (layout, plant) -> (the tensor named at step 4, the ranks named)
PLANTED = {
    ("tp2", "replica_drift"): ("2.bias", [0, 1]),
    ("tp_replicate", "replica_drift"): ("2.bias", [3]),  # whole on all 4 ranks: the lone rank
    ("tp_replicate", "shard_drift"): ("0.weight", [1, 3]),
    ("tp_ddp", "shard_drift"): ("0.weight", [1, 3]),
    ("plain_ddp", "shard_drift"): ("up.weight", [1, 3]),
    ("plain_ddp", "replica_drift"): ("down_bias", [1, 3]),
}

CASES = [(layout, "none") for layout in LAYOUTS] + list(PLANTED)


@pytest.mark.parametrize(("layout", "plant"), CASES, ids=[f"{a}-{b}" for a, b in CASES])
def test_tensor_parallel_replicas_are_compared_and_a_drift_is_named(tmp_path: Path, layout: str, plant: str) -> None:
    world, args, what, compared = LAYOUTS[layout]
    path = tmp_path / "trainguard.yaml"
    path.write_text(JOB.replace("{args}", f"{args} --plant {plant}").replace("{world}", str(world)))
    (result,) = check(path, report_json=str(tmp_path / "report.json")).checks
    evidence = report_evidence(result)
    (replicas,) = [c for c in evidence["coverage"] if c["invariant"] == "replicas"]
    assert what in replicas["what"], replicas
    if plant == "none":
        assert result.status == "passed" and evidence["findings"] == [], result.summary
        assert replicas["compared"] == compared, replicas
        return
    assert result.status == "failed", result.summary
    name, ranks = PLANTED[layout, plant]
    (first, *_) = evidence["findings"]
    assert (first["invariant"], first["step"], first["name"], first["ranks"]) == ("replicas", 4, name, ranks), first
    assert "the parameter differs across replicas" in first["observation"], first
