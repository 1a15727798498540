"""Jobs that count steps from 0 (nanoGPT's `iter 0`): a restart that begins again from scratch
prints step 0, not step 1. Found on nanoGPT: the recover drill, the soak and the resume check
passed such a restart as a recovery ("resumed from step -1"), because a fixed-seed job rerun from
scratch matches the uninterrupted run exactly. Each must fail the planted job that ignores its
checkpoint, and pass the one that resumes (tests/data/jobs/zero_based_train.py, no torch)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import report_evidence
from trainguard.config import load_config
from trainguard.drills import run_drill
from trainguard.run.runner import JobRunner
from trainguard.session import run_check

pytestmark = pytest.mark.timeout(180)

SCRIPT = Path(__file__).resolve().parents[1] / "data" / "jobs" / "zero_based_train.py"


def _job(tmp_path: Path, flags: str) -> JobRunner:
    path = tmp_path / "zero.trainguard.yaml"
    path.write_text(
        "job:\n  name: zero\n"
        f'  command: "python {SCRIPT} --steps {{steps}} --out {{checkpoint_dir}} --seed {{seed}} {flags}"\n'
        '  resume_args: "--resume"\n  world_size: 1\n'
        "  metrics: {loss: 'iter (?P<step>\\d+): loss (?P<value>\\S+)'}\n"
        "  timeout: 60\n  stall_timeout: 10\n"
        "checks:\n  resume: {steps: 12, after_step: 7}\n  drills:\n"
        "    - {name: kill, fault: kill_rank, steps: 14, after_step: 7}\n"
        "    - {name: chaos, fault: soak, steps: 24, params: {faults: 2, min_gap: 5, seed: 3}}\n")
    return JobRunner(load_config(path))


@pytest.mark.parametrize("planted", [False, True], ids=["resumes", "ignores-its-checkpoint"])
def test_a_restart_from_step_0_is_caught_and_a_real_resume_passes(tmp_path: Path, planted: bool) -> None:
    runner = _job(tmp_path, "--ignore-ckpt" if planted else "")
    drills = {d.name: d for d in runner.job_file.checks.drills}
    resume = run_check(runner, "resume", runner.job_file.checks.resume)
    kill = run_drill(runner, drills["kill"])
    soak = run_drill(runner, drills["chaos"])
    if not planted:
        for result in (resume, kill, soak):
            assert result.status == "passed", result.summary
        assert report_evidence(resume)["resumed_from_step"] >= 6
        assert report_evidence(soak)["measured"]["checkpoint_every_steps"] is None  # `ckpt.json`: no step
        assert report_evidence(soak)["measured"]["forecast"]["inputs"]["lost_per_fault"].startswith("the mean measured")
        return
    assert resume.status == "failed" and "started again from step 0" in resume.summary, resume.summary
    assert report_evidence(resume)["resumed_from_step"] == 0
    assert kill.status == "failed" and "began again at step 0" in kill.summary, kill.summary
    assert all(r["resumed_from_step"] >= 0 for r in report_evidence(kill)["resumes"])
    assert soak.status == "failed" and "began again at step 0" in soak.summary, soak.summary


def test_a_restart_that_crashes_is_told_in_its_own_words(tmp_path: Path) -> None:
    """A kill before the first checkpoint of a job that cannot start a resume without one (as
    nanoGPT): the drill names the restart's own error, not the injected SIGKILL."""
    runner = _job(tmp_path, "--strict-resume")
    spec = runner.job_file.checks.drills[0].model_copy(update={"after_step": 1})
    result = run_drill(runner, spec)
    assert result.status == "failed", result.summary
    assert "did not recover" in result.summary and "FileNotFoundError" in result.summary, result.summary
    assert "the last attempt ended: rank 0 died of the injected SIGKILL" not in result.summary


def test_smoke_reads_a_job_that_prints_steps_0_through_n_minus_1(tmp_path: Path) -> None:
    """run_clm_no_trainer.py prints `epoch 0` .. `epoch N-1` for N epochs: smoke once said "no
    line for step N", and a resume that went on from step 0's checkpoint "started again"."""
    path = tmp_path / "zero.trainguard.yaml"
    path.write_text(
        "job:\n  name: zero-exclusive\n"
        f'  command: "python {SCRIPT} --steps {{steps}} --out {{checkpoint_dir}} --seed {{seed}} --exclusive"\n'
        '  resume_args: "--resume"\n  world_size: 1\n'
        "  metrics: {loss: 'iter (?P<step>\\d+): loss (?P<value>\\S+)'}\n"
        "  timeout: 60\n  stall_timeout: 10\n"
        "checks:\n  smoke: {steps: 8}\n")
    runner = JobRunner(load_config(path))
    smoke = run_check(runner, "smoke", runner.job_file.checks.smoke)
    assert smoke.status == "passed", smoke.summary
