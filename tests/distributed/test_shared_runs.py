"""Shared runs change the launch count, never the verdict (issue 29).

The session launches each uninterrupted run once for every check that asks for it, keeps the
checkpoints the resume checks start from out of that run (its processes stopped while the
directory is copied) and folds smoke into it. These tests run the toy job (pure Python, fast)
through the same session ``trainguard check`` uses, and count the launches the runner made.
Steps are slow enough (0.1-0.15 s) that a reader lagging a second behind on a loaded machine
still stops the run mid-way (a copy taken after the run's last step is refused, and a run killed).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import report_evidence
from trainguard.config import load_config
from trainguard.config.settings import Settings
from trainguard.report import Report
from trainguard.run.runner import JobRunner
from trainguard.session import run_check, run_in_order
from trainguard.session.plan import make_plan

JOBS = Path(__file__).resolve().parents[1] / "data" / "jobs"

JOB = """\
job:
  name: shared
  command: "python {jobs}/toy_train.py --steps {{steps}} --seed {{seed}} --ckpt-dir {{checkpoint_dir}} --sleep 0.15 {flags}"
  resume_args: "--resume"
  world_size: 1
  env: {{OMP_NUM_THREADS: "1"}}
  metrics:
    loss: 'step (?P<step>\\d+) loss (?P<value>\\S+)'
  timeout: 60
  stall_timeout: 30
checks:
  smoke: {{steps: 4}}
  determinism: {{steps: 16}}
  resume: {{steps: 16, after_step: 6}}
"""


def _job(tmp_path: Path, flags: str = "") -> Path:
    path = tmp_path / "trainguard.yaml"
    path.write_text(JOB.format(jobs=JOBS, flags=flags))
    return path


def _run(path: Path, only: list[str] | None = None) -> tuple[Report, JobRunner]:
    job_file = load_config(path)
    runner = JobRunner(job_file, Settings())
    report = Report(job="shared", job_file=str(path))
    try:
        run_in_order(runner, job_file.enabled_checks(only), report)
    finally:
        runner.close()
    return report, runner


@pytest.mark.resume
@pytest.mark.determinism
def test_the_clean_job_passes_with_every_run_shared_and_the_plan_counts_the_launches(tmp_path: Path) -> None:
    path = _job(tmp_path)
    planned = make_plan(path, Settings())
    report, runner = _run(path)
    by_name = {c.name: c for c in report.checks}
    assert report.status == "passed", [(c.name, c.summary) for c in report.checks]
    # the uninterrupted run of 16 steps, determinism's second run, the run resumed from the
    # checkpoint kept after step 6 of the first: smoke's own two launches and resume's kill are gone
    labels = [r.label for r in runner.launches]
    assert len(labels) == planned.launches == 3, labels
    resume = report_evidence(by_name["resume"])
    assert resume["interruption"]["how"] == "kept", resume
    assert 6 <= resume["killed_after_step"] < 16 and resume["resumed_from_step"] % 5 == 0, resume
    assert "checkpoint kept" in by_name["resume"].summary
    smoke = report_evidence(by_name["smoke"])
    # smoke judged the shared run and the shared resumed run (the same run directories)
    assert smoke["steps"] == 16 and smoke["resume_from"]["stopped_after_step"] == resume["killed_after_step"]
    assert smoke["resume"]["run_dir"] == resume["run_dirs"]["resumed"], (smoke, resume)
    assert smoke["resume"]["first_step"] == resume["resumed_from_step"] + 1


@pytest.mark.determinism
def test_a_defect_only_a_second_uninterrupted_run_shows_is_still_caught(tmp_path: Path) -> None:
    # every launch after the first that does not resume drifts by 1e-4: smoke, the canary and
    # resume read the shared first run (and a resumed one) and cannot see it; determinism must
    # still launch its second run, and fail
    marks = tmp_path / "marks"
    marks.mkdir()
    report, runner = _run(_job(tmp_path, f"--drift-after-first {marks}"))
    by_name = {c.name: c for c in report.checks}
    assert by_name["determinism"].status == "failed", by_name["determinism"].summary
    assert "determinism-repeat" in [r.label for r in runner.launches]


@pytest.mark.resume
def test_a_reference_that_ran_before_the_check_asked_means_a_killed_run_instead(tmp_path: Path) -> None:
    # checks run one by one (as pytest items do): the uninterrupted run was launched before the
    # resume check asked to keep a checkpoint of it, so the check kills a run of its own and says why
    job_file = load_config(_job(tmp_path))
    runner = JobRunner(job_file, Settings())
    try:
        specs = dict(job_file.enabled_checks())
        assert run_check(runner, "determinism", specs["determinism"]).status == "passed"
        resume = run_check(runner, "resume", specs["resume"])
    finally:
        runner.close()
    assert resume.status == "passed", resume.summary
    how = report_evidence(resume)["interruption"]
    assert how["how"] == "killed" and "no uninterrupted run" in how["not_kept"], how
    assert resume.summary.startswith("killed after step")
    assert [r.label for r in runner.launches].count("resume-killed") == 1


def test_a_job_not_given_its_checkpoint_dir_keeps_nothing(tmp_path: Path) -> None:
    path = tmp_path / "trainguard.yaml"
    text = JOB.format(jobs=JOBS, flags="").replace("--ckpt-dir {checkpoint_dir} ", "")
    path.write_text(text[:text.index("  resume:")])
    job_file = load_config(path)
    runner = JobRunner(job_file, Settings())
    request = runner.request_for(job_file.checks.determinism)  # type: ignore[arg-type]
    runner.pool.keep(request, 6, "loss")
    kept, why = runner.pool.kept(request, 6)
    assert kept is None and "{checkpoint_dir}" in why


PREFIX_JOB = """\
job:
  name: prefix
  command: "python {jobs}/toy_train.py --steps {{steps}} --seed {{seed}} --ckpt-dir {{checkpoint_dir}} --sleep 0.1 --ckpt-every 10"
  resume_args: "--resume"
  env: {{OMP_NUM_THREADS: "1"}}
  metrics:
    loss: 'step (?P<step>\\d+) loss (?P<value>\\S+)'
  timeout: 60
  stall_timeout: 30
{independent}
checks:
  canary: {{steps: 20, min_loss_drop: 0.2}}
  determinism: {{steps: {steps}}}
