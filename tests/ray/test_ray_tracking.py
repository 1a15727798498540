"""MLflow tracking from Ray Train workers: the designated writer (world rank 0) and how it shares
the launch run with trainguard's launcher without logging a step twice.

The writer itself is tested in this process against real stores (a sqlite file; a closed port and
a server that never answers for a store that is down). Two tests run a real 2-worker fit on a
real local Ray (one fit each, marker ``ray``): a clean one (slow: the default run of
test_digits_ray.py checks every launch of its 7 fits the same way), and one whose workers cannot
reach the store -- training must still pass and trainguard must report the dropped rows and log
the steps itself, each exactly once.
"""

from __future__ import annotations

import io
import json
import shutil
import socket
import time
import warnings
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("mlflow")

from trainguard.raytrain.tracking import (
    SUMMARY_FILE,
    WorkerWriter,
    read_summary,
    reconcile,
    worker_env,
    writer_from_env,
)

pytestmark = pytest.mark.timeout(600)

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def new_run(uri: str) -> str:
    from mlflow import MlflowClient

    client = MlflowClient(uri)
    exp = client.get_experiment_by_name("t") or None
    exp_id = exp.experiment_id if exp is not None else client.create_experiment("t")
    return str(client.create_run(exp_id).info.run_id)


def history(uri: str, run_id: str, key: str) -> list[tuple[int, float]]:
    from mlflow import MlflowClient

    return [(m.step, m.value) for m in MlflowClient(uri).get_metric_history(run_id, key)]


@pytest.fixture
def dead_port() -> int:
    """A loopback port nothing listens on (connection refused)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def silent_server() -> Iterator[int]:
    """A loopback port that accepts connections and never answers (a hung tracking server)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(64)
        yield int(s.getsockname()[1])


# ------------------------------------------------------------------------------------------------
# the writer, in this process


def test_writer_logs_every_step_once_in_batches(tmp_path: Path) -> None:
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    run_id = new_run(uri)
    out = io.StringIO()
    writer = WorkerWriter(uri, run_id=run_id, summary_path=tmp_path / SUMMARY_FILE, flush_interval=0.5, out=out)
    t0 = time.perf_counter()
    for step in range(1, 301):
        writer.log(step, {"loss": 1.0 / step, "lr": 0.01, "note": "text", "flag": True, "bad key!": 1.0})
    per_call_us = (time.perf_counter() - t0) / 300 * 1e6
    summary = writer.close()
    print(f"\nlog(): {per_call_us:.0f} us per call; {summary.requests} log_batch request(s) in "
          f"{summary.write_s:.2f} s ({summary.cpu_s:.2f} s CPU of the writer "
          f"thread) for {summary.written_rows} rows")
    assert summary.written_rows == 600 and summary.dropped_rows == 0
    assert summary.written_steps == set(range(1, 301)) and summary.keys == {"loss", "lr"}
    assert summary.requests <= 10  # batched: 1000 rows a request at most
    # log() only enqueues, but its time per call is not asserted: the writer thread opening the
    # sqlite store holds the GIL, so on a loaded machine the loop waits on it (3.8 ms a call in CI
    # at load 3). That log() never waits on the store is what the two tests below assert, against
    # a store that is down and one that never answers.
    loss = history(uri, run_id, "loss")
    assert sorted(s for s, _ in loss) == list(range(1, 301))  # every step, once
    assert "trainguard-tracking run=" in out.getvalue() and "written=600 dropped=0" in out.getvalue()
    saved = read_summary(tmp_path)
    assert saved is not None and saved.closed and saved.written_steps == set(range(1, 301))


def test_a_store_that_is_down_never_blocks_and_the_drops_are_counted(tmp_path: Path, dead_port: int) -> None:
    # mlflow imported here first: the writer's thread imports it at start (~3 s of CPU, holding the
    # GIL), which on a loaded machine slowed this loop to 8.7 s; what is measured is the store
    import mlflow  # noqa: F401

    out = io.StringIO()
    writer = WorkerWriter(f"http://127.0.0.1:{dead_port}", run_id="abc", summary_path=tmp_path / SUMMARY_FILE,
                          flush_interval=0.1, out=out)
    t0 = time.perf_counter()
    for step in range(1, 51):
        writer.log(step, {"loss": 0.5})
        time.sleep(0.01)
    logging_s = time.perf_counter() - t0
    t1 = time.perf_counter()
    summary = writer.close(timeout=10)
    close_s = time.perf_counter() - t1
    print(f"\nstore down: 50 reports in {logging_s:.2f} s, close in {close_s:.2f} s, dropped {summary.dropped_rows}")
    # never waited on the dead store: 0.5 s of sleeps (a log that waited on the store's retries
    # would take seconds each); the close is bounded at 1 s
    assert logging_s < 10 and close_s < 5
    assert summary.written_rows == 0 and summary.dropped_rows == 50 and summary.dropped_steps == set(range(1, 51))
    assert out.getvalue().count("WARNING") == 1  # warned once
    assert "dropped=50" in out.getvalue() and "the store was unreachable (" in summary.reason


