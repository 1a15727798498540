"""The network fault's ``service: mlflow`` on a ``ray_train`` job, without Ray or an MLflow server.

The drill's environment must reach the Ray workers' designated writer
(:mod:`trainguard.raytrain.tracking`) over the session's own tracking environment, with the
session's tracking off; and what the writer recorded must turn into the drill's verdict (a
writer that never ran, logged elsewhere or dropped rows is a problem, with the count). The whole
path on real Ray and a real MLflow server is tests/ray/test_ray_network_drill.py (slow).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from trainguard.config import load_config
from trainguard.config.fault_params import FaultParams
from trainguard.faults.base import FaultContext
from trainguard.faults.network import RAY_WRITER_ENV, NetworkFault
from trainguard.launch import RunResult
from trainguard.launch.backend import CommandBackend
from trainguard.raytrain.backend import RayTrainBackend
from trainguard.raytrain.tracking import SUMMARY_FILE, WorkerSummary, writer_from_env
from trainguard.run.request import RunRequest
from trainguard.run.runner import JobRunner, LaunchOptions

MLFLOW = {"service": "mlflow", "toxic": "latency", "attributes": {"latency": 2000}}
PROXY = "127.0.0.1:47001"
DRILL_RUN = "0123456789abcdef0123456789abcdef"

# stands in for the Ray driver: prints what it would pass to its workers' runtime env
DRIVER = """
import json
from trainguard.raytrain.tracking import worker_env
print("workers", json.dumps(worker_env()), flush=True)
print("step 1 loss 1.0", flush=True)
"""

JOB = """
job:
  name: env-probe
  command: "python {script}"
  metrics:
    loss: 'step (?P<step>\\d+) loss (?P<value>\\S+)'
  timeout: 60
  stall_timeout: 30
"""


def fault_after_setup(ray_train: bool) -> NetworkFault:
    """A network fault as :meth:`NetworkFault.setup` leaves it: the proxy's address, and for a
    ray_train job the run it created on the drill's MLflow server."""
    fault = NetworkFault(FaultParams(MLFLOW), after_step=2)
    fault.proxy_address = PROXY
    fault.backend = RayTrainBackend() if ray_train else CommandBackend()
    if ray_train:
        fault.drill_run_id = DRILL_RUN
    return fault


def ctx(tmp_path: Path, ray_train: bool) -> FaultContext:
    return FaultContext(work_dir=tmp_path / "fault", checkpoint_dir=tmp_path / "ckpt",
                        world_size=2, backend=RayTrainBackend() if ray_train else CommandBackend())


def test_ray_job_gets_the_writer_env_and_a_command_job_only_the_mlflow_uri(tmp_path: Path) -> None:
    url = f"http://{PROXY}"
    ray_env = fault_after_setup(True).launch_env(ctx(tmp_path, True))
    assert ray_env == {"MLFLOW_TRACKING_URI": url, "TRAINGUARD_MLFLOW_TRACKING_URI": url,
                       "TRAINGUARD_MLFLOW_RUN_ID": DRILL_RUN, "TRAINGUARD_TRACKING": "on"}
    assert set(RAY_WRITER_ENV) < set(ray_env)
    assert fault_after_setup(False).launch_env(ctx(tmp_path, False)) == {"MLFLOW_TRACKING_URI": url}


