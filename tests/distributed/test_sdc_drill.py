"""Silent data corruption drills (``fault: sdc``) on real ranks: tests/data/jobs/sdc.trainguard.yaml.

One bit of one element of rank 1's tensor is flipped at optimizer step 4 of the unmodified 2-rank
DDP job tests/data/jobs/sched_train.py (gloo, CPU), through the start-up hook:

* ``expect: caught`` (the default): a flip in a parameter, the optimizer state or a reduced
  gradient must be named by the replica invariant (rank, step, tensor); one in a module's output
  or a gradient before its reduction, which DDP averages into every replica, by the first
  divergence from the uninterrupted reference run, with why the replicas cannot show it;
* ``expect: detect``: the job's own defence (``--check-replicas``) must report it within
  ``within_steps``; the same job without it fails, saying it has no defence.

The clean twin is the drill's reference: the same job and steps without the flip, on which the
replica invariant compares every tensor and finds nothing.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.helpers import drills_sharing_a_reference, report_evidence
from trainguard.checks.invariants import replica_findings
from trainguard.launch.steps import read_steps
from trainguard.report import CheckResult

pytestmark = pytest.mark.timeout(300)

JOBS = Path(__file__).resolve().parents[1] / "data" / "jobs"


def sdc_drills(tmp: Path, names: list[str]) -> dict[str, CheckResult]:
    path = tmp / "sdc.trainguard.yaml"
    text = (JOBS / "sdc.trainguard.yaml").read_text()
    path.write_text(text.replace("python sched_train.py", f"python {JOBS / 'sched_train.py'}"))
    return drills_sharing_a_reference(path, names)


def _flipped(result: CheckResult, target: str, tensor: str) -> dict[str, Any]:
    flipped = report_evidence(result)["flipped"]
    assert (flipped["rank"], flipped["step"], flipped["target"], flipped["tensor"]) == (1, 4, target, tensor), flipped
    assert flipped["old"] != flipped["new"]
    return flipped


def _named_by_replicas(result: CheckResult, kind: str, tensor: str) -> None:
    assert result.status == "passed", result.summary
    assert f"the replica invariant named it: replicas: {tensor} at step 4: the {kind} differs" in result.summary
    found = report_evidence(result)["replica_findings"][0]
    assert (found["step"], found["name"]) == (4, tensor) and 1 in found["ranks"], found


def test_a_transient_parameter_flip_is_named_and_the_run_without_it_has_no_finding(tmp_path: Path) -> None:
    result = sdc_drills(tmp_path, ["sdc-parameter"])["sdc-parameter"]
    flipped = _flipped(result, "parameter", "0.weight")
    assert (flipped["index"], flipped["bit"]) == (0, 22)  # the default: the first element's top mantissa bit
    assert result.summary.startswith("rank 1's parameter 0.weight: bit 22 of element 0 flipped at step 4")
    _named_by_replicas(result, "parameter", "0.weight")
    # the clean twin: the uninterrupted run of the same job, the same steps, no flip
    clean = read_steps(Path(report_evidence(result)["reference_run_dir"]))
    findings, coverage = replica_findings(clean)
    assert findings == [] and coverage.compared > 0, coverage


@pytest.mark.slow
def test_persistent_optimizer_state_gradient_output_and_the_jobs_own_defence(tmp_path: Path) -> None:
    names = ["sdc-persistent", "sdc-optimizer-state", "sdc-gradient", "sdc-output", "sdc-gradient-before",
             "sdc-detect", "sdc-detect-none"]
    results = sdc_drills(tmp_path, names)
    persistent = results["sdc-persistent"]
    assert _flipped(persistent, "parameter", "0.weight")["bit"] == 30  # exponent: a jump by 1e38
    assert "persistent: the bit stuck from then on" in persistent.summary
    _named_by_replicas(persistent, "parameter", "0.weight")
    _flipped(results["sdc-optimizer-state"], "optimizer_state", "0.weight")
    _named_by_replicas(results["sdc-optimizer-state"], "optimizer state", "0.weight")
    _flipped(results["sdc-gradient"], "gradient", "6.bias")
    _named_by_replicas(results["sdc-gradient"], "gradient", "6.bias")
    for name, target, tensor in (("sdc-output", "output", "6"), ("sdc-gradient-before", "gradient_before_reduction",
                                                                 "0.weight")):
        result = results[name]
        _flipped(result, target, tensor)
        assert result.status == "passed", result.summary
        evidence = report_evidence(result)
        assert evidence["replica_findings"] == []  # averaged into every replica: they stay equal
        assert "the replica invariant cannot show it" in evidence["replicas_blind"]
        assert evidence["first_divergence"]["step"] == 4, evidence["first_divergence"]
        assert "the first divergence from the uninterrupted run names it: the step records first differ at step 4" \
            in result.summary
    detect = results["sdc-detect"]
    assert detect.status == "passed", detect.summary
    assert "the job's defence reported it: rank " in detect.summary and "replicas differ after step 4" in detect.summary
    none = results["sdc-detect-none"]
    assert none.status == "failed" and "the job has no defence against it" in none.summary, none.summary
    assert "the replica invariant named it" in none.summary  # what trainguard saw, said


FSDP2_DRILLS = """
  drills:
    - {name: fsdp-parameter, fault: sdc, rank: 1, steps: 10, after_step: 5}
    - {name: fsdp-gradient-before, fault: sdc, rank: 1, steps: 10, after_step: 5, params: {target: gradient_before_reduction}}
"""


@pytest.mark.slow
def test_on_fsdp2_a_shard_has_no_replica_so_only_the_reference_names_a_flip(tmp_path: Path) -> None:
    """examples/fsdp2 shards every parameter (Shard(dim=0)): the replica invariant compares
    nothing, and the flip is named by the first divergence from the uninterrupted run, saying why."""
    pytest.importorskip("torchdata")
    example = JOBS.parents[2] / "examples" / "fsdp2"
    text = (example / "trainguard.yaml").read_text().replace("cwd: .", f"cwd: {example}")
    path = tmp_path / "fsdp2.trainguard.yaml"
    path.write_text(text[:text.index("checks:")] + "checks:" + FSDP2_DRILLS)
    results = drills_sharing_a_reference(path, ["fsdp-parameter", "fsdp-gradient-before"])
    for name, target, blind in (("fsdp-parameter", "parameter", "is a shard ((Shard(dim=0),))"),
                                ("fsdp-gradient-before", "gradient_before_reduction", "reduce-scatter")):
        result = results[name]
        assert result.status == "passed", result.summary
        evidence = report_evidence(result)
        flipped = evidence["flipped"]
        assert (flipped["rank"], flipped["step"], flipped["target"], flipped["tensor"]) == (1, 6, target, "pos")
        assert evidence["replica_findings"] == [] and blind in evidence["replicas_blind"]
        assert evidence["first_divergence"]["step"] == 6, evidence["first_divergence"]