def test_a_hung_store_is_bounded_by_the_queue_and_the_close_timeout(tmp_path: Path, silent_server: int) -> None:
    out = io.StringIO()
    writer = WorkerWriter(f"http://127.0.0.1:{silent_server}", run_id="abc", flush_interval=0.05,
                          max_rows=20, out=out)
    t0 = time.perf_counter()
    for step in range(100):
        writer.log(step, {"loss": 1.0, "acc": 0.5})
    # a log() that waited on this server would wait out an HTTP timeout (minutes); 5 s is margin
    assert time.perf_counter() - t0 < 5.0
    t1 = time.perf_counter()
    summary = writer.close(timeout=1.5)
    close_s = time.perf_counter() - t1
    print(f"\nhung store: close in {close_s:.2f} s, dropped {summary.dropped_rows} of 200 rows")
    assert close_s < 4
    assert summary.dropped_rows == 200 and summary.written_rows == 0
    assert "more than 20 rows waiting" in summary.reason


def test_only_world_rank_0_writes_and_tracking_off_means_no_writer(tmp_path: Path) -> None:
    env = {"TRAINGUARD_MLFLOW_RUN_ID": "abc", "TRAINGUARD_MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path}/m.db",
           "TRAINGUARD_RUN_DIR": str(tmp_path)}
    assert writer_from_env(1, env) is None
    assert writer_from_env(0, {**env, "TRAINGUARD_TRACKING": "off"}) is None
    assert writer_from_env(0, {k: v for k, v in env.items() if k != "TRAINGUARD_MLFLOW_RUN_ID"}) is None
    writer = writer_from_env(0, env)
    assert writer is not None and writer.summary_path == tmp_path / SUMMARY_FILE
    writer.close(timeout=1)
    passed = worker_env({**env, "UNRELATED": "x"})
    assert set(passed) == {*env, "TRAINGUARD_RAY_DRIVER"} and passed["TRAINGUARD_RAY_DRIVER"].endswith(
        f":{__import__('os').getpid()}")


def test_a_file_store_on_another_machine_is_not_written(tmp_path: Path) -> None:
    out = io.StringIO()
    writer = WorkerWriter(f"sqlite:///{tmp_path}/m.db", run_id="abc", driver="some-other-host:1", out=out)
    writer.log(1, {"loss": 1.0})
    summary = writer.close(timeout=1)
    assert summary.dropped_rows == 1 and "is a file on the driver's machine some-other-host" in summary.reason
    assert not (tmp_path / "m.db").exists()


def test_reconcile_logs_only_the_steps_the_writer_did_not(tmp_path: Path) -> None:
    from trainguard.launch import RunResult

    result = RunResult.__new__(RunResult)
    result.run_dir = tmp_path  # only run_dir and log_path are read
    rows = [("loss", 1.0, s, 0) for s in range(1, 7)]
    left, tags, note = reconcile(result, rows)
    assert left == rows and tags["trainguard.ray_writer"] == "none" and note is None  # no writer
    (tmp_path / SUMMARY_FILE).write_text(json.dumps({
        "run_id": "r", "written_rows": 4, "dropped_rows": 2, "written_steps": [[1, 4]],
        "dropped_steps": [[5, 6]], "keys": ["loss"], "closed": True, "reason": "store down"}))
    left, tags, note = reconcile(result, rows)
    assert [r[2] for r in left] == [5, 6]
    assert tags["trainguard.ray_writer.dropped_rows"] == "2" and tags["trainguard.ray_writer.backfilled_rows"] == "2"
    assert note is not None and "dropped 2 metric row(s)" in note and "store down" in note
    left, tags, _ = reconcile(result, rows, run_id="another-run")  # it wrote elsewhere: log all
    assert left == rows and tags["trainguard.ray_writer"] == "none"


# ------------------------------------------------------------------------------------------------
# real fits on a real local Ray (one 2-worker fit each)


