"""MLflow tracking: what a check logs, where, and that a dead store never stalls or fails it.

Real stores only: sqlite files in tmp_path, and one real ``mlflow server`` on loopback per test
session (read back through its REST API).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("mlflow")

import trainguard.tracking.runs as runs
import trainguard.tracking.store as store
import trainguard.tracking.system as system
import trainguard.tracking.tracker as tracking
from tests.helpers import runs_by_kind
from trainguard.launch import MetricPoint
from trainguard.session import check
from trainguard.tracking import Tracker, TrackingWarning, metric_rows

pytestmark = pytest.mark.timeout(180)

JOBS = Path(__file__).resolve().parents[1] / "data" / "jobs"


@pytest.fixture
def jobs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A private copy of the toy jobs, tracking on, the working directory elsewhere (to prove
    nothing lands in it), and MLflow's HTTP retries bounded without leaking into other tests."""
    monkeypatch.setenv("TRAINGUARD_TRACKING", "on")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")
    monkeypatch.setenv("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")
    return Path(shutil.copytree(JOBS, tmp_path / "jobs"))


def no_writer_threads() -> bool:
    return not any(t.name == "trainguard-tracking" and t.is_alive() for t in threading.enumerate())


def test_a_check_is_a_child_run_of_the_session_with_its_launches_nested(jobs: Path) -> None:
    from mlflow import MlflowClient

    report = check(jobs / "toy.trainguard.yaml", only=["smoke"], seed=3)
    assert report.status == "passed"
    assert no_writer_threads()
    uri = f"sqlite:///{jobs / '.trainguard' / 'mlflow.db'}"
    assert report.tracking_uri == uri  # the CLI prints it with the `mlflow ui` command
    runs = runs_by_kind(uri)
    (session,) = runs["session"]
    (check_run,) = runs["check"]
    launches = runs["launch"]
    assert {r.info.run_name for r in launches} == {"smoke", "smoke-resume"}
    assert check_run.data.tags["mlflow.parentRunId"] == session.info.run_id
    assert all(r.data.tags["mlflow.parentRunId"] == check_run.info.run_id for r in launches)
    assert all(r.info.status == "FINISHED" for r in [session, check_run, *launches])
    assert check_run.data.tags["trainguard.status"] == "passed"
    assert check_run.data.tags["trainguard.check"] == "smoke"
    assert session.data.tags["trainguard.version"]

    (smoke,) = [r for r in launches if r.info.run_name == "smoke"]
    assert smoke.data.params["world_size"] == "2"
    assert smoke.data.params["seed"] == "3"
    assert smoke.data.params["steps"] == "5"
    assert smoke.data.params["check"] == "smoke"
    assert "toy_train.py" in smoke.data.params["command"]
    assert smoke.data.tags["attempt"] == "0"
    client = MlflowClient(uri)
    history = {m.step: m.value for m in client.get_metric_history(smoke.info.run_id, "loss")}
    assert sorted(history) == [1, 2, 3, 4, 5]
    rank0 = {m.step: m.value for m in client.get_metric_history(smoke.info.run_id, "loss/rank0")}
    rank1 = {m.step: m.value for m in client.get_metric_history(smoke.info.run_id, "loss/rank1")}
    assert history[5] == pytest.approx((rank0[5] + rank1[5]) / 2)

    def artifacts(run: Any, path: str | None = None) -> set[str]:
        return {a.path for a in client.list_artifacts(run.info.run_id, path)}

    assert "logs/attempt-0/rank1.stderr.log" in artifacts(smoke, "logs/attempt-0")
    assert "job/toy.trainguard.yaml" in artifacts(smoke, "job")
    assert "result.json" in artifacts(check_run)
    assert {"environment.json", "report", "job"} <= artifacts(session)
    env = json.loads(client.download_artifacts(session.info.run_id, "environment.json", str(jobs)) and
                     (jobs / "environment.json").read_text())
    assert env["python"] == sys.version.split()[0]
    assert any(p.lower().startswith("mlflow==") for p in env["packages"])
    assert (jobs / ".trainguard" / "mlartifacts").is_dir()
    assert list(Path.cwd().iterdir()) == []  # never ./mlflow.db or ./mlruns


