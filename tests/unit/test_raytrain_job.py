"""The ray_train job kind's pure parts: config placeholders and the driver command."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from pydantic import ValidationError

from trainguard.raytrain import metric_regex
from trainguard.raytrain.job import RayScaling, render_config


def test_a_lone_placeholder_keeps_its_type_and_others_are_formatted() -> None:
    config = {"steps": "{steps}", "tag": "run-{seed}", "nested": {"seeds": ["{seed}", 3]}, "lr": 0.1}
    rendered = render_config(config, {"steps": 40, "seed": 7})
    assert rendered == {"steps": 40, "tag": "run-7", "nested": {"seeds": [7, 3]}, "lr": 0.1}
    assert render_config({"text": "{{literal}}"}, {}) == {"text": "{literal}"}


def test_scaling_rejects_unknown_keys_and_bad_counts() -> None:
    with pytest.raises(ValidationError):
        RayScaling.model_validate({"num_workers": 0})
    with pytest.raises(ValidationError):
        RayScaling.model_validate({"workers": 2})


def test_the_metric_regex_reads_a_forwarded_report_line() -> None:
    line = "(RayTrainWorker pid=30725) trainguard-report step=12 loss=1.42 val_loss=0.9"
    found = re.search(metric_regex("loss"), line)
    assert found and found.group("step") == "12" and found.group("value") == "1.42"
    other = re.search(metric_regex("val_loss"), line)
    assert other and other.group("value") == "0.9"
    assert re.search(metric_regex("acc"), line) is None


RAY_JOB = """
job:
  name: rj
  kind: ray_train
  train_func: "train:train_func"
  config: {steps: "{steps}", lr: 0.1}
  scaling: {num_workers: 3}
  metrics: [loss]
checks:
  smoke: {steps: 4}
"""


def test_a_ray_train_job_becomes_the_driver_command() -> None:
    from trainguard.config import parse_config

    job = parse_config(RAY_JOB, path="/x/trainguard.yaml").job
    assert job.kind == "ray_train" and job.world_size == 3
    assert job.command[1:3] == ["-m", "trainguard.raytrain.driver"] and job.resume_args == ["--resume"]
    assert "{steps}" in job.command and "{checkpoint_dir}" in job.command
    assert re.search(job.metrics["loss"], "trainguard-report step=3 loss=0.5")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (("train_func: \"train:train_func\"", "train_func: train.py"), "job.train_func: expected 'module:function'"),
        (("lr: 0.1", "lr: \"{learning_rate}\""), "unknown placeholder {learning_rate}"),
        (("scaling: {num_workers: 3}", "scaling: {workers: 3}"), "job.scaling"),
        (("metrics: [loss]", "metrics: [loss]\n  command: python x.py"), "a ray_train job has no command"),
        (("kind: ray_train", "kind: command"), "belong to a Ray Train job; add `kind: ray_train`"),
    ],
)
def test_ray_train_mistakes_are_named_with_the_fix(change: tuple[str, str], message: str) -> None:
    from trainguard.config import parse_config
    from trainguard.errors import ConfigError

    with pytest.raises(ConfigError) as info:
        parse_config(RAY_JOB.replace(*change), path="/x/trainguard.yaml")
    assert message in str(info.value)


PACE = "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"


def test_trainguards_own_ray_gets_ray_trains_fast_pace_unless_the_user_set_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The embedded head's processes and its drivers get RAY_TRAIN_DEFAULTS; a value in the
    environment is kept as the user's; a real cluster (RAY_ADDRESS) gets nothing. (The value
    reaching Ray Train's controller and workers: tests/ray/test_ray_pace.py.)"""
    from trainguard.raytrain import RAY_TRAIN_DEFAULTS, ray_train_defaults
    from trainguard.raytrain.local_ray import LocalRay, RayCluster, external_cluster

    assert float(RAY_TRAIN_DEFAULTS[PACE]) <= 0.5  # Ray's own default is 2 s
    for key in RAY_TRAIN_DEFAULTS:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    owned = RayCluster(address="127.0.0.1:1", jobs_address=None, owned=True, auth_token="t")
    head = LocalRay(num_cpus=1, dashboard=False, use_ray_address=False)
    assert {k: owned.client_env()[k] for k in RAY_TRAIN_DEFAULTS} == RAY_TRAIN_DEFAULTS
    assert {k: head.head_env(tmp_path, "t")[k] for k in RAY_TRAIN_DEFAULTS} == RAY_TRAIN_DEFAULTS

    monkeypatch.setenv(PACE, "2")  # the user asks for Ray's own pace: theirs stands
    assert ray_train_defaults({PACE: "2"}) == {k: v for k, v in RAY_TRAIN_DEFAULTS.items() if k != PACE}
    assert PACE not in owned.client_env()  # the driver inherits the user's 2 from the environment
    assert head.head_env(tmp_path, "t")[PACE] == "2"
    # extra_env, trainguard's own override, is applied last
    assert LocalRay(extra_env={PACE: "1"}).head_env(tmp_path, None)[PACE] == "1"

    monkeypatch.delenv(PACE)
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")  # a real cluster: nothing of ours is set
    real = external_cluster()
    assert real is not None and not real.owned
    assert not any(key.startswith("RAY_TRAIN_") for key in real.client_env())


def test_the_driver_ends_without_teardown_but_loses_no_output_and_keeps_its_exit_code() -> None:
    """The driver skips the interpreter's teardown of torch and Ray (seconds per fit) with
    os._exit: what it printed is flushed first, even into a pipe (block-buffered)."""
    import os
    import subprocess
    import sys

    code = ("import sys; from trainguard.raytrain.driver import _exit_now\n"
            "print('trainguard-report step=3 loss=0.5'); sys.stderr.write('last words'); _exit_now(3)")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # buffered, as it can be
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 3
    assert proc.stdout == "trainguard-report step=3 loss=0.5\n" and proc.stderr.endswith("last words")
