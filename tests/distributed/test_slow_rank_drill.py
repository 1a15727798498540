"""``fault: slow_rank``: one rank throttled to a fraction of a CPU (a real cgroup CPU quota).

The toy job (tests/data/jobs/toy_train.py, no torch) does ``--work-ms`` of CPU work per step and
ends every step in a barrier of both ranks (``--sync-dir``), so the whole job runs at the slowed
rank's pace, as synchronous training does. The clean job rides the throttle out; the planted one
has a collective timeout shorter than a slowed step and fails, with the timeout named.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.helpers import report_evidence, toy_job
from trainguard.report import CheckResult
from trainguard.session import drill

pytestmark = [pytest.mark.timeout(240),
              pytest.mark.skipif(os.geteuid() != 0, reason="a CPU cgroup needs root")]

DRILLS = [
    # 110 steps after the trigger (~2.5 s): at 60 (~1.2 s) a loaded machine once read step 10 after
    # the job had finished, and the fault found rank 1 gone
    # (after step 30: the rate before is measured over 0.6 s of steps, not 0.2)
    "{name: slow, fault: slow_rank, rank: 1, steps: 140, after_step: 30, duration: 1.5, params: {fraction: 0.1}}",
    # 50 ms of work at 1% of a CPU: a step of ~5 s against a 2 s collective timeout. The fault may
    # land mid-step (a shorter first wait), so it lasts 10 s: a whole slowed step always follows
    '{name: slow-timeout, fault: slow_rank, rank: 1, steps: 40, after_step: 10, duration: 10, params: {fraction: 0.01}, args: "--work-ms 50 --sync-timeout 2"}',
]


def slow_job(directory: Path) -> Path:
    """The toy job doing CPU work each step, every step a barrier, with the drills above."""
    return toy_job(directory / "slow.trainguard.yaml", "toy-slow", "--work-ms 20 --sync-dir {run_dir}/sync", DRILLS)


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, CheckResult]:
    path = slow_job(tmp_path_factory.mktemp("slow"))
    return {c.name.removeprefix("drill:"): c for c in drill(str(path)).checks}


def test_the_job_runs_at_the_slowed_ranks_pace_and_completes(results: dict[str, CheckResult]) -> None:
    result = results["slow"]
    assert result.status == "passed", result.summary
    fault = report_evidence(result)["fault_evidence"]
    assert fault["mechanism"] == "cgroup cpu quota" and fault["pids_throttled"]
    assert fault["throttling"].get("nr_throttled", 0) > 0  # the quota bit
    rates = report_evidence(result)["step_rate"]
    assert rates["during"] < rates["before"]  # the whole job slowed down, not only rank 1
    per_rank = fault["rank_step_rates"]
    assert set(per_rank) == {0, 1} and per_rank[0]["during"] < per_rank[0]["before"]
    assert rates["min_rate"] == 0.05  # fraction 0.1 x margin 0.5


def test_a_collective_timeout_shorter_than_a_slowed_step_fails_with_the_timeout_named(
        results: dict[str, CheckResult]) -> None:
    result = results["slow-timeout"]
    assert result.status == "failed", result.summary
    assert "collective timed out" in result.summary and "shorter than a slowed step" in result.summary
    assert report_evidence(result)["likely_causes"][0].startswith("a collective (or step) timeout shorter")
