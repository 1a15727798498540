"""``{latest_checkpoint}``: where a job file may use it, what a resumed launch fills in (afresh for
every restart), the resume check when there is nothing to resume from, and reproduce lines that
run as printed.

The job is ``tests/data/jobs/trainer_dirs.trainguard.yaml``: a pure-Python script that saves and
resumes ``checkpoint-N/`` directories as the Hugging Face Trainer does and prints the path it
resumed from.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from tests.helpers import check_context, report_evidence
from trainguard.checks.resume import run_resume_check
from trainguard.config import ResumeCheck, load_config, parse_config
from trainguard.config.settings import Settings
from trainguard.errors import ConfigError
from trainguard.run.request import RunRequest
from trainguard.run.runner import JobRunner, LaunchOptions

JOBS = Path(__file__).resolve().parents[1] / "data" / "jobs"


@pytest.fixture
def job(tmp_path: Path) -> Path:
    """A private copy of the job (its run directories land next to the job file)."""
    shutil.copy(JOBS / "trainer_dirs_train.py", tmp_path)
    shutil.copy(JOBS / "trainer_dirs.trainguard.yaml", tmp_path)
    return tmp_path / "trainer_dirs.trainguard.yaml"


def runner_for(job: Path, extra: str = "") -> JobRunner:
    if extra:
        job.write_text(job.read_text().replace("--output-dir {checkpoint_dir}",
                                               "--output-dir {checkpoint_dir} " + extra))
    return JobRunner(load_config(job), Settings())


def checkpoint(directory: Path, step: int, *, complete: bool = True) -> Path:
    folder = directory / f"checkpoint-{step}"
    folder.mkdir(parents=True)
    (folder / "weights.json").write_text(json.dumps({"w": 1.0 / step}))
    if complete:
        (folder / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    return folder


JOB_TEXT = """\
job:
  name: x
  command: "python t.py --steps {{steps}} --out {{checkpoint_dir}} {command}"
  resume_args: "{resume}"
  metrics: {{loss: 'step (?P<step>\\\\d+) loss (?P<value>\\\\S+)'}}
checks:
  resume: {{steps: 8, after_step: 5{args}}}
