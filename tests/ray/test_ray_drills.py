"""Fault drills on a Ray Train job, on a real local Ray: the faults hit real Ray worker processes.

The job is tests/data/jobs/toy_ray.py (2 workers, a gloo all-reduce per step, a checkpoint every
3 steps). One embedded Ray head serves the whole module and one uninterrupted reference run is
shared by every drill (the runners of the planted-defect variants reuse it: a run that is never
interrupted does not depend on the defect), so each drill costs one fit.

Default run: kill_rank (`expect: recover`) -- Ray Train's FailureConfig restarts the worker group
inside the same fit and the trajectory matches the reference -- and its planted defect,
``max_restarts: 0`` (FailureConfig(max_failures=0)), which must fail the drill. Slow: hang
(trainguard's stall detection, then a resumed fit), oom (a real cgroup OOM kill) and disk_full
(a real ENOSPC on the storage path), each clean case with a planted defect.
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

pytestmark = [pytest.mark.ray, pytest.mark.timeout(900)]
pytest.importorskip("ray.train", reason="needs ray[train] (pip install trainguard[ray])")

JOBS = Path(__file__).resolve().parents[1] / "data" / "jobs"
STEPS = 16
JOB = """
job:
  name: toy-ray
  kind: ray_train
  train_func: "toy_ray:train_func"
  config: {{steps: "{{steps}}", seed: "{{seed}}", ckpt_every: 3, sleep: 0.25{extra}}}
  scaling: {{num_workers: 2, resources_per_worker: {{CPU: 1}}}}
  cwd: {cwd}
  env: {{OMP_NUM_THREADS: "1"}}
  metrics: [loss]
  max_restarts: {max_restarts}
  timeout: 300
  stall_timeout: 120
checks:
  drills:
    - {drill}
