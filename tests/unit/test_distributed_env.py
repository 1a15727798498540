"""``job.distributed_env: false``: a one-process job launched as a plain script, without the
torchrun environment, for scripts that go distributed when they see RANK (nanoGPT's train.py);
and the hint a one-process job gets when it dies setting up torch.distributed."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import yaml

from tests.helpers import report_evidence
from trainguard.config import parse_config
from trainguard.errors import ConfigError
from trainguard.launch import Launcher, LaunchSpec
from trainguard.run.runner import JobRunner

SCRIPT = Path(__file__).resolve().parents[1] / "data" / "jobs" / "goes_distributed.py"
LOSS = r"step (?P<step>\d+) loss (?P<value>\S+)"


def _launch(tmp_path: Path, distributed_env: bool) -> object:
    spec = LaunchSpec([sys.executable, str(SCRIPT), "--steps", "3"], run_dir=tmp_path / "run",
                      metric_regexes={"loss": LOSS}, timeout=60, distributed_env=distributed_env)
    return Launcher(spec).run()


def test_with_the_torchrun_environment_the_script_dies_and_the_reason_points_at_the_setting(
    tmp_path: Path,
) -> None:
    result = _launch(tmp_path, True)
    assert result.outcome == "failed"
    assert "ProcessGroupNCCL" in result.stderr_tail
    assert "job.distributed_env: false" in result.reason, result.reason
    assert report_evidence(result)["hint"].startswith("a one-process job died while setting up torch.distributed")


def test_without_it_the_script_runs_and_sees_none_of_it_even_inherited(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("RANK", "3")  # e.g. trainguard itself started under torchrun
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.1")
    result = _launch(tmp_path, False)
    assert result.outcome == "ok", result.reason
    env_line = next(ln for ln in (tmp_path / "run" / "rank0.stdout.log").read_text().splitlines()
                    if ln.startswith("env "))
    assert json.loads(env_line[4:]) == {}
    assert [p.step for p in result.points] == [1, 2, 3]


def test_a_job_file_with_it_runs_through_the_runner(tmp_path: Path) -> None:
    path = tmp_path / "trainguard.yaml"
    path.write_text(yaml.safe_dump({"job": {
        "name": "one-process", "command": f"{sys.executable} {SCRIPT} --steps {{steps}}",
        "distributed_env": False, "metrics": {"loss": LOSS}, "timeout": 60}}))
    job_file = parse_config(path.read_text(), path=path)
    runner = JobRunner(job_file)
    try:
        result = runner.run(runner.request_for(job_file.checks.smoke or _smoke()), label="smoke")
    finally:
        runner.close()
    assert result.ok, result.reason


def _smoke() -> object:
    from trainguard.config.checks import SmokeCheck

    return SmokeCheck(steps=3)


@pytest.mark.parametrize(("extra", "key"), [
    ({"job": {"world_size": 2}}, "job.world_size"),
    ({"checks": {"parallel": {"world_size": 2}}}, "checks.parallel.world_size"),
    ({"checks": {"profile": {"world_sizes": [1, 2]}}}, "checks.profile.world_sizes"),
])
def test_nothing_may_ask_a_one_process_job_for_more_ranks(extra: dict, key: str) -> None:
    doc = {"job": {"name": "j", "command": "python train.py --steps {steps}", "distributed_env": False,
                   "metrics": {"loss": LOSS}, **extra.get("job", {})}, **{k: v for k, v in extra.items() if k != "job"}}
    with pytest.raises(ConfigError) as info:
        parse_config(yaml.safe_dump(doc), path="jobs/trainguard.yaml")
    text = str(info.value)
    assert key in text and "distributed_env: false" in text, text
