"""trainguard's CUDA paths on a real GPU: a small CUDA job (cuda_train.py) clean and with the
defects GPU jobs have planted, the OOM drill with a real ``CUDA out of memory``, the headroom
search against the device's memory, NVML metrics in the profile and the sizing report, and
the gradient-sync check over NCCL.

Every test is marked ``gpu``: without a GPU the plugin skips it and says why. ``ci/gpu.sh``
runs them on a lent GPU machine in one call (docs/gpu.md).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.gpu.gpujobs import assert_cuda_oom_drill_passed, first_cause, make_job, results
from tests.helpers import report_evidence
from trainguard.session import drill

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]

# checkpoints every 5 steps: a kill after step 12 resumes from step 10's
RESUME = "  determinism: {steps: 20}\n  resume: {steps: 20, after_step: 12%(args)s}\n"


def test_a_cuda_job_is_deterministic_and_resumes_with_its_cuda_rng_state(tmp_path: Path) -> None:
    """Dropout draws from the CUDA generator: the resume is exact only because the checkpoint
    brings its state back, and the final checkpoints (CUDA RNG state included) are equal."""
    by_name = results(make_job(tmp_path, RESUME % {"args": ""}), tmp_path, ["determinism", "resume"])
    assert by_name["determinism"].status == "passed", by_name["determinism"].summary
    resume = by_name["resume"]
    assert resume.status == "passed", resume.summary
    assert report_evidence(resume)["resumed_from_step"] == 10, report_evidence(resume)
    assert "final checkpoints equal" in resume.summary, resume.summary


def test_a_checkpoint_without_the_cuda_rng_state_is_caught_and_named(tmp_path: Path) -> None:
    root = make_job(tmp_path, RESUME % {"args": ', args: "--defect no-cuda-rng"'})
    resume = results(root, tmp_path, ["resume"])["resume"]
    first = first_cause(resume)
    assert first["key"] == "rng", report_evidence(resume)["diagnosis"]
    assert any("CUDA generator" in e for e in first["evidence"]), first


# fp16 autocast with a GradScaler growing every 4 clean steps: it overflows and skips steps from
# about step 20 on, so the scale and its growth tracker at the resume decide what follows
FP16 = "  resume: {steps: 30, after_step: 22, args: \"--precision fp16%(defect)s\"}\n"


@pytest.mark.parametrize("planted", [False, True], ids=["clean", "scaler-not-restored"])
def test_fp16_with_a_grad_scaler_resumes_with_its_state(tmp_path: Path, planted: bool) -> None:
    defect = " --defect scaler-not-restored" if planted else ""
    root = make_job(tmp_path, FP16 % {"defect": defect})
    job = root / "trainguard.yaml"
    # the job prints the scale beside the loss, as fp16 trainers log it
    job.write_text(job.read_text().replace("  metrics:\n", "  metrics:\n    loss_scale: 'step (?P<step>\\d+) .*scale (?P<value>\\S+)'\n"))
    resume = results(root, tmp_path, ["resume"])["resume"]
    if not planted:
        assert resume.status == "passed", resume.summary
        return
    first = first_cause(resume)
    assert first["key"] == "scaler" and first["evidence_strength"] == "decisive", report_evidence(resume)["diagnosis"]


# a CUDA out-of-memory error in rank 0 after step 10 of 40 (0.1 s a step): the job must fail
# within the deadline and resume from step 10's checkpoint to the uninterrupted run's losses
DRILLS = """\
  drills:
    - {name: oom-fraction, fault: oom, params: {mode: gpu}, rank: 0, world_size: 1, steps: 40, after_step: 10, expect: fail_clean, deadline: 60}
"""


def test_the_oom_drill_raises_a_real_cuda_out_of_memory_under_a_memory_fraction(tmp_path: Path) -> None:
    """gpu_limit: fraction caps the rank's caching allocator just above what it holds."""
    root = make_job(tmp_path, DRILLS, extra=" --sleep 0.1")
    assert_cuda_oom_drill_passed(drill(root, report_json=str(tmp_path / "drills.json")), "oom-fraction")
