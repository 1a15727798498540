"""Numerics drills (``fault: nan``, ``expect: handle_nonfinite``) on real ranks.

A NaN (or Inf) goes into rank 1's loss or gradients through the start-up hook, inside the
unmodified 2-rank torch DDP job tests/data/jobs/nan_train.py (gloo, CPU), at the step after
``after_step``. The clean jobs pass (stop: every rank raises; skip: every rank skips the step and
goes on); each planted defect must fail with its cause named first and the step and rank named:

* ``--on-nonfinite ignore``: nothing is checked, every later loss is NaN;
* ``--check local-loss``: each rank checks only its own loss, so rank 1's NaN gradient reaches
  every rank through DDP's all-reduce unnoticed.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import drills_sharing_a_reference, report_evidence
from trainguard.report import CheckResult
from trainguard.session import drill

pytestmark = pytest.mark.timeout(240)

JOBS = Path(__file__).resolve().parents[1] / "data" / "jobs"


def nan_job(tmp: Path) -> Path:
    path = tmp / "nan.trainguard.yaml"
    text = (JOBS / "nan.trainguard.yaml").read_text()
    path.write_text(text.replace("python nan_train.py", f"python {JOBS / 'nan_train.py'}"))
    return path


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, CheckResult]:
    """The default drills of the job file, once: a clean job and both planted defects (the clean
    skip policy runs under -m slow). Their jobs differ only in what they do with a non-finite
    value (``--on-nonfinite``, ``--check``), which a run that never meets one never does: one
    uninterrupted reference run serves the three (each launching its own was 2 of the module's 6
    torch DDP runs)."""
    path = nan_job(tmp_path_factory.mktemp("nan"))
    return drills_sharing_a_reference(path, ["nan-stop", "nan-train-on", "nan-spread"])


def _put(result: CheckResult) -> dict:
    put = report_evidence(result)["numerics"]["put_into"]
    # the trigger is pulled when rank 1 prints step 3; the job's output is read with a lag (a
    # step or two of 0.1 s here, more on an overloaded machine)
    assert put["rank"] == 1 and 4 <= put["step"] <= 9, put
    assert "put into rank 1's" in result.summary and f"at step {put['step']}" in result.summary
    return put


def test_a_job_that_stops_on_the_nan_passes(results: dict[str, CheckResult]) -> None:
    result = results["nan-stop"]
    assert result.status == "passed", result.summary
    put = _put(result)
    assert put["via"] == "torch.nn.functional.mse_loss"
    assert "FloatingPointError" in report_evidence(result)["failed_rank_stderr_after_fault"]
    assert report_evidence(result)["exit_after_s"] < 20


@pytest.mark.slow
def test_a_job_that_skips_the_step_goes_on_with_finite_losses(tmp_path: Path) -> None:
    result = drill(str(nan_job(tmp_path)), only=["nan-skip"]).checks[0]
    assert result.status == "passed", result.summary
    put = _put(result)
    numerics = report_evidence(result)["numerics"]
    # rank 1 printed its NaN loss for the skipped step; nothing after it is non-finite
    assert numerics["first_nonfinite"] == {"step": put["step"], "rank": 1, "metric": "loss", "value": "nan"}
    assert numerics["later_nonfinite_points"] == 0 and not numerics["reached_every_rank"]


def test_a_job_that_trains_on_after_the_nan_fails(results: dict[str, CheckResult]) -> None:
    result = results["nan-train-on"]
    assert result.status == "failed"
    put = _put(result)
    assert "the job did not stop: it completed (exit 0)" in result.summary
    assert "it trained on after the non-finite value" in result.summary
    assert report_evidence(result)["likely_causes"][0].startswith("no check for non-finite values")
    numerics = report_evidence(result)["numerics"]
    assert numerics["later_nonfinite_steps"] == list(range(put["step"] + 1, 41))  # every later step of 40


def test_a_nan_gradient_spread_by_the_all_reduce_is_reported_on_every_rank(results: dict[str, CheckResult]) -> None:
    result = results["nan-spread"]
    assert result.status == "failed"
    put = _put(result)
    numerics = report_evidence(result)["numerics"]
    assert numerics["reached_every_rank"] and numerics["reached_ranks"] == [0, 1]
    # rank 1's own loss was finite at the step that took the NaN gradient: nothing noticed
    assert all(e["first_step"] == put["step"] + 1 for e in numerics["nonfinite_by_rank"].values())
    assert "reached every rank" in result.summary
    assert report_evidence(result)["likely_causes"][0].startswith("the check reads only the loss")


@pytest.mark.slow
def test_an_inf_in_the_gradients_is_skipped_by_a_job_that_checks_the_gradient_norm(tmp_path: Path) -> None:
    result = drill(str(nan_job(tmp_path)), only=["inf-grads-skip"]).checks[0]
    assert result.status == "passed", result.summary
    put = _put(result)
    assert (put["target"], put["value"]) == ("grads", "inf")
    assert report_evidence(result)["numerics"]["first_nonfinite"] is None


@pytest.mark.slow
def test_the_unmodified_digits_example_takes_the_nan_and_trains_on() -> None:
    """examples/digits/train.py has no check for non-finite values: the NaN goes in through its
    F.cross_entropy (loss) and its DDP backward (grads), and both drills fail naming it."""
    from trainguard.config import load_config
    from trainguard.drills.driver import make_drill, run_drill
    from trainguard.run.runner import JobRunner

    example = Path(__file__).resolve().parents[2] / "examples" / "digits" / "drills.trainguard.yaml"
    job_file = load_config(example)
    for fields, via in [({"policy": "stop", "deadline": 20}, "torch.nn.functional.cross_entropy"),
                        ({"policy": "skip", "target": "grads"}, "backward (parameter gradients")]:
        spec = make_drill(job_file, {"name": "nan", "fault": "nan", "rank": 1, "world_size": 2, "steps": 14,
                                     "after_step": 4, **fields})
        result = run_drill(JobRunner(job_file), spec)
        assert result.status == "failed", result.summary
        numerics = report_evidence(result)["numerics"]
        assert numerics["put_into"]["via"].startswith(via) and numerics["reached_every_rank"]