def test_tracking_off_writes_nothing(jobs: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRAINGUARD_TRACKING", "off")
    report = check(jobs / "toy.trainguard.yaml", only=["smoke"])
    assert report.status == "passed" and report.tracking_uri is None
    state = jobs / ".trainguard"
    assert not (state / "mlflow.db").exists()
    assert not (state / "mlartifacts").exists()
    assert list(Path.cwd().iterdir()) == []


def test_mlflow_tracking_uri_is_honoured(
    jobs: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, new_mlflow_store: Callable[[Path], Path]
) -> None:
    uri = f"sqlite:///{new_mlflow_store(tmp_path / 'elsewhere.db')}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    assert check(jobs / "nondet.trainguard.yaml").status == "failed"
    assert not (jobs / ".trainguard" / "mlflow.db").exists()
    runs = runs_by_kind(uri)
    (check_run,) = runs["check"]
    assert check_run.data.tags["trainguard.status"] == "failed"
    assert check_run.info.status == "FAILED"
    assert runs["session"][0].info.status == "FAILED"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def test_a_dead_tracking_server_neither_stalls_nor_fails_the_check(
    jobs: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tracking, "FLUSH_TIMEOUT_S", 2.0)
    monkeypatch.setenv("TRAINGUARD_TRACKING", "off")
    started = time.monotonic()
    assert check(jobs / "toy.trainguard.yaml", only=["smoke"]).status == "passed"
    untracked = time.monotonic() - started

    monkeypatch.setenv("TRAINGUARD_TRACKING", "on")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{free_port()}")
    started = time.monotonic()
    with pytest.warns(TrackingWarning, match=r"item\(s\) not written to http://127\.0\.0\.1.*run 'smoke'"):
        report = check(jobs / "toy.trainguard.yaml", only=["smoke"])
    tracked = time.monotonic() - started
    assert report.status == "passed"
    # the check's own time + the 2 s flush bound; a wide margin for a loaded CI machine
    assert tracked < untracked + 2.0 + 15.0, (tracked, untracked)
    assert no_writer_threads()


class FlakyClient:
    """Stands in for MlflowClient: down for the first ``down`` calls, then records batches."""

    def __init__(self, down: int) -> None:
        self.down = down
        self.metrics: list[tuple[str, float, int]] = []

    def log_batch(self, run_id: str, metrics: Any = (), params: Any = (), tags: Any = ()) -> None:
        if self.down > 0:
            self.down -= 1
            raise ConnectionError("tracking server down")
        self.metrics.extend((m.key, m.value, m.step) for m in metrics)


def test_nothing_is_lost_while_the_store_recovers_within_the_bound() -> None:
    tracker = Tracker("fake://store", flush_timeout=30.0)
    # down for 6 calls: the writer's retries take 0.2+0.4+0.8+1.6+2+2 = 7 s; a logger that
    # waited for the store would take at least that
    client = FlakyClient(down=6)
    tracker._client = client
    handle = tracker.attach("run-1")
    started = time.monotonic()
    try:
        for step in range(2500):  # returns at once: queued, not written
            tracker.log_metrics(handle, [("loss", float(step), step, 0)])
        # ~0.3 s idle, 1.05 s seen under CI load: a wide margin, still well under the 7 s
        assert time.monotonic() - started < 4.0
    finally:
        result = tracker.close()
    assert result.complete, result
    assert [m[2] for m in client.metrics] == list(range(2500))  # each once, in order
    assert no_writer_threads()


class SlowClient:
    """Stands in for MlflowClient: every batch takes ``delay`` seconds (a slow, live server)."""

    def __init__(self, delay: float) -> None:
        self.delay = delay
        self.batches = 0

    def log_batch(self, run_id: str, metrics: Any = (), params: Any = (), tags: Any = ()) -> None:
        time.sleep(self.delay)
        self.batches += 1


def test_a_slow_store_that_keeps_writing_is_waited_for_and_a_stuck_one_is_not() -> None:
    tracker = Tracker("fake://store", flush_timeout=0.5)
    slow = SlowClient(delay=0.15)
    tracker._client = slow
    handle = tracker.attach("run-1")
    for i in range(12):  # 12 separate batches (params are not merged): ~1.8 s in all, > the bound
        tracker.log_params(handle, {f"p{i}": i})
    result = tracker.close()
    assert result.complete, result
    assert slow.batches == 12

    tracker = Tracker("fake://store", flush_timeout=0.5)
    stuck = SlowClient(delay=2.0)  # a write far longer than the bound: the queue behind it is dropped
    tracker._client = stuck
    handle = tracker.attach("run-1")
    tracker.log_params(handle, {"p": 1})
    tracker.log_params(handle, {"q": 2})
    with pytest.warns(TrackingWarning, match=r"1 item\(s\) not written.*no write finished for 0.5 s"):
        result = tracker.close()
    assert result.unwritten == ["1 params of 'run-1'"] and stuck.batches == 1


def test_metric_rows_log_the_mean_and_each_rank() -> None:
    points = [MetricPoint("loss", 1, 1.0, 0, 0.1), MetricPoint("loss", 1, 3.0, 1, 0.2),
              MetricPoint("loss", 2, 5.0, 0, 0.3)]
    rows = {(k, s): v for k, v, s, _ in metric_rows(points, 2, 0)}
    assert rows == {("loss", 1): 2.0, ("loss/rank0", 1): 1.0, ("loss/rank1", 1): 3.0,
                    ("loss", 2): 5.0, ("loss/rank0", 2): 5.0}
    assert {k for k, *_ in metric_rows(points[:1], 1, 0)} == {"loss"}


def test_restarts_of_one_logical_run_share_one_run_with_the_attempt_tag(
    jobs: Path, new_mlflow_store: Callable[[Path], Path]
) -> None:
    from mlflow import MlflowClient

    from trainguard.config import load_config
    from trainguard.config.settings import Settings
    from trainguard.run.runner import JobRunner, LaunchOptions

    job_file = load_config(jobs / "die.trainguard.yaml")
    uri, artifacts = store.default_store(job_file.state_dir)
    new_mlflow_store(job_file.state_dir / "mlflow.db")
    tracker = Tracker(uri, artifact_location=artifacts)
    tracker.session = tracker.start_run("session")
    runner = JobRunner(job_file, Settings(), tracker=tracker)
    request = runner.request_for(job_file.checks.smoke)
    supervised = runner.supervise(request, label="drill", options=LaunchOptions(max_restarts=1, backoff_s=0.0))
    assert tracker.close().complete
    assert supervised.restarts == 1
    (launch,) = runs_by_kind(uri)["launch"]
    assert launch.data.tags["attempt"] == "1"
    assert launch.data.tags["attempt.0.outcome"] == "failed"
    client = MlflowClient(uri)
    assert {a.path for a in client.list_artifacts(launch.info.run_id, "logs")} == {
        "logs/attempt-0", "logs/attempt-1"}


def test_track_helper_logs_from_rank_zero_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, new_mlflow_store: Callable[[Path], Path]
) -> None:
    from mlflow import MlflowClient

    from trainguard.tracking import track

    for var in ("TRAINGUARD_MLFLOW_RUN_ID", "MLFLOW_RUN_ID", "MLFLOW_TRACKING_URI", "RANK"):
        monkeypatch.delenv(var, raising=False)
    track.log(0, loss=1.0)  # no run id: a no-op
    uri = f"sqlite:///{new_mlflow_store(tmp_path / 'mlflow.db')}"
    run_id = track.init("my-loop", tracking_uri=uri)
    assert run_id and os.environ["TRAINGUARD_MLFLOW_RUN_ID"] == run_id
    # a worker spawned now would inherit these variables
    assert os.environ["MLFLOW_TRACKING_URI"] == uri
    monkeypatch.setenv("RANK", "1")
    track.log(0, loss=99.0)  # not rank 0: dropped
    monkeypatch.setenv("RANK", "0")
    started = time.monotonic()
    for step in range(2000):
        track.log(step, loss=1.0 / (step + 1))
    # queued, not written: sqlite costs ~10 ms a row, so 2000 synchronous rows would take ~20 s;
    # a wide margin for a loaded machine
    assert time.monotonic() - started < 5.0
    track.flush()
    history = MlflowClient(uri).get_metric_history(run_id, "loss")
    assert sorted(m.step for m in history) == list(range(2000))
    assert 99.0 not in {m.value for m in history}
    assert no_writer_threads()


