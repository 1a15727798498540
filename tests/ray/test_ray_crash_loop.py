"""``fault: crash_loop`` on a Ray Train job (slow): Ray Train's ``FailureConfig(max_failures)``
(``job.max_restarts``) is the policy under test. SIGKILL reaches rank 0's Ray worker at step 5
of every worker generation (tests/data/jobs/toy_ray.py: 2 workers, a checkpoint every 3 steps,
which Ray Train restores in the next generation); each generation's wait is measured from the
kill to the next sighting of the worker, and its node is noted. Clean: max_failures 2 with a cap
of 3 attempts passes; planted defect: max_failures 10 does not stop by the cap."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import report_evidence
from tests.ray.test_ray_drills import JOB, JOBS
from trainguard.config import load_config
from trainguard.drills import run_drill
from trainguard.raytrain.local_ray import running_ray_processes
from trainguard.run.runner import JobRunner

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(900)]
pytest.importorskip("ray.train", reason="needs ray[train] (pip install trainguard[ray])")

SPEC = "{name: loop, fault: crash_loop, steps: 9, after_step: 5, params: {max_attempts: 3}}"


@pytest.mark.parametrize(("max_restarts", "status", "words"), [
    (2, "passed", "the policy stopped after 3 attempt(s) (cap 3)"),
    (10, "failed", "did not stop by its cap of 3 attempt(s): attempt 4 started"),
], ids=["max-failures-2", "max-failures-10"])
def test_ray_trains_failure_config_under_a_crash_loop(tmp_path: Path, max_restarts: int, status: str,
                                                      words: str) -> None:
    path = tmp_path / "trainguard.yaml"
    path.write_text(JOB.format(cwd=JOBS, max_restarts=max_restarts, drill=SPEC, extra=""))
    job = load_config(path)
    runner = JobRunner(job)
    try:
        result = run_drill(runner, job.checks.drills[0])
    finally:
        head = runner.backend.head  # type: ignore[attr-defined]
        temp = head.cluster.temp_dir if head is not None and head.cluster is not None else None
        runner.close()
    assert not callable(result)
    evidence = report_evidence(result)
    print(result.status, result.summary)
    print([(a["attempt"], a["struck_at_step"], a["first_step"], a["wait_before_s"], a.get("node"))
           for a in evidence["attempts"]], evidence["rank_seconds"])
    assert result.status == status and words in result.summary, result.summary
    assert evidence["failing_step"] == 5
    if temp is not None:
        assert not running_ray_processes(temp)
