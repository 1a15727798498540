"""``fault: kill_worker``: a rank's data-loading worker process dies (SIGKILL) after step k.

The toy job (tests/data/jobs/toy_train.py, no torch) loads through ``--workers 2`` child
processes, one item per step from worker ``step % 2``. The clean loader checks its worker is
alive while it waits (as PyTorch's DataLoader does) and fails with an error; the planted one
(``--worker-timeout 0``) waits for the dead worker's item forever. The digits example, whose
DataLoader has 2 workers per rank, runs the drill in the slow test at the end.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import report_evidence, toy_job
from trainguard.config import load_config
from trainguard.drills import run_drill
from trainguard.report import CheckResult
from trainguard.run.runner import JobRunner

pytestmark = pytest.mark.timeout(240)

DRILLS = [
    "{name: worker, fault: kill_worker, rank: 1, steps: 30, after_step: 5, deadline: 5}",
    '{name: worker-hangs, fault: kill_worker, rank: 1, steps: 30, after_step: 5, deadline: 3, args: "--worker-timeout 0"}',
    '{name: no-workers, fault: kill_worker, rank: 1, steps: 30, after_step: 5, args: "--workers 0"}',
]


def workers_job(directory: Path) -> Path:
    """The toy job with 2 data-loading workers per rank and the drills above, in ``directory``."""
    return toy_job(directory / "workers.trainguard.yaml", "toy-workers",
                   "--sleep 0.05 --workers 2 --sync-dir {run_dir}/sync --sync-timeout 0", DRILLS)


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return workers_job(tmp_path_factory.mktemp("workers"))


def run(path: Path, name: str) -> CheckResult:
    job_file = load_config(path)
    spec = next(d for d in job_file.checks.drills if d.name == name)
    return run_drill(JobRunner(job_file), spec)


def test_a_loader_that_notices_its_dead_worker_fails_clean(job: Path) -> None:
    result = run(job, "worker")
    assert result.status == "passed", result.summary
    fault = report_evidence(result)["fault_evidence"]
    assert fault["worker_pid"] and fault["workers_seen"] == 2
    assert "exited unexpectedly" in report_evidence(result)["failed_rank_stderr_after_fault"]
    assert report_evidence(result)["exit_after_s"] < 5


def test_a_loader_that_waits_for_a_dead_worker_forever_fails_as_a_hang(job: Path) -> None:
    result = run(job, "worker-hangs")
    assert result.status == "failed", result.summary
    assert "the job hung" in result.summary
    assert report_evidence(result)["likely_causes"][0].startswith("the loader waits for the dead worker's batch")


def test_a_rank_without_workers_is_an_error_that_says_so(job: Path) -> None:
    result = run(job, "no-workers")
    assert result.status == "error"
    assert "num_workers > 0" in result.summary


@pytest.mark.slow
def test_the_digits_dataloader_raises_when_a_worker_is_killed() -> None:
    example = Path(__file__).resolve().parents[2] / "examples" / "digits" / "drills.trainguard.yaml"
    job_file = load_config(example)
    spec = next(d for d in job_file.checks.drills if d.name == "kill-worker")
    result = run_drill(JobRunner(job_file), spec)
    assert result.status == "passed", result.summary
    assert "DataLoader worker" in report_evidence(result)["failed_rank_stderr_after_fault"]
