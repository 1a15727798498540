"""Ray Train's pace on trainguard's embedded Ray head, on a real local Ray (docs/ray-train.md,
"Ray Train's pace").

Ray Train V2's controller takes each worker's report every ``RAY_TRAIN_HEALTH_CHECK_INTERVAL_S``
(Ray's default 2 s), which made every step of a short test fit cost 2 s. trainguard's own head
sets ``trainguard.raytrain.RAY_TRAIN_DEFAULTS`` (0.25 s, no preemption watcher) unless the user
set a value. What is checked is the value the fit ran with, read inside a Ray Train worker by
tests/data/jobs/ray_env_probe.py (a worker gets its controller's value), not a timing: the
default on a runner's embedded head, and a value in the job's ``env`` winning over it.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from trainguard.config import load_config
from trainguard.raytrain import RAY_TRAIN_DEFAULTS
from trainguard.raytrain.local_ray import running_ray_processes
from trainguard.run.request import RunRequest
from trainguard.run.runner import JobRunner

# slow: tests/unit/test_raytrain_job.py checks the defaults reach the head's environment; this one
# follows them into a Ray Train worker on a real head (about 45 s)
pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(300)]
pytest.importorskip("ray.train", reason="needs ray[train] (pip install trainguard[ray])")

JOBS = Path(__file__).resolve().parents[1] / "data" / "jobs"
JOB = """
job:
  name: pace
  kind: ray_train
  train_func: "ray_env_probe:train_func"
  config: {{steps: "{{steps}}"}}
  scaling: {{num_workers: 1, resources_per_worker: {{CPU: 1}}}}
  cwd: {cwd}
  env: {env}
  metrics: [interval, preemption_watcher]
  timeout: 240
  stall_timeout: 120
"""


def probe(runner: JobRunner, label: str) -> dict[str, float]:
    result = runner.run(RunRequest(steps=1, seed=0, world_size=1), label=label)
    assert result.ok, f"{result.reason}\n{result.stderr_tail}"
    return {name: result.trajectory(name)[1] for name in ("interval", "preemption_watcher")}


def test_the_embedded_head_runs_ray_train_at_trainguards_pace_and_the_users_value_wins(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for key in RAY_TRAIN_DEFAULTS:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setenv("TRAINGUARD_TRACKING", "off")
    paths = []
    for name, env in (("default", "{}"), ("user", '{RAY_TRAIN_HEALTH_CHECK_INTERVAL_S: "0.5"}')):
        (tmp_path / name).mkdir()
        paths.append(tmp_path / name / "trainguard.yaml")
        paths[-1].write_text(JOB.format(cwd=JOBS, env=env))
    runner = JobRunner(load_config(paths[0]))
    temp = None
    try:
        default = probe(runner, "default")
        head = runner.backend.head
        assert head is not None and head.cluster is not None
        temp = head.cluster.temp_dir
        assert default == {"interval": float(RAY_TRAIN_DEFAULTS["RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"]),
                           "preemption_watcher": 0.0}
        # the job's env reaches the driver, whose value Ray Train hands to its controller and workers
        user = probe(runner.sibling(load_config(paths[1])), "user")
        assert user == {"interval": 0.5, "preemption_watcher": 0.0}
    finally:
        runner.close()
    if temp is not None:
        assert not running_ray_processes(temp)