def ray_job(tmp_path: Path, extra_env: str = "") -> Path:
    pytest.importorskip("ray.train", reason="needs ray[train] (pip install trainguard[ray])")
    ignore = shutil.ignore_patterns(".trainguard", "__pycache__")
    shutil.copytree(EXAMPLES / "digits", tmp_path / "digits", ignore=ignore)
    shutil.copytree(EXAMPLES / "digits_ray", tmp_path / "digits_ray", ignore=ignore)
    job = tmp_path / "digits_ray" / "trainguard.yaml"
    text = job.read_text()
    text = text[: text.index("checks:")] + "checks:\n  smoke: {steps: 8}\n"
    if extra_env:
        text = text.replace('OMP_NUM_THREADS: "1"}', f'OMP_NUM_THREADS: "1", {extra_env}}}')
    job.write_text(text)
    return job


def tracked_run(job: Path, steps: int = 8) -> tuple[Any, list[str], str, Any]:
    """One launch of the job with tracking on (one fit): its result, the tracking warnings, the
    store's URI and the launch run."""
    import os

    from mlflow import MlflowClient

    from trainguard.config import load_config
    from trainguard.config.settings import resolve
    from trainguard.run.request import RunRequest
    from trainguard.run.runner import JobRunner
    from trainguard.tracking import open_tracker

    job_file = load_config(job)
    settings = resolve(environ=os.environ)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tracker = open_tracker(job_file, settings, run_name="ray tracking test")
        assert tracker is not None
        runner = JobRunner(job_file, settings, tracker=tracker)
        try:
            result = runner.run(RunRequest.make(steps=steps, seed=0, world_size=2), label="tracked")
        finally:
            runner.close()
            flushed = tracker.close()
    assert flushed.complete, flushed
    client = MlflowClient(tracker.tracking_uri)
    exp = client.get_experiment_by_name("trainguard")
    assert exp is not None
    (run,) = [r for r in client.search_runs([exp.experiment_id]) if r.data.tags.get("trainguard.kind") == "launch"]
    return result, [str(w.message) for w in caught], tracker.tracking_uri, run


@pytest.fixture
def tracking_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRAINGUARD_TRACKING", "on")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)


@pytest.mark.ray
@pytest.mark.slow  # the default run checks the same on every launch of tests/ray/test_digits_ray.py
@pytest.mark.usefixtures("tracking_on")
def test_workers_log_every_reported_step_exactly_once(tmp_path: Path) -> None:
    job = ray_job(tmp_path)
    result, caught, uri, run = tracked_run(job)
    assert result.ok, result.reason
    tags = run.data.tags
    print(f"\nwriter: {tags.get('trainguard.ray_writer.written_rows')} rows written by world rank 0 in "
          f"{tags.get('trainguard.ray_writer.requests')} requests ({tags.get('trainguard.ray_writer.cpu_s')} s CPU), "
          f"{tags.get('trainguard.ray_writer.backfilled_rows')} by the launcher; fit {result.duration_s:.1f} s")
    assert tags["trainguard.ray_writer"] == "world rank 0"
    assert tags["trainguard.ray_writer.written_rows"] == "8" and tags["trainguard.ray_writer.dropped_rows"] == "0"
    assert tags["trainguard.ray_writer.backfilled_rows"] == "0"  # nothing logged twice
    steps = Counter(s for s, _ in history(uri, run.info.run_id, "loss"))
    assert steps == Counter(range(1, 9)), steps  # every reported step, exactly once
    assert not [w for w in caught if "Ray workers' writer" in w]
    summary = read_summary(result.run_dir)
    assert summary is not None and summary.closed and summary.run_id == run.info.run_id


@pytest.mark.ray
@pytest.mark.slow  # a Ray fit: the default run's Ray budget is spent on tests/ray/test_digits_ray.py
@pytest.mark.usefixtures("tracking_on")
def test_workers_that_cannot_reach_the_store_do_not_stop_training(tmp_path: Path, dead_port: int) -> None:
    """Planted defect: the job points its workers at a tracking server that is down."""
    job = ray_job(tmp_path, f'TRAINGUARD_MLFLOW_TRACKING_URI: "http://127.0.0.1:{dead_port}"')
    result, caught, uri, run = tracked_run(job)
    assert result.ok, result.reason  # training finished
    notes = [w for w in caught if "Ray workers' writer" in w]
    assert notes and "dropped 8 metric row(s) of 8 step(s)" in notes[0], caught
    assert "the store was unreachable (" in notes[0]
    print(f"\n{notes[0]}\nfit {result.duration_s:.1f} s")
    assert run.data.tags["trainguard.ray_writer.dropped_rows"] == "8"
    assert run.data.tags["trainguard.ray_writer.backfilled_rows"] == "8"
    steps = Counter(s for s, _ in history(uri, run.info.run_id, "loss"))
    assert steps == Counter(range(1, 9)), steps  # the launcher logged them, once
