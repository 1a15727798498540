"""Pre-emption drills (``fault: preempt``, ``expect: save_and_exit``) on real processes.

The scheduler's notice (SIGTERM; or SIGUSR1 then SIGTERM) goes to every rank of the 2-rank toy
job (tests/data/jobs/toy_train.py, no torch: seconds per drill) after step k, SIGKILL after the
grace. The clean job agrees on a stop step through its barrier, saves atomically and exits;
each planted defect must fail with its cause named first:

* ``ignore``: SIGTERM ignored, the job trains on until the SIGKILL;
* ``save-slow-inplace``: a save on the notice written in place and slower than the grace (torn);
* ``rank0-saves``: the other ranks leave at once while rank 0 waits for them before it saves.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import drills_sharing_a_reference, report_evidence, toy_job
from trainguard.report import CheckResult
from trainguard.session import drill

pytestmark = pytest.mark.timeout(240)

# 60 steps of 0.08 s: the notice goes after step 6 as trainguard reads it, and on a loaded machine
# that read lagged the job by over 2 s (with 30 steps rank 0 had exited before step 6 was read:
# the drill could only say the fault came too late); a job that acts on the notice stops there.
# The resumed run that verifies the save meets no notice: it runs at full speed (--resume-sleep 0;
# its ~50 steps at 0.08 s were 4 s of each drill)

DRILLS = [
    '{name: clean, fault: preempt, steps: 60, after_step: 6, params: {grace: 8}, args: ["--on-notice", "save"]}',
    '{name: slurm, fault: preempt, steps: 60, after_step: 6, params: {style: slurm, grace: 2, lead: 0.5}, args: ["--on-notice", "save"]}',
    '{name: ignored, fault: preempt, steps: 60, after_step: 6, params: {grace: 1}, args: ["--on-notice", "ignore"]}',
    '{name: torn, fault: preempt, steps: 60, after_step: 6, params: {grace: 1}, args: ["--on-notice", "save-slow-inplace"]}',
    '{name: rank0-alone, fault: preempt, steps: 60, after_step: 6, params: {grace: 1}, args: ["--on-notice", "rank0-saves"]}',
    '{name: died, fault: preempt, steps: 60, after_step: 6, params: {grace: 1}, args: ["--on-notice", "die"]}',
]


def job_file(directory: Path) -> Path:
    return toy_job(directory / "preempt.trainguard.yaml", "toy-preempt",
                   "--sleep 0.08 --resume-sleep 0 --sync-dir {run_dir}/sync", DRILLS)


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, CheckResult]:
    """Every drill of the job file once. They differ only in what ``--on-notice`` does, which a
    run never sent a notice never does: one uninterrupted reference run serves them all (each
    drill launching its own was 4 of the module's 15 runs, ~5 s each)."""
    path = job_file(tmp_path_factory.mktemp("preempt"))
    return drills_sharing_a_reference(path, ["clean", "ignored", "torn", "rank0-alone", "died"])


def test_a_job_that_saves_on_the_notice_passes_with_the_times_measured(results: dict[str, CheckResult]) -> None:
    result = results["clean"]
    assert result.status == "passed", result.summary
    timeline = report_evidence(result)["preemption"]
    # notice -> checkpoint complete -> every rank gone, all inside the grace
    assert 0 <= timeline["checkpoint_complete_after_notice_s"] <= timeline["exit_after_notice_s"] < 8
    assert report_evidence(result)["fault_evidence"]["killed_at_grace"] == []
    assert report_evidence(result)["resumed_from_step"] >= report_evidence(result)["injected_after_step"]


def test_a_job_that_ignores_the_notice_is_killed_and_its_lost_progress_counted(results: dict[str, CheckResult]) -> None:
    result = results["ignored"]
    assert result.status == "failed"
    assert "did not exit within the 1 s grace" in result.summary
    assert report_evidence(result)["likely_causes"][0].startswith("no handler for the notice")
    assert report_evidence(result)["fault_evidence"]["killed_at_grace"] == [0, 1]
    # the progress lost is counted from what happened: the last step printed before the kill at
    # the grace, back to the checkpoint the resume started after (0 when, on a loaded machine,
    # the kill landed right after a checkpointed step: it once did)
    last = report_evidence(result)["preemption"]["last_step_before_exit"]
    resumed_from = report_evidence(result)["resumed_from_step"]
    assert last >= report_evidence(result)["injected_after_step"]
    assert report_evidence(result)["lost_steps"] == max(0, last - resumed_from)


def test_a_save_on_the_notice_written_in_place_is_torn(results: dict[str, CheckResult]) -> None:
    result = results["torn"]
    assert result.status == "failed"
    assert report_evidence(result)["likely_causes"][0].startswith("the save on the notice is not atomic")


def test_a_job_that_dies_of_the_notice_is_named_so_not_torn(results: dict[str, CheckResult]) -> None:
    """Python's default for SIGTERM (nanoGPT has no handler): the ranks die at once, save nothing."""
    result = results["died"]
    assert result.status == "failed"
    assert report_evidence(result)["likely_causes"][0].startswith("no handler for the notice: the ranks died of the signal")
    assert report_evidence(result)["died_of_the_notice"] == [0, 1]
    assert report_evidence(result)["fault_evidence"]["killed_at_grace"] == []


def test_rank0_saving_alone_while_the_others_leave_fails_on_agreement(results: dict[str, CheckResult]) -> None:
    result = results["rank0-alone"]
    assert result.status == "failed", result.summary
    assert report_evidence(result)["fault_evidence"]["killed_at_grace"] == [0]
    assert report_evidence(result)["likely_causes"][0].startswith("the ranks do not agree on the step")


@pytest.mark.slow
def test_slurm_style_sends_usr1_first(tmp_path: Path) -> None:
    path = job_file(tmp_path)
    result = drill(str(path), only=["slurm"]).checks[0]
    assert result.status == "passed", result.summary
    assert report_evidence(result)["fault_evidence"]["signals_sent"][0]["signal"] == "SIGUSR1"


@pytest.mark.slow
def test_the_digits_example_saves_on_the_notice_in_both_styles() -> None:
    """examples/digits/drills.trainguard.yaml: train.py's Notice handler passes both drills."""
    example = Path(__file__).resolve().parents[2] / "examples" / "digits" / "drills.trainguard.yaml"
    report = drill(str(example), only=["preempt", "preempt-slurm"])
    assert [c.status for c in report.checks] == ["passed", "passed"], [c.summary for c in report.checks]