def test_the_drill_env_wins_over_the_session_tracking_env_in_the_launched_driver(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A real launched process through JobRunner: the session tracks (its launch run's id and
    store in the ranks' env) but TRAINGUARD_TRACKING is off (tests/conftest.py); the drill's
    env must be what the driver hands its workers, and it must make world rank 0 a writer."""
    script = tmp_path / "driver.py"
    script.write_text(DRIVER)
    (tmp_path / "trainguard.yaml").write_text(JOB.format(script=script))
    runner = JobRunner(load_config(tmp_path / "trainguard.yaml"))
    session = {"TRAINGUARD_MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path / 'session.db'}",
               "TRAINGUARD_MLFLOW_RUN_ID": "session-run"}
    # the session's tracker, as JobRunner._launch asks it for the launch run's environment
    monkeypatch.setattr(runner, "_track_hooks", lambda tracked, world_size, log_dir: (dict(session), None))
    request = RunRequest.make(steps=1, seed=0, world_size=1)

    def workers_env(extra: dict[str, str]) -> dict[str, str]:
        run = runner.supervise(request, label="env", options=LaunchOptions(max_restarts=0, extra_env=extra))
        assert run.ok, run.final.reason
        line = next(t for t in run.final.log_path(0, "stdout").read_text().splitlines()
                    if t.startswith("workers "))
        return dict(json.loads(line.split(" ", 1)[1]))

    drill_env = fault_after_setup(True).launch_env(ctx(tmp_path, True))
    env = workers_env(drill_env)
    assert env["TRAINGUARD_MLFLOW_RUN_ID"] == DRILL_RUN
    assert env["TRAINGUARD_MLFLOW_TRACKING_URI"] == env["MLFLOW_TRACKING_URI"] == f"http://{PROXY}"
    assert env["TRAINGUARD_TRACKING"] == "on"
    # without the drill the session's run reaches the workers, and its tracking is off
    plain = workers_env({})
    assert plain["TRAINGUARD_MLFLOW_RUN_ID"] == "session-run" and plain["TRAINGUARD_TRACKING"] == "off"
    assert writer_from_env(0, {"TRAINGUARD_TRACKING": "off", **plain}) is None

    # a Ray worker's env: the raylet's (started with tracking off) under the runtime env's vars
    for name in ("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "MLFLOW_HTTP_REQUEST_TIMEOUT"):
        monkeypatch.delenv(name, raising=False)  # the writer sets them; restored after the test
    worker = {"TRAINGUARD_TRACKING": "off", **env}
    assert writer_from_env(1, worker) is None  # world rank 0 only
    writer = writer_from_env(0, worker)
    assert writer is not None
    try:
        assert writer.tracking_uri == f"http://{PROXY}" and writer.run_id == DRILL_RUN
    finally:
        writer.close(timeout=0.5)


def result_in(run_dir: Path) -> RunResult:
    run_dir.mkdir(parents=True, exist_ok=True)
    return RunResult("ok", [sys.executable], run_dir, 1, 0, [], [], 1.0, None)


def test_writer_problems_name_a_writer_that_never_ran(tmp_path: Path) -> None:
    fault = fault_after_setup(True)
    [problem] = fault.writer_problems(result_in(tmp_path / "run"))
    assert "designated MLflow writer (world rank 0) never ran" in problem
    assert SUMMARY_FILE in problem
    assert fault.evidence().to_dict()["ray_writer"] == {"writer": None}


def test_writer_problems_report_dropped_rows_with_their_count(tmp_path: Path) -> None:
    fault = fault_after_setup(True)
    result = result_in(tmp_path / "run")
    summary = WorkerSummary(run_id=DRILL_RUN, tracking_uri=f"http://{PROXY}", written_rows=37,
                            dropped_rows=3, written_steps=set(range(1, 38)), dropped_steps={38, 39, 40},
                            keys={"loss"}, closed=True,
                            reason="the store did not take the last rows within 10 s")
    (result.run_dir / SUMMARY_FILE).write_text(json.dumps(summary.to_dict()))
    assert fault.writer_problems(result) == [
        "the Ray workers' writer dropped 3 metric row(s) of 3 step(s) (steps 38, 39, 40): the store "
        "did not take the last rows within 10 s"
    ]
    writer = fault.evidence().to_dict()["ray_writer"]["writer"]
    assert writer["written_rows"] == 37 and writer["dropped_rows"] == 3

    # nothing dropped: no problem
    clean = WorkerSummary(run_id=DRILL_RUN, written_rows=40, written_steps=set(range(1, 41)),
                          keys={"loss"}, closed=True)
    (result.run_dir / SUMMARY_FILE).write_text(json.dumps(clean.to_dict()))
    assert fault.writer_problems(result) == []


def test_writer_problems_read_the_stderr_line_and_name_another_run(tmp_path: Path) -> None:
    """No summary file (a writer on another machine): its line on the driver's stderr counts."""
    fault = fault_after_setup(True)
    result = result_in(tmp_path / "run")
    line = WorkerSummary(run_id="session-run", written_rows=40, written_steps=set(range(1, 41)),
                         keys={"loss"}).line()
    result.log_path(0, "stderr").write_text(f"noise\n{line}\n")
    [problem] = fault.writer_problems(result)
    assert problem == f"the Ray workers' writer logged into run session-run, not the drill's run {DRILL_RUN}"
