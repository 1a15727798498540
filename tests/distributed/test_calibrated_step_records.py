"""``trainguard calibrate``'s per-tensor spreads (``step_spreads``) end to end, on a small torch job
that is correct but not bitwise deterministic (tests/data/jobs/nondet_torch.py: it accumulates
its micro-batches' gradients in an order drawn from ``os.urandom``, so two runs of one seed differ
in the last bits of every gradient, weight and loss).

Calibrated (3 runs of the seed, 2 more seeds), the clean job resumes within the calibrated spread;
with its checkpoint leaving out the scheduler (planted in the script: the job file, and so the
calibration keyed to it, unchanged) the resume fails and names the scheduler first from the step
records, compared through the calibrated spread: the weights' noise is within it, the lr is not.
About 10 launches of torch: ``slow``."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import report_evidence
from trainguard.checks.calibration import find_calibration
from trainguard.checks.statefiles import JobKey
from trainguard.config import load_config
from trainguard.run.request import RunRequest
from trainguard.session import check
from trainguard.session.calibrate import calibrate

pytestmark = [pytest.mark.slow, pytest.mark.resume, pytest.mark.timeout(600)]

SCRIPT = Path(__file__).resolve().parents[1] / "data" / "jobs" / "nondet_torch.py"
JOB = """\
job:
  name: nondet-torch
  command: "python train.py --steps {steps} --seed {seed} --ckpt-dir {checkpoint_dir}"
  resume_args: "--resume"
  env: {OMP_NUM_THREADS: "1"}
  metrics:
    loss: 'step (?P<step>\\d+) loss (?P<value>\\S+)'
  timeout: 90
  stall_timeout: 60
checks:
  resume: {steps: 24, after_step: 9}
"""


def test_a_calibrated_noisy_torch_job_resumes_within_its_spread_and_a_lost_scheduler_is_named(
        tmp_path: Path) -> None:
    path, script = tmp_path / "trainguard.yaml", tmp_path / "train.py"
    path.write_text(JOB)
    script.write_text(SCRIPT.read_text())
    (entry,) = calibrate(path, runs=3, only=["resume"])
    found, _ = find_calibration(tmp_path / ".trainguard", RunRequest.make(steps=24, seed=0, world_size=1),
                                JobKey.of(load_config(path)))
    assert found is not None and found.path == Path(entry["path"]) and found.step_spreads is not None
    spreads = found.step_spreads.spreads
    assert found.step_spreads.steps == list(range(1, 25))
    # every weight and gradient of the MLP recorded, and the runs of one seed differ in them
    assert set(spreads["parameter"]) == {"0.weight", "0.bias", "2.weight", "2.bias"}, spreads["parameter"]
    assert max(spreads["gradient"]["0.weight"]) > 0 and max(spreads["parameter"]["0.weight"]) > 0

    clean = check(path, only=["resume"]).checks[0]
    assert clean.status == "passed", clean.summary
    assert "calibration" in clean.summary, clean.summary  # passed within the calibrated band

    text = SCRIPT.read_text()
    assert text.count('default="none")') == 1, "nondet_torch.py changed; update this test"
    script.write_text(text.replace('default="none")', 'default="scheduler_not_saved")'))
    planted = check(path, only=["resume"]).checks[0]
    assert planted.status == "failed", planted.summary
    evidence = report_evidence(planted)
    first = evidence["diagnosis"][0]
    assert first["key"] == "scheduler" and first.get("observed") is True, evidence["diagnosis"]
    said = " ".join(first["evidence"])
    assert "never loaded the scheduler's state" in said and "its checkpoint holds none" in said, said
    # compared as whole runs within the calibrated spread: the first quantity outside it is the lr,
    # at the second resumed step (the first ran with the lr the restored optimizer carried)
    divergence = evidence["first_divergence"]
    assert divergence["kind"] == "lr" and divergence["step"] == evidence["resumed_from_step"] + 2, divergence
