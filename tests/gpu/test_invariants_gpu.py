"""The invariants check and the SDC drill on CUDA (issue 50, item 2; docs/invariants.md).

cuda_train.py at 2 ranks sharing the one GPU over gloo, on CUDA tensors (NCCL refuses two ranks
on one device), its parameters in bf16 (``--param-dtype bf16``), under DDP:

* clean: the invariants check passes with 0 findings, the replicas compared;
* ``fault: sdc``: one bit of rank 1's bf16 parameter ``0.weight`` (the highest mantissa bit, bit 6)
  flipped at step 4, and one of its reduced gradient ``6.bias``: each caught and named by the
  replica invariant (rank, step, tensor);
* the loss-scaler invariants on a real fp16 ``GradScaler`` run (``--precision fp16``, growth every
  4 clean steps, so it grows and backs off): the scaler compared, 0 findings.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.gpu.gpujobs import make_job
from tests.helpers import drills_sharing_a_reference, report_evidence
from trainguard.report import CheckResult
from trainguard.session import check

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(240)]

GLOO_BF16 = " --backend gloo --param-dtype bf16 --ckpt-every 100"

SDC = """\
  drills:
    - {name: sdc-parameter, fault: sdc, rank: 1, steps: 8, after_step: 3}
    - {name: sdc-gradient, fault: sdc, rank: 1, steps: 8, after_step: 3, params: {target: gradient, name: 6.bias}}
"""


def _invariants(root: Path, tmp: Path) -> CheckResult:
    (result,) = check(root, only=["invariants"], report_json=str(tmp / "report.json")).checks
    return result


def _compared(result: CheckResult) -> dict[str, int]:
    compared = {c["invariant"]: c["compared"] for c in report_evidence(result)["coverage"]}
    print(f"{result.name}: {result.status}; compared {compared}")
    return compared


def test_two_ranks_sharing_the_gpu_over_gloo_in_bf16_have_no_finding(tmp_path: Path) -> None:
    root = make_job(tmp_path, "  invariants: {steps: 8}\n", extra=GLOO_BF16, world_size=2)
    result = _invariants(root, tmp_path)
    compared = _compared(result)
    assert result.status == "passed" and report_evidence(result)["findings"] == [], result.summary
    assert compared["replicas"] > 0, compared


#: drill -> (its target, the word the summary names it by, the tensor)
FLIPS = {"sdc-parameter": ("parameter", "parameter", "0.weight"), "sdc-gradient": ("gradient", "gradient", "6.bias")}


def test_a_bit_flip_in_a_bf16_tensor_on_the_gpu_is_caught_and_named(tmp_path: Path) -> None:
    """Both drills share one uninterrupted reference run (the same job, no flip)."""
    root = make_job(tmp_path, SDC, extra=GLOO_BF16, world_size=2)
    drilled = drills_sharing_a_reference(root / "trainguard.yaml", list(FLIPS))
    for drill, (target, kind, tensor) in FLIPS.items():
        result = drilled[drill]
        print(f"{drill}: {result.status}: {result.summary}")
        flipped = report_evidence(result)["flipped"]
        assert (flipped["rank"], flipped["step"], flipped["target"], flipped["tensor"]) == (1, 4, target, tensor), flipped
        assert flipped["old"] != flipped["new"]
        if target == "parameter":
            assert flipped["bit"] == 6, flipped  # bf16's highest mantissa bit
        assert result.status == "passed", result.summary
        assert f"the replica invariant named it: replicas: {tensor} at step 4: the {kind} differs" in result.summary
        found = report_evidence(result)["replica_findings"][0]
        assert (found["step"], found["name"]) == (4, tensor) and 1 in found["ranks"], found


def test_the_loss_scaler_invariants_on_a_real_fp16_grad_scaler_run(tmp_path: Path) -> None:
    """30 steps: the scale grows every 4 clean steps until it overflows (about step 20) and backs off."""
    root = make_job(tmp_path, "  invariants: {steps: 30}\n", extra=" --precision fp16 --ckpt-every 100")
    result = _invariants(root, tmp_path)
    compared = _compared(result)
    assert result.status == "passed" and report_evidence(result)["findings"] == [], result.summary
    assert compared["scaler"] > 0, compared
