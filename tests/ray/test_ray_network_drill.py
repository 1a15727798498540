"""The network drill on a Ray Train job: a slow tracking server must not slow training.

A real local Ray, a real ``mlflow server`` and trainguard's Toxiproxy-compatible proxy in front
of it. The drill (``fault: network, service: mlflow``) points the Ray workers' designated writer
(world rank 0, :mod:`trainguard.raytrain.tracking`) at the proxied server and a run it created
there -- with the session's tracking off, as tests/conftest.py sets it -- adds 3 s of latency to
every answer after step 8 for ``duration`` seconds, and expects ``continue``:

* clean (tests/data/jobs/toy_ray.py as is): the writer logs from a background thread, so the
  step rate holds, and every reported step reaches the drill's run once the toxic is gone;
* planted defect (``sync_mlflow: true``): rank 0 also calls ``mlflow.log_metric`` inside its loop
  (MLflow's fluent API, synchronous, to ``MLFLOW_TRACKING_URI`` -- the proxy too): every step
  waits for the store, the step rate falls and the drill fails.

Ray Train V2 hands each ``ray.train.report`` to its controller through a queue of one, drained
every ``RAY_TRAIN_HEALTH_CHECK_INTERVAL_S`` (2 s by default): a function reporting faster than
that is paced by Ray, and a blocking call shorter than the slack costs it nothing (the drill then
rightly passes: training was not slowed). The module's Ray head runs with 0.25 s, so the toy's
own step time (~0.3 s) shows.

Three fits on one Ray head (the reference and the two drills) and two MLflow servers: ``slow``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.helpers import report_evidence
from trainguard.config import load_config
from trainguard.drills import run_drill
from trainguard.raytrain.local_ray import running_ray_processes
from trainguard.report import CheckResult
from trainguard.run.runner import JobRunner

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(900)]
pytest.importorskip("ray.train", reason="needs ray[train] (pip install trainguard[ray])")
pytest.importorskip("mlflow", reason="needs mlflow (pip install trainguard[tracking])")

JOBS = Path(__file__).resolve().parents[1] / "data" / "jobs"
MIN_RATE = 0.5
JOB = """
job:
  name: toy-ray-net
  kind: ray_train
  train_func: "toy_ray:train_func"
  config: {{steps: "{{steps}}", seed: "{{seed}}", ckpt_every: 5, sleep: 0.25{extra}}}
  scaling: {{num_workers: 2, resources_per_worker: {{CPU: 1}}}}
  cwd: {cwd}
  env: {{OMP_NUM_THREADS: "1"}}
  metrics: [loss]
  timeout: 300
  stall_timeout: 120
checks:
  drills:
    - {{name: slow-tracking, fault: network, steps: 40, after_step: 8, duration: 8,
        expect: continue, min_rate: {min_rate},
        params: {{service: mlflow, toxic: latency, attributes: {{latency: 3000}}}}}}
"""

Drill = Callable[[str], CheckResult]


@pytest.fixture(scope="module")
def drill(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Drill]:
    """``drill(extra)`` runs the network drill of the toy job (``extra``: more config keys) on
    the module's Ray head; the uninterrupted reference run is the clean job's, shared."""
    runners: list[JobRunner] = []
    env = pytest.MonkeyPatch()
    # the head's processes (Ray Train's controller among them) inherit it; restored after
    env.setenv("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.25")

    def runner_for(extra: str) -> JobRunner:
        folder = tmp_path_factory.mktemp("job")
        path = folder / "trainguard.yaml"
        path.write_text(JOB.format(cwd=JOBS, min_rate=MIN_RATE, extra=f", {extra}" if extra else ""))
        job = load_config(path)
        runner = runners[0].sibling(job) if runners else JobRunner(job)
        runners.append(runner)
        return runner

    def run(extra: str) -> CheckResult:
        if not runners:
            runner_for("")  # the clean job's runner owns the head and the reference run
        runner = runner_for(extra)
        spec = runner.job_file.checks.drills[0]
        request = runner.request_for(spec, world_size=runner.job_file.job.world_size)
        # a run that is never interrupted does not depend on the defect (which only logs)
        runner.scheduling.offer_reference(request, runners[0].scheduling.reference(request))
        return run_drill(runner, spec)

    try:
        yield run
    finally:
        env.undo()
        head = runners[0].backend.head if runners else None
        temp = head.cluster.temp_dir if head is not None and head.cluster is not None else None
        if runners:
            runners[0].close()
        if temp is not None:
            left = running_ray_processes(temp)
            assert not left, f"Ray processes left behind: {[p.pid for p in left]}"


def show(result: CheckResult) -> None:
    """The verdict, the step rates and what reached the store (shown with pytest -rA)."""
    ev = report_evidence(result)
    fault = ev.get("fault_evidence", {})
    print(result.status, result.summary)
    print({"step_rate": ev.get("step_rate"), "ray_writer": fault.get("ray_writer"),
           "mlflow_started_in_s": fault.get("mlflow_started_in_s")},
          f"duration {result.duration_s:.1f} s")


def run_shown(drill: Drill, extra: str) -> CheckResult:
    """The drill's result, printed; a drill that could not run here skips the test."""
    result = drill(extra)
    show(result)
    if result.status == "skipped":
        pytest.skip(result.summary)
    return result


def test_async_writer_keeps_the_rate_and_every_step_reaches_the_drill_run(drill: Drill) -> None:
    result = run_shown(drill, "")
    assert result.status == "passed", result.summary
    ev = report_evidence(result)
    fault = ev["fault_evidence"]
    assert fault["toxic"] == "latency" and fault["drill_run_id"]
    writer = fault["ray_writer"]["writer"]
    assert writer["run_id"] == fault["drill_run_id"] and writer["dropped_rows"] == 0
    assert writer["written_rows"] >= 40 and writer["write_s"] >= 2.0  # it did wait on the toxic
    assert fault["ray_writer"]["stored_steps"] == {"loss": 40}
    assert fault["ray_writer"]["reported_steps"] == {"loss": 40}
    assert ev["step_rate"]["during_over_before"] >= MIN_RATE
    assert ev["trajectory"]["compared_steps"] == 40


def test_synchronous_fluent_logging_in_the_loop_is_caught(drill: Drill) -> None:
    result = run_shown(drill, "sync_mlflow: true")
    assert result.status == "failed", result.summary
    assert "step rate during the fault fell" in result.summary
    rates = report_evidence(result)["step_rate"]
    assert rates["during_over_before"] < MIN_RATE
    # the asynchronous writer still delivered everything: the rate is the only problem
    assert "never reached" not in result.summary and "dropped" not in result.summary