"""


@pytest.mark.determinism
@pytest.mark.parametrize(("independent", "steps", "launches", "prefix"), [
    ("  steps_independent: true", 10, 2, True),  # the canary's first 10 steps, its checkpoint of step 10 kept
    ("", 10, 3, False),  # not declared: a 10-step run may differ from the first 10 of 20 steps
    ("  steps_independent: true", 12, 3, False),  # no checkpoint of step 12 to end on (every 10): launched
])
def test_a_shorter_reference_is_a_longer_runs_first_steps_only_when_the_job_says_so(
    tmp_path: Path, independent: str, steps: int, launches: int, prefix: bool
) -> None:
    path = tmp_path / "trainguard.yaml"
    path.write_text(PREFIX_JOB.format(jobs=JOBS, independent=independent, steps=steps))
    report, runner = _run(path)
    assert report.status == "passed", [(c.name, c.summary) for c in report.checks]
    assert len(runner.launches) == launches, [r.label for r in runner.launches]
    reference = runner.scheduling.kept_reference(runner.request_for(load_config(path).checks.determinism))  # type: ignore[arg-type]
    assert reference is not None and ("prefix_of" in report_evidence(reference)) == prefix
    if prefix:
        assert reference.last_step == steps and reference.checkpoints.parts[-3:] == (
            "kept", f"after-step-{steps + 1}", "checkpoints")
    plan = make_plan(path, Settings())
    assert any("or the first" in r.label for c in plan.checks for r in c.runs) == bool(independent and steps < 20)
