"""``fault: crash_loop`` on a Ray Train job (slow): Ray Train's ``FailureConfig(max_failures)``
(``job.max_restarts``) is the policy under test. SIGKILL reaches rank 0's Ray worker at step 5
of every worker generation (tests/data/jobs/toy_ray.py: 2 workers, a checkpoint every 3 steps,
which Ray Train restores in the next generation); each generation's wait is measured from the
kill to the next sighting of the worker, and its node is noted. Clean: max_failures 2 with a cap
of 3 attempts passes, with SIGKILL and with ``how: raise`` (the train function of rank 0's worker
raises at the step in every generation); planted defects: max_failures 10 does not stop by the
cap, and ``min_backoff_s: 120`` fails a policy that has no backoff setting on the waits it
measured."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import report_evidence
from tests.ray.test_ray_drills import JOB, JOBS
from trainguard.config import load_config
from trainguard.drills import run_drill
from trainguard.faults.hook import read_events
from trainguard.raytrain.local_ray import running_ray_processes
from trainguard.run.runner import JobRunner

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(900)]
pytest.importorskip("ray.train", reason="needs ray[train] (pip install trainguard[ray])")

SPEC = "{{name: loop, fault: crash_loop, steps: 9, after_step: 5, params: {{max_attempts: 3{params}}}}}"
NO_BACKOFF = "(Ray Train's FailureConfig has no backoff setting: its wait is the worker group's teardown and restart)"


@pytest.mark.parametrize(("max_restarts", "params", "status", "words"), [
    (2, "", "passed", "the policy stopped after 3 attempt(s) (cap 3)"),
    (10, "", "failed", "did not stop by its cap of 3 attempt(s): attempt 4 started"),
    (2, ", min_backoff_s: 120", "failed", "less than min_backoff_s 120 " + NO_BACKOFF),
    (2, ", how: raise", "passed", "the policy stopped after 3 attempt(s) (cap 3)"),
], ids=["max-failures-2", "max-failures-10", "no-backoff", "how-raise"])
def test_ray_trains_failure_config_under_a_crash_loop(tmp_path: Path, max_restarts: int, params: str, status: str,
                                                      words: str) -> None:
    path = tmp_path / "trainguard.yaml"
    path.write_text(JOB.format(cwd=JOBS, max_restarts=max_restarts, drill=SPEC.format(params=params), extra=""))
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
    print([(a["attempt"], a["struck_at_step"], a.get("reached_step"), a["first_step"], a["wait_before_s"],
            a.get("node")) for a in evidence["attempts"]], evidence["rank_seconds"])
    assert result.status == status and words in result.summary, result.summary
    assert evidence["failing_step"] == 5
    assert evidence["backoff_setting"] == NO_BACKOFF[1:-1]
    if "raise" in params:  # the train function raised, once in each generation's worker of rank 0
        events = read_events(Path(evidence["drill_dir"]) / "crash_loop.events.jsonl")
        raised = [e for e in events if e["event"] == "raised"]
        assert len(raised) == 3 and len({e["pid"] for e in raised}) == 3, events
        assert all(e["thread"] != "MainThread" for e in raised), raised
    if temp is not None:
        assert not running_ray_processes(temp)
