"""What a check asks its :class:`~trainguard.checks.context.CheckContext` instead of the runner:
a run shared as the reference of its request (the canary's), a library driver on the pool's
runner (the drills', the profile's), whether a resume names the latest checkpoint. Nothing here
launches a process: a kept reference is a :class:`RunResult` made in the test.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from tests.helpers import check_context
from trainguard.checks.canary import canary_request
from trainguard.config import load_config
from trainguard.config.registry import CheckContextProtocol
from trainguard.launch import RunResult
from trainguard.run.pool import UndeclaredRun
from trainguard.run.runner import JobRunner

JOB = """\
job:
  name: toy-context
  command: "python toy_train.py --steps {steps} --seed {seed}"
  resume_args: ["--resume", "{latest_checkpoint}"]
  metrics:
    loss: 'step (?P<step>\\d+) loss (?P<value>\\S+)'
checks:
  canary: {steps: 20, max_seconds: 30, max_memory_mb: 500}
"""


@pytest.fixture
def runner(tmp_path: Path) -> JobRunner:
    path = tmp_path / "trainguard.yaml"
    path.write_text(JOB)
    runner = JobRunner(load_config(path))
    yield runner  # type: ignore[misc]
    runner.close()


def _ran(tmp_path: Path) -> RunResult:
    return RunResult("ok", ["python"], tmp_path, 1, 0, [], [], 1.0, None)


def test_a_run_shared_as_the_reference_is_the_kept_one_and_says_so(runner: JobRunner, tmp_path: Path) -> None:
    """The canary's run, under its limits, is the reference of its request already kept (the
    profile's, run first): returned as shared (its limits judged after the fact), nothing launched."""
    spec = runner.job_file.checks.canary
    ctx = check_context(runner, "canary", spec)
    kept = _ran(tmp_path)
    runner.scheduling.offer_reference(ctx.declared().request, kept)  # no limits: the profile's request
    result, shared = ctx.run_as_reference(canary_request(ctx.declared().request, spec), label="canary")
    assert result is kept and shared
    assert runner.launches == []


def test_a_run_asked_as_the_reference_of_a_request_the_check_did_not_declare_is_refused(
    runner: JobRunner, tmp_path: Path,
) -> None:
    """A planted wrong call: the canary asks for a run of other steps as its reference. Even with
    one of those kept (so nothing would launch to be admitted), the context refuses it."""
    spec = runner.job_file.checks.canary
    ctx = check_context(runner, "canary", spec)
    other = dataclasses.replace(canary_request(ctx.declared().request, spec), steps=spec.steps + 5)
    runner.scheduling.offer_reference(other, _ran(tmp_path))
    with pytest.raises(UndeclaredRun) as refused:
        ctx.run_as_reference(other, label="canary")
    said = str(refused.value)
    assert "the canary check asked for 'canary' (1 rank(s), 25 steps" in said and "declared: the uninterrupted run" in said, said
    assert runner.launches == []


def test_a_driver_runs_on_the_pools_runner_with_the_checks_spec(runner: JobRunner) -> None:
    """``ctx.drive(run_drill)``: the public ``(runner, spec)`` drivers get the runner the pool
    launches for and the context's spec, not another runner."""
    spec = runner.job_file.checks.canary
    ctx = check_context(runner, "canary", spec)
    assert ctx.drive(lambda got, given: (got, given)) == (runner, spec)


def test_the_pool_says_whether_a_resume_names_the_latest_checkpoint(runner: JobRunner, tmp_path: Path) -> None:
    ctx = check_context(runner, "canary", runner.job_file.checks.canary)
    assert ctx.resumes_from_latest is True
    path = tmp_path / "plain.yaml"
    path.write_text(JOB.replace('"{latest_checkpoint}"', '"{checkpoint_dir}"'))
    plain = JobRunner(load_config(path))
    assert check_context(plain, "canary", plain.job_file.checks.canary).resumes_from_latest is False
    plain.close()


def test_the_context_is_what_the_registry_says_a_check_receives(runner: JobRunner) -> None:
    """``Check.run``/``ahead``/``prepare`` are typed by :class:`CheckContextProtocol` (config/
    cannot import checks/): the context has every member it names; a stand-in that lacks the
    runs does not pass for one (mypy refuses such a check's function the same way)."""

    @dataclasses.dataclass(frozen=True)
    class SpecOnly:
        name: str
        spec: object

    ctx = check_context(runner, "canary", runner.job_file.checks.canary)
    assert isinstance(ctx, CheckContextProtocol)
    assert not isinstance(SpecOnly("canary", ctx.spec), CheckContextProtocol)