"""

Drill = Callable[..., CheckResult]


@pytest.fixture(scope="module")
def drill(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Drill]:
    """``drill(spec, max_restarts=1, extra="")`` runs one drill of the toy job on the module's
    Ray head; every runner shares the head and the uninterrupted reference runs."""
    runners: list[JobRunner] = []

    def run(spec: str, *, max_restarts: int = 1, extra: str = "") -> CheckResult:
        folder = tmp_path_factory.mktemp("job")
        path = folder / "trainguard.yaml"
        path.write_text(JOB.format(cwd=JOBS, max_restarts=max_restarts, drill=spec,
                                   extra=f", {extra}" if extra else ""))
        job = load_config(path)
        drill_spec = job.checks.drills[0]
        if runners:
            runner = runners[0].sibling(job)  # one Ray head
            # one reference for all: a run that is never interrupted does not depend on the defect
            request = runner.request_for(drill_spec, world_size=job.job.world_size)
            runner.scheduling.offer_reference(request, runners[0].scheduling.reference(request))
        else:
            runner = JobRunner(job)
        runners.append(runner)
        return run_drill(runner, drill_spec)

    try:
        yield run
    finally:
        head = runners[0].backend.head if runners else None
        temp = head.cluster.temp_dir if head is not None and head.cluster is not None else None
        if runners:
            runners[0].close()  # the head they share
        if temp is not None:  # every process of our head and of the drills' fits is gone
            left = running_ray_processes(temp)
            assert not left, f"Ray processes left behind: {[p.pid for p in left]}"


def show(result: CheckResult) -> None:
    """The verdict and the measured times (shown with pytest -rA)."""
    ev = report_evidence(result)
    print(result.status, result.summary)
    keys = ("detected_after_s", "lost_steps", "restarts", "fault_to_first_step_after_restart_s",
            "exit_after_s", "resumed_from_step", "ray")
    print({k: ev[k] for k in keys if k in ev}, f"duration {result.duration_s:.1f} s")


@pytest.mark.slow  # the default run's kill drill runs on the Ray example (tests/ray/test_digits_ray.py)
def test_kill_rank_recovers_through_ray_trains_failure_config(drill: Drill) -> None:
    result = drill(f"{{name: kill, fault: kill_rank, rank: 1, steps: {STEPS}, after_step: 8, "
                   "max_lost_steps: 4}")
    show(result)
    assert result.status == "passed", result.summary
    ev = report_evidence(result)
    ray = ev["ray"]
    assert ray["restarts"] == 1 and ray["max_failures"] == 1
    assert ev["restarts"] == 1 and len(ev["attempts"]) == 1  # inside one fit: no trainguard restart
    killed = ev["fault_evidence"]["pid"]
    assert ev["fault_evidence"]["ray_worker"] and killed == ray["workers_at_fault"][1]
    assert killed not in ray["workers_after"].values()
    assert 0 <= ev["lost_steps"] <= 4
    assert ray["resume"]["resumed_from_step"] % 3 == 0 and ray["resume"]["resumed_from_step"] > 0
    assert ev["trajectory"]["compared_steps"] == STEPS
    assert 0 < ray["failure_noticed_after_s"] <= ray["first_step_after_s"]
    assert "restarted the worker group 1 time(s) in the same fit" in result.summary


@pytest.mark.slow  # the default run's Ray budget (~6 fits) holds the clean kill drill only
def test_kill_rank_with_max_failures_0_fails_the_drill(drill: Drill) -> None:
    result = drill(f"{{name: kill, fault: kill_rank, rank: 1, steps: {STEPS}, after_step: 8}}",
                   max_restarts=0)
    show(result)
    assert result.status == "failed", result.summary
    assert "Ray Train did not recover" in result.summary
    assert "FailureConfig(max_failures=0)" in result.summary
    assert report_evidence(result)["attempts"][0]["outcome"] == "failed"
    assert report_evidence(result)["ray"].get("restarts", 0) == 0


@pytest.mark.slow
def test_hang_is_detected_by_trainguard_and_the_fit_resumed(drill: Drill) -> None:
    spec = f"{{name: hang, fault: hang, rank: 1, steps: {STEPS}, after_step: 8, stall_timeout: 15}}"
    result = drill(spec)
    show(result)
    assert result.status == "passed", result.summary
    ev = report_evidence(result)
    first = ev["attempts"][0]
    assert first["outcome"] == "hung" and ev["restarts"] == 1
    assert ev["fault_evidence"]["state_after_stop"] == "stopped"
    assert 0 < ev["lost_steps"] <= 4
    # planted defect: a function that ignores ray.train.get_checkpoint() starts again at step 1
    defect = drill(spec, extra="ignore_checkpoint: true")
    show(defect)
    assert defect.status == "failed" and "all progress lost" in defect.summary


@pytest.mark.slow
def test_oom_kills_the_worker_in_its_cgroup_and_the_fit_fails_cleanly(drill: Drill) -> None:
    spec = (f"{{name: oom, fault: oom, rank: 1, steps: {STEPS}, after_step: 8, expect: fail_clean, "
            "params: {mode: cgroup}}")
    result = drill(spec, max_restarts=0)
    show(result)
    if result.status == "skipped":
        pytest.skip(result.summary)
    assert result.status == "passed", result.summary
    fault = report_evidence(result)["fault_evidence"]
    assert fault["mode_ran"] == "cgroup" and fault["cgroup_counters"]["oom_kill"] >= 1
    assert "killed by the kernel OOM killer" in result.summary
    assert report_evidence(result)["checkpoint"]["intact"]
    # planted defect: the checkpoint cannot be resumed (the function ignores it)
    defect = drill(spec, max_restarts=0, extra="ignore_checkpoint: true")
    show(defect)
    assert defect.status == "failed" and "started again from step 1" in defect.summary


@pytest.mark.slow
def test_oom_with_max_failures_recovers_in_the_same_fit(drill: Drill) -> None:
    spec = (f"{{name: oom-recover, fault: oom, rank: 0, steps: {STEPS}, after_step: 8, "
            "expect: recover, params: {mode: cgroup}}")
    result = drill(spec, max_restarts=1)
    show(result)
    if result.status == "skipped":
        pytest.skip(result.summary)
    assert result.status == "passed", result.summary
    assert report_evidence(result)["ray"]["restarts"] == 1


@pytest.mark.slow
def test_disk_full_on_the_storage_path_fails_cleanly_and_resumes(drill: Drill) -> None:
    spec = (f"{{name: disk, fault: disk_full, steps: {STEPS}, after_step: 7, expect: fail_clean, "
            "deadline: 40, params: {mode: tmpfs, size_mb: 16}}")
    result = drill(spec, max_restarts=0)
    show(result)
    if result.status == "skipped":
        pytest.skip(result.summary)
    assert result.status == "passed", result.summary
    assert "ENOSPC" in result.summary or "No space left" in str(report_evidence(result))
    assert report_evidence(result)["checkpoint"]["intact"]
    # planted defect: rank 0 catches its failed checkpoint report and goes on; its workers' report
    # calls no longer pair up and the fit hangs instead of failing
    defect = drill(spec, max_restarts=0, extra="swallow_checkpoint_errors: true")
    show(defect)
    assert defect.status == "failed" and "the job hung" in defect.summary