"""


def test_the_placeholder_belongs_in_resume_args(tmp_path: Path) -> None:
    ok = parse_config(JOB_TEXT.format(command="", resume="--resume_from_checkpoint {latest_checkpoint}", args=""))
    assert ok.job.resume_args == ["--resume_from_checkpoint", "{latest_checkpoint}"]
    for command, args, key in (("--init {latest_checkpoint}", "", "job.command[7]"),
                               ("", ", args: '--from {latest_checkpoint}'", "checks.resume.args[1]")):
        with pytest.raises(ConfigError) as info:
            parse_config(JOB_TEXT.format(command=command, resume="--resume", args=args))
        message = str(info.value)
        assert key in message
        assert "only a resumed run has a latest checkpoint" in message
        assert 'resume_args: "--resume_from_checkpoint {latest_checkpoint}"' in message


def test_a_resumed_launch_gets_the_newest_complete_checkpoint(job: Path, tmp_path: Path) -> None:
    runner = runner_for(job)
    request = RunRequest.make(steps=6, seed=0, world_size=1)
    ckpts = tmp_path / "ckpts"
    checkpoint(ckpts, 2)
    four = checkpoint(ckpts, 4)
    checkpoint(ckpts, 6, complete=False)  # killed while saving: no trainer_state.json
    result = runner.run(request, label="resumed", resume=True, checkpoint_dir=ckpts)
    assert result.ok, result.reason
    assert report_evidence(result)["resumed_from"] == str(four)
    assert sorted(result.trajectory("loss")) == [5, 6]  # it went on after step 4
    # clean: nothing to resume from -> a fresh start without resume_args, and it says so
    empty = tmp_path / "empty"
    fresh = runner.run(request, label="fresh", resume=True, checkpoint_dir=empty)
    assert fresh.ok and sorted(fresh.trajectory("loss")) == [1, 2, 3, 4, 5, 6]
    assert report_evidence(fresh)["resumed_from"].startswith(f"nothing: no complete checkpoint under {empty}")


def test_every_restart_resumes_from_the_checkpoint_newest_then(job: Path) -> None:
    runner = runner_for(job, "--die-at 5 --die-at 7")
    request = RunRequest.make(steps=8, seed=0, world_size=1)
    run = runner.supervise(request, label="restarts", options=LaunchOptions(max_restarts=2, backoff_s=0.0))
    assert run.ok and run.restarts == 2
    resumed = [Path(report_evidence(a)["resumed_from"]).name for a in run.attempts[1:]]
    assert resumed == ["checkpoint-4", "checkpoint-6"]
    assert "resumed_from" not in report_evidence(run.attempts[0])


def test_resume_check_resumes_from_the_latest_checkpoint(job: Path) -> None:
    runner = runner_for(job)
    result = run_resume_check(check_context(runner, "resume", ResumeCheck(steps=8, after_step=5)))
    assert result.status == "passed", result.summary
    resumed_from = Path(report_evidence(result)["resumed_from_checkpoint"]).name
    assert resumed_from in ("checkpoint-4", "checkpoint-6")
    assert result.reproduce is not None and result.reproduce.endswith(f"/checkpoints/{resumed_from}")
    assert "<run_dir>" not in result.reproduce
    assert report_evidence(result)["state"]["compared"] is True


@pytest.mark.parametrize("allow", [False, True])
def test_a_final_checkpoint_over_the_read_limit_is_never_a_pass(job: Path, allow: bool) -> None:
    """A checkpoint file over ``read_max_mb`` left the state uncompared and the resume check
    PASSED (issue 42): now an error that names the limit and the opt-in, unless the job file
    allows it by name, and then the summary says so."""
    runner = JobRunner(load_config(runner_for(job, "--weights-bytes 4000").job_file.path),
                       Settings(read_max_mb=2000 / 2**20))  # trainer_state.json is read, weights.json is not
    result = run_resume_check(check_context(runner, "resume", ResumeCheck(steps=8, after_step=5, allow_uncompared=["state"] if allow else [])))
    assert report_evidence(result)["state"]["over_limit"] == ["weights.json"], report_evidence(result)["state"]
    if allow:
        assert result.status == "passed", result.summary
        assert "state not compared: weights.json not compared: over the read limit" in result.summary
        assert "allowed by checks.resume.allow_uncompared" in result.summary
    else:
        assert result.status == "error", result.summary
        assert "the final state was not compared (weights.json not compared: over the read limit" in result.summary
        assert "allow_uncompared: [state]" in result.summary


def test_resume_check_fails_when_the_killed_run_left_no_complete_checkpoint(job: Path) -> None:
    runner = runner_for(job, "--no-save")
    result = run_resume_check(check_context(runner, "resume", ResumeCheck(steps=8, after_step=5)))
    assert result.status == "failed"  # the job lost its progress: a verdict, not a broken check
    assert result.summary.startswith("no complete checkpoint under ")
    # the checkpoint directory kept from the uninterrupted run after step 5 (issue 29)
    assert re.search(r"to resume from \(the uninterrupted run, stopped after step \d+, had written: no checkpoint\)",
                     result.summary), result.summary
    assert report_evidence(result)["diagnosis"][0]["key"] == "no_checkpoint"
    assert not any(Path(report_evidence(result)["checkpoint_dir"]).iterdir())


def test_reproduce_lines_run_as_printed(job: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    runner = runner_for(job)
    request = RunRequest.make(steps=4, seed=0, world_size=1)
    line = runner.command_line(request)
    assert "<run_dir>" not in line
    assert line.startswith(f"cd {job.parent} && mkdir -p {tmp_path}/tmp/trainguard-repro-trainer-dirs/checkpoints && ")
    done = subprocess.run(["bash", "-c", line], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "step 4 loss 0.250000" in done.stdout
    again = runner.command_line(RunRequest.make(steps=6, seed=0, world_size=1), resume=True)
    assert again.endswith("--resume-from " + str(tmp_path / "tmp/trainguard-repro-trainer-dirs/checkpoints/checkpoint-4"))
    done = subprocess.run(["bash", "-c", again], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "step 5 loss" in done.stdout and "step 1 loss" not in done.stdout
    # a run's own directories, and quoting that survives spaces
    spaced = tmp_path / "my runs"
    line = runner.command_line(request, run_dir=spaced, checkpoint_dir=spaced / "ckpt")
    assert f"--output-dir '{spaced}/ckpt'" in line
    assert subprocess.run(["bash", "-c", line], capture_output=True, timeout=60).returncode == 0
    assert (spaced / "ckpt" / "checkpoint-4" / "trainer_state.json").is_file()


def test_reproduce_line_on_several_ranks_goes_through_torchrun(job: Path) -> None:
    runner = runner_for(job)
    line = runner.command_line(RunRequest.make(steps=4, seed=0, world_size=2))
    assert " torchrun --nproc-per-node=2 trainer_dirs_train.py --steps 4 " in line


def test_smoke_reads_a_checkpoint_directory_and_resumes_from_it(job: Path) -> None:
    from trainguard.checks.smoke import run_smoke
    from trainguard.config import SmokeCheck

    result = run_smoke(check_context(runner_for(job), "smoke", SmokeCheck(steps=4)))
    assert result.status == "passed", result.summary
    assert result.summary.endswith("; resumed from the checkpoint of step 4 at step 5")
    checkpoint_evidence = report_evidence(result)["checkpoint"]
    assert Path(checkpoint_evidence["file"]).name == "checkpoint-4" and checkpoint_evidence["loaded"]
    assert checkpoint_evidence["keys"] == ["trainer_state.json", "weights.json"]
    # the resume in the reproduce line names that checkpoint in the line's own directory
    assert result.reproduce is not None
    assert result.reproduce.endswith("/trainguard-repro-trainer-dirs/checkpoints/checkpoint-4")


def test_the_restart_backoff_starts_over_after_an_attempt_that_made_progress(
        job: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each fault of a long run (a soak) costs the same wait: the backoff doubles only while
    attempts make no progress (a crash loop)."""
    import time
    import types

    import trainguard.run.runner as runner_module

    waits: list[float] = []
    # the runner module's own `time` only: the launcher's threads keep the real sleep
    clock = types.SimpleNamespace(**{n: getattr(time, n) for n in dir(time) if not n.startswith("_")})
    clock.sleep = waits.append
    monkeypatch.setattr(runner_module, "time", clock)
    runner = runner_for(job, "--die-at 5 --die-at 7")
    run = runner.supervise(RunRequest.make(steps=8, seed=0, world_size=1), label="backoff",
                           options=LaunchOptions(max_restarts=2, backoff_s=0.25))
    assert run.ok and run.restarts == 2
    assert waits == [0.25, 0.25]  # the second attempt got past step 5: no doubling