# ------------------------------------------------------------------------------------------------
# the real MLflow server


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory: pytest.TempPathFactory, mlflow_store_template: Path) -> Iterator[str]:
    """``mlflow server`` on loopback, in its own process group, for this module's tests (the only
    ones that use it: a session-wide server outlived them by the whole run). Without MLflow's
    job runner: its dozen huey consumers serve no tracking call and kept ~0.4 of a core busy. Its
    store starts as a copy of the empty one (the schema is made once a session)."""
    root = tmp_path_factory.mktemp("mlflow-server")
    shutil.copyfile(mlflow_store_template, root / "server.db")
    port = free_port()
    log = open(root / "server.log", "wb")  # noqa: SIM115 - closed in the finally below
    proc = subprocess.Popen(
        [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", f"sqlite:///{root / 'server.db'}",
         "--artifacts-destination", str(root / "artifacts"), "--host", "127.0.0.1", "--port", str(port),
         "--workers", "1"],
        cwd=root, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"},
    )
    # a worker killed outright (xdist's teardown after Ctrl-C, a CI timeout) never runs the finally
    # below: a watcher in a session of its own ends the server's group once this process is gone
    # (one such server and its huey consumers outlived a run here)
    subprocess.Popen(["sh", "-c", f"while kill -0 {os.getpid()} 2>/dev/null; do sleep 1; done; "
                      f"kill -TERM -{proc.pid}; sleep 10; kill -KILL -{proc.pid}"],
                     start_new_session=True, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                     stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                with urllib.request.urlopen(url + "/health", timeout=2) as resp:
                    if resp.status == 200:
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                log.flush()
                pytest.fail("mlflow server did not start within 90 s:\n"
                            + (root / "server.log").read_text(errors="replace")[-3000:])
            time.sleep(0.3)
        yield url
    finally:
        with __import__("contextlib").suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        log.close()


def rest(url: str, endpoint: str, body: dict[str, Any] | None = None, **query: str) -> Any:
    full = f"{url}/api/2.0/mlflow/{endpoint}" + (f"?{urllib.parse.urlencode(query)}" if query else "")
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(full, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        return json.loads(resp.read())


def test_checks_are_readable_from_a_real_mlflow_server(
    mlflow_server: str, jobs: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MLFLOW_TRACKING_URI", mlflow_server)
    started = time.monotonic()
    assert check(jobs / "toy.trainguard.yaml", only=["smoke"]).status == "passed"
    print(f"check against the server: {time.monotonic() - started:.2f} s")
    assert not (jobs / ".trainguard" / "mlflow.db").exists()
    exp = rest(mlflow_server, "experiments/get-by-name", experiment_name="trainguard")["experiment"]
    runs = rest(mlflow_server, "runs/search", {"experiment_ids": [exp["experiment_id"]]})["runs"]

    def tags(run: dict[str, Any]) -> dict[str, str]:
        return {t["key"]: t["value"] for t in run["data"].get("tags", [])}

    by_name = {run["info"]["run_name"]: run for run in runs if tags(run).get("trainguard.kind") != "check"}
    (check_run,) = [run for run in runs if tags(run).get("trainguard.kind") == "check"]
    smoke = by_name["smoke"]
    assert tags(check_run)["trainguard.status"] == "passed"
    assert tags(smoke)["mlflow.parentRunId"] == check_run["info"]["run_id"]
    history = rest(mlflow_server, "metrics/get-history", run_id=smoke["info"]["run_id"], metric_key="loss")
    assert sorted(m["step"] for m in history["metrics"]) == [1, 2, 3, 4, 5]
    files = rest(mlflow_server, "artifacts/list", run_id=smoke["info"]["run_id"], path="logs/attempt-0")
    assert "logs/attempt-0/rank0.stdout.log" in {f["path"] for f in files["files"]}


def test_importing_trainguard_and_its_plugin_never_imports_mlflow() -> None:
    code = ("import sys, trainguard, trainguard.plugins.plugin, trainguard.tracking, trainguard.tracking.track; "
            "trainguard.tracking.track.log(0, loss=1.0); assert 'mlflow' not in sys.modules, 'mlflow imported'")
    env = {k: v for k, v in os.environ.items() if k not in ("TRAINGUARD_MLFLOW_RUN_ID", "MLFLOW_RUN_ID")}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=60)


# ------------------------------------------------------------------------------------------------
# launched jobs logging into their launch run, live metrics, plots (one store for the module)

TRACK_TRAIN = '''\
"""A toy job that logs from its own loop with trainguard.tracking.track (rank 0 writes)."""
import argparse
import os
import time

from trainguard.tracking import track

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=5)
p.add_argument("--sleep", type=float, default=0.0)
p.add_argument("--ckpt-dir", default=None)
args = p.parse_args()
rank = int(os.environ["RANK"])
for step in range(1, args.steps + 1):
    time.sleep(args.sleep)
    print(f"step {step} loss {2.0 / step + 0.01 * rank:.6f}", flush=True)
    track.log(step, grad_norm=10.0 + step + 1000 * rank)  # rank 1's values must never arrive
track.flush()
'''

TRACK_JOB = '''\
job:
  name: tracked
  command: "python track_train.py --steps {steps} --ckpt-dir {checkpoint_dir} --sleep 0.02"
  world_size: 2
  env: {OMP_NUM_THREADS: "1"}
  metrics:
    loss: 'step (?P<step>\\d+) loss (?P<value>\\S+)'
  timeout: 120
  stall_timeout: 60
checks:
  smoke: {steps: 6}
'''


@pytest.fixture(scope="module")
def track_job(tmp_path_factory: pytest.TempPathFactory, mlflow_store_template: Path) -> Iterator[Any]:
    """A job that calls trainguard.tracking.track, with one sqlite store shared by this module's tests."""
    from trainguard.config import load_config

    root = tmp_path_factory.mktemp("tracked")
    (root / "track_train.py").write_text(TRACK_TRAIN)
    (root / "trainguard.yaml").write_text(TRACK_JOB)
    (root / ".trainguard").mkdir()
    shutil.copyfile(mlflow_store_template, root / ".trainguard" / "mlflow.db")
    with pytest.MonkeyPatch.context() as mp:
        for var in ("TRAINGUARD_MLFLOW_RUN_ID", "TRAINGUARD_MLFLOW_RUN_ID_FILE", "MLFLOW_RUN_ID",
                    "MLFLOW_TRACKING_URI", "TRAINGUARD_MLFLOW_TRACKING_URI"):
            mp.delenv(var, raising=False)
        yield load_config(root / "trainguard.yaml")


def tracked_runner(job_file: Any) -> Any:
    from trainguard.config.settings import Settings
    from trainguard.run.runner import JobRunner

    uri, artifacts = store.default_store(job_file.state_dir)
    tracker = Tracker(uri, artifact_location=artifacts)
    tracker.session = tracker.start_run("session")
    return JobRunner(job_file, Settings(), tracker=tracker)


def launch_run(uri: str, parent_id: str | None, name: str) -> Any:
    """The run named ``name`` (under ``parent_id`` when given), or None."""
    from mlflow import MlflowClient

    client = MlflowClient(uri)
    exp = client.get_experiment_by_name("trainguard")
    assert exp is not None
    query = f"attributes.run_name = '{name}'"
    if parent_id is not None:
        query += f" and tags.mlflow.parentRunId = '{parent_id}'"
    found = client.search_runs([exp.experiment_id], query)
    return found[0] if found else None


def test_a_launched_job_logs_into_its_launch_run_through_track(track_job: Any) -> None:
    from mlflow import MlflowClient

    from trainguard.evidence import Recorded
    from trainguard.report import CheckResult
    from trainguard.run.request import RunRequest
    from trainguard.tracking import plot_metrics, track_check

    runner = tracked_runner(track_job)
    tracker = runner.tracker
    assert tracker.session.created.wait(120)  # the store exists: the launch run is made at once
    with track_check(runner, "smoke", track_job.checks.smoke) as record:
        result = runner.run(RunRequest.make(steps=6, seed=0, world_size=2), label="tracked")
        assert result.ok, result.reason
        plot = plot_metrics([(0, result.points)], 2, track_job.state_dir / "check-plot.png", title="smoke")
        record(CheckResult("smoke", "passed", "ok", evidence=Recorded({"plots": [str(plot)]})))
    assert tracker.close().complete
    client = MlflowClient(tracker.tracking_uri)
    check_run = launch_run(tracker.tracking_uri, tracker.session.run_id, "smoke")
    run = launch_run(tracker.tracking_uri, check_run.info.run_id, "tracked")
    assert run is not None
    print("run id passed by", run.data.tags["trainguard.run_id_env"])
    assert run.data.tags["trainguard.run_id_env"] in ("env", "file")
    history = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "grad_norm")}
    assert history == {step: 10.0 + step for step in range(1, 7)}  # rank 0's, each step once
    assert sorted(m.step for m in client.get_metric_history(run.info.run_id, "loss")) == list(range(1, 7))
    # plots: the launch run's loss curve, and the check result's evidence plots on the check run
    assert "plots/loss.png" in {a.path for a in client.list_artifacts(run.info.run_id, "plots")}
    assert "plots/check-plot.png" in {a.path for a in client.list_artifacts(check_run.info.run_id, "plots")}
    png = Path(client.download_artifacts(run.info.run_id, "plots/loss.png", str(track_job.state_dir)))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_job_launched_before_its_run_exists_gets_the_id_through_a_file(
    track_job: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The store is locked (as by another xdist worker creating its schema) past the launch's
    wait: the job starts at once and its rank 0 logs into the run once the writer made it."""
    import fcntl

    from mlflow import MlflowClient

    from trainguard.run.request import RunRequest

    monkeypatch.setattr(tracking, "LAUNCH_RUN_WAIT_S", 0.2)
    lock_path = track_job.state_dir / "mlflow.db.lock"
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        runner = tracked_runner(track_job)
        timer = threading.Timer(3.0, fcntl.flock, (lock, fcntl.LOCK_UN))
        timer.start()
        started = time.monotonic()
        try:
            result = runner.run(RunRequest.make(steps=6, seed=0, world_size=2), label="late")
        finally:
            timer.join()
        assert result.ok, result.reason
    assert time.monotonic() - started < 60
    tracker = runner.tracker
    assert tracker.close().complete
    run = launch_run(tracker.tracking_uri, tracker.session.run_id, "late")
    assert run.data.tags["trainguard.run_id_env"] == "file"
    history = MlflowClient(tracker.tracking_uri).get_metric_history(run.info.run_id, "grad_norm")
    assert sorted((m.step, m.value) for m in history) == [(s, 10.0 + s) for s in range(1, 7)]


def test_metrics_are_in_the_store_while_the_job_runs(track_job: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A second client sees the loss of a slow job before it ends; at the end each step's rows
    are there exactly once (streamed live, the rest logged after the attempt, nothing twice)."""
    from mlflow import MlflowClient

    from trainguard.run.request import RunRequest

    monkeypatch.setattr(runs, "LIVE_INTERVAL_S", 1.0)  # a live point a second (default 5 s)
    runner = tracked_runner(track_job)
    tracker = runner.tracker
    assert tracker.session.created.wait(120)
    steps = 30
    reader = MlflowClient(tracker.tracking_uri)  # as `mlflow ui` would read the store
    seen: list[int] = []
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            run = launch_run(tracker.tracking_uri, tracker.session.run_id, "live")
            if run is not None:
                seen.append(len(reader.get_metric_history(run.info.run_id, "loss")))
            done.wait(0.3)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        request = RunRequest.make(steps=steps, seed=0, world_size=2, args=["--sleep", "0.25"])
        result = runner.run(request, label="live")
    finally:
        done.set()
        watcher.join()
    assert result.ok, result.reason
    # while the ranks ran (7.5 s at 0.25 s a step): a thinned live view, one row per second
    assert max(seen, default=0) >= 2, seen
    assert tracker.close().complete
    run = launch_run(tracker.tracking_uri, tracker.session.run_id, "live")
    for key in ("loss", "loss/rank0", "loss/rank1"):
        assert sorted(m.step for m in reader.get_metric_history(run.info.run_id, key)) == list(range(1, steps + 1))
    assert reader.get_metric_history(run.info.run_id, "system/rss_mb")


def test_live_rows_and_the_rows_logged_after_the_attempt_are_disjoint_and_complete() -> None:
    from trainguard.tracking import LiveMetrics

    tracker = Tracker("fake://store")
    client = FlakyClient(down=0)
    tracker._client = client
    handle = tracker.attach("run-1")
    live = LiveMetrics(tracker, handle, world_size=2, interval=0.0)
    points = [MetricPoint("loss", 1, 1.0, 0, 0.1), MetricPoint("loss", 1, 3.0, 1, 0.2),
              MetricPoint("loss", 2, 5.0, 0, 0.3)]  # rank 1 died before printing step 2
    for p in points:
        live.on_metric(p, None)
    assert live.sent == {("loss", 1)}  # live: the mean of the last step every rank printed
    after = [row for row in metric_rows(points, 2, 0) if (row[0], row[2]) not in live.sent]
    assert sorted((k, s, v) for k, v, s, _ in after) == [  # the rest, after the attempt
        ("loss", 2, 5.0), ("loss/rank0", 1, 1.0), ("loss/rank0", 2, 5.0), ("loss/rank1", 1, 3.0)]
    tracker.log_metrics(handle, after)
    assert tracker.close().complete
    logged = sorted((k, s, v) for k, v, s in client.metrics)
    assert logged == sorted((k, s, v) for k, v, s, _ in metric_rows(points, 2, 0))  # each row once


class FakeNvml:
    """Stands in for pynvml (no NVIDIA driver on this CI machine): two GPUs with fixed readings."""

    def nvmlDeviceGetCount(self) -> int:
        return 2

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        return i

    def nvmlDeviceGetUtilizationRates(self, h: int) -> Any:
        return type("Rates", (), {"gpu": 50 + h})()

    def nvmlDeviceGetMemoryInfo(self, h: int) -> Any:
        return type("Mem", (), {"used": (h + 1) * 2**30})()

    def nvmlDeviceGetPowerUsage(self, h: int) -> int:
        return 300_000  # mW

    def nvmlDeviceGetTemperature(self, h: int, sensor: int) -> int:
        return 60

    def nvmlDeviceGetName(self, h: int) -> bytes:
        return b"NVIDIA H100 80GB HBM3"

    def nvmlSystemGetCudaDriverVersion(self) -> int:
        return 12040

    def nvmlSystemGetDriverVersion(self) -> str:
        return "550.54.15"


def test_system_metrics_and_environment_include_gpus_when_nvml_is_there(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.metadata as md

    monkeypatch.setattr(system, "_NVML", FakeNvml())
    metrics = system.system_metrics()
    assert metrics["system/gpu1/utilization_percent"] == 51.0
    assert metrics["system/gpu1/memory_mb"] == 2048.0
    assert metrics["system/gpu0/power_w"] == 300.0
    assert metrics["system/gpu0/temperature_c"] == 60.0
    assert metrics["system/rss_mb"] > 0
    env = system.environment_snapshot()
    assert env["gpus"] == ["NVIDIA H100 80GB HBM3"] * 2
    assert env["cuda_driver"] == 12040 and env["nvidia_driver"] == "550.54.15"
    assert env["python"] == sys.version.split()[0]
    assert env["torch"] == md.version("torch")
    assert "cuda" in env and "nccl" in env
    assert any(p.startswith("torch==") for p in env["packages"])
    monkeypatch.setattr(system, "_NVML", False)  # no NVML here: no GPU metrics, no error
    assert not any(k.startswith("system/gpu") for k in system.system_metrics())


def test_metrics_streamed_point_by_point_are_written_in_a_few_batches() -> None:
    """One log_batch per ``metric_interval``, not one per printed line (the writer's CPU)."""
    tracker = Tracker("fake://store", metric_interval=0.5)
    client = FlakyClient(down=0)
    batches: list[int] = []
    log_batch = client.log_batch

    def counting(run_id: str, metrics: Any = (), params: Any = (), tags: Any = ()) -> None:
        batches.append(len(metrics))
        log_batch(run_id, metrics, params, tags)

    client.log_batch = counting  # type: ignore[method-assign]
    tracker._client = client
    handle = tracker.attach("run-1")
    started = time.monotonic()
    for step in range(150):  # 1.5 s of a job printing every 10 ms
        tracker.log_metrics(handle, [("loss", 1.0 / (step + 1), step, 0)])
        time.sleep(0.01)
    mid = len(batches)
    assert tracker.close().complete
    assert [m[2] for m in client.metrics] == list(range(150))
    assert 1 <= mid <= 2 + int((time.monotonic() - started) / 0.5), batches  # streamed, batched
    assert len(batches) <= mid + 1


def test_rows_another_process_may_have_logged_are_logged_once(
    tmp_path: Path, new_mlflow_store: Callable[[Path], Path]
) -> None:
    """A Ray worker killed between its write and its record leaves steps in the run that its
    record does not name: the launcher's backfill (log_metrics_once) must not log them again."""
    from mlflow import MlflowClient

    uri = f"sqlite:///{new_mlflow_store(tmp_path / 'mlflow.db')}"
    tracker = Tracker(uri, artifact_location=str(tmp_path / "artifacts"))
    handle = tracker.start_run("launch")
    tracker.log_metrics(handle, [("loss", 1.0 / s, s, 1000 + s) for s in (1, 2, 3)])  # the worker's write
    tracker.log_metrics_once(handle, [("loss", 1.0 / s, s, 2000 + s) for s in (1, 2, 3, 4, 5)]
                             + [("lr", 0.1, 1, 2001)])
    assert tracker.close().complete
    assert handle.run_id is not None
    client = MlflowClient(uri)
    steps = sorted(m.step for m in client.get_metric_history(handle.run_id, "loss"))
    assert steps == [1, 2, 3, 4, 5]
    assert [m.step for m in client.get_metric_history(handle.run_id, "lr")] == [1]
