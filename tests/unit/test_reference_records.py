"""The profile's timed run (the run agent's step records off) is the session's shared reference:
checks compare with it as it is, and one that fails against it gets a reference with step
records for its diagnosis (issue 44): launched then, kept from then on, never in a session that
passes (the gate's launches stay what they were)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.distributed.test_sched_job import job_file
from tests.helpers import report_evidence
from trainguard.config import load_config
from trainguard.launch import RunResult
from trainguard.run.request import RunRequest
from trainguard.run.runner import JobRunner
from trainguard.session import check

pytestmark = pytest.mark.timeout(300)

JOBS = Path(__file__).resolve().parents[1] / "data" / "jobs"


def test_a_reference_run_without_step_records_is_shared_and_launched_with_them_for_a_diagnosis(
        tmp_path: Path) -> None:
    """The kept runs are RunResults made here (the profile's, the canary's); the one launch is
    real: the toy job (no torch, so no records either way: the launches are judged here, the
    slow test below reads a torch job's records)."""
    for name in ("toy_train.py", "toy.trainguard.yaml"):
        shutil.copy(JOBS / name, tmp_path / name)
    runner = JobRunner(load_config(tmp_path / "toy.trainguard.yaml"))
    try:
        request = RunRequest.make(steps=2, seed=0, world_size=1)
        timed = RunResult("ok", ["python"], tmp_path / "profile-n1", 1, 0, [], [], 1.0, None)
        runner.scheduling.offer_reference(request, timed, records_off=True)  # as the profile offers it
        assert runner.scheduling.reference(request) is timed  # compared with as it is: nothing launched
        assert runner.launches == []
        recorded = runner.scheduling.recorded(timed)  # a failure to diagnose: its records are needed
        assert recorded is not timed and recorded.ok
        assert [r.label for r in runner.launches] == ["reference-recorded"]
        # kept as the reference from then on: the next check's diagnosis launches nothing more
        assert runner.scheduling.reference(request) is recorded
        assert runner.scheduling.recorded(recorded) is recorded and runner.scheduling.recorded(timed) is timed
        # a reference offered with its records (the canary's run) is its own recorded run
        other = RunRequest.make(steps=3, seed=0, world_size=1)
        canary = RunResult("ok", ["python"], tmp_path / "canary", 1, 0, [], [], 1.0, None)
        runner.scheduling.offer_reference(other, canary)
        assert runner.scheduling.recorded(canary) is canary
        assert len(runner.launches) == 1
    finally:
        runner.close()


@pytest.mark.slow
def test_a_resume_that_fails_against_the_profiles_run_names_its_cause_from_the_step_records(
        tmp_path: Path) -> None:
    """The profile's 2-rank run is the resume's uninterrupted run (same request) and left the
    checkpoint it resumes from; the planted lost scheduler is named from the records of the
    reference launched again with them, not from the checkpoint's inventory."""
    path = job_file(tmp_path, "--plant scheduler_not_saved", checks=(
        "  profile: {steps: 24, world_sizes: [2], warmup_steps: 2}\n  resume: {steps: 24, after_step: 9}\n"))
    report = check(path, only=["profile", "resume"])
    by_name = {c.name: c for c in report.checks}
    assert by_name["profile"].status == "passed", by_name["profile"].summary
    resume = by_name["resume"]
    assert resume.status == "failed", resume.summary
    evidence = report_evidence(resume)
    assert "profile-n2" in evidence["run_dirs"]["reference"]  # it compared with the profile's run
    first = evidence["diagnosis"][0]
    assert first["key"] == "scheduler" and first.get("observed") is True, evidence["diagnosis"]
    assert "never loaded the scheduler's state" in " ".join(first["evidence"])
