"""crash_loop on the real local Slurm cluster: Slurm's requeue as the restart policy under test
(trainguard.queue.slurm_crash_loop). Every attempt of the toy job is SIGKILLed at step 7 (its
checkpoints are at 5, 10, ...), so each requeued attempt resumes at 6 and dies at 7 again.

Slow: the clean policy (the sbatch script's ``failure_requeues 2``: 3 attempts, resumed from the
checkpoint, Slurm's requeue delay before each) passes, with ``min_backoff_s`` 2 and without one;
three planted defects fail: no limit (the drill lets a 4th attempt start and cancels the job), a
restart from step 1 while a checkpoint exists (the job's resume_args dropped), and no backoff: a
``min_backoff_s`` (30 s) longer than the requeue delay measured -- Slurm's requeue has no backoff
a job sets, and the evidence says so.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import report_evidence
from tests.slurm.cluster import SlurmCluster
from tests.slurm.test_slurm_drills import LOSS, submit
from trainguard.queue.slurm import SlurmBackend
from trainguard.queue.slurm_crash_loop import SLURM_NO_BACKOFF, SlurmCrashLoop, run_slurm_crash_loop


def crash_loop(tmp_path: Path, name: str, requeues: int, *, resume: bool = True,
               min_backoff_s: float = 2.0) -> tuple[str, str, dict]:
    backend = SlurmBackend(tmp_path, failure_requeues=requeues)
    backend, job_id, log = submit(tmp_path, name, steps=30, sleep=0.5, resume=resume, backend=backend)
    drill = SlurmCrashLoop(name, after_step=7, metric_regex=LOSS, max_attempts=3, min_backoff_s=min_backoff_s,
                           checkpoints=str(tmp_path / "ckpt"), timeout_s=240)
    result = run_slurm_crash_loop(backend, job_id, log, drill)
    print(f"\n{result.status.upper()} {result.summary} ({result.duration_s:.0f} s)")
    return result.status, result.summary, report_evidence(result)


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("min_backoff_s", [2.0, 0.0], ids=["min-backoff-2", "no-min-backoff"])
def test_slurm_requeue_with_a_limit_stops_and_resumes_from_the_checkpoint(slurm_env: SlurmCluster, tmp_path: Path,
                                                                          min_backoff_s: float) -> None:
    status, summary, ev = crash_loop(tmp_path, "loop-clean", 2, min_backoff_s=min_backoff_s)
    assert status == "passed", (summary, ev)
    assert [a["struck_at_step"] for a in ev["attempts"]] == [7, 7, 7], ev["attempts"]
    assert [a["first_step"] for a in ev["attempts"]] == [1, 6, 6]
    assert all(a["wait_before_s"] >= min_backoff_s for a in ev["attempts"][1:]), ev["attempts"]
    assert ev["failing_step"] == 7 and ev["rank_seconds"] > 0 and "FAILED" in ev["ended"].upper()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_slurm_requeue_without_a_limit_fails_its_cap(slurm_env: SlurmCluster, tmp_path: Path) -> None:
    status, summary, ev = crash_loop(tmp_path, "loop-nolimit", 20)
    assert status == "failed", (summary, ev)
    assert "did not stop by its cap of 3 attempt(s): attempt 4 started" in summary
    assert len(ev["attempts"]) == 4 and "the drill cancelled the job" in ev["ended"]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_slurm_requeue_that_forgets_the_checkpoint_fails(slurm_env: SlurmCluster, tmp_path: Path) -> None:
    status, summary, ev = crash_loop(tmp_path, "loop-scratch", 2, resume=False)
    assert status == "failed", (summary, ev)
    assert "attempt 1 began again from step 1 while" in summary and "rank0-step000005" in summary


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_slurm_requeue_without_a_backoff_setting_fails_a_longer_min_backoff(slurm_env: SlurmCluster,
                                                                            tmp_path: Path) -> None:
    status, summary, ev = crash_loop(tmp_path, "loop-nobackoff", 2, min_backoff_s=30.0)
    assert status == "failed", (summary, ev)
    waits = [a["wait_before_s"] for a in ev["attempts"][1:]]
    assert len(waits) == 2 and all(w < 30.0 for w in waits), ev["attempts"]  # the verdict is the waits'
    assert f"restarted attempt 1 after {waits[0]:.2f} s, less than min_backoff_s 30 ({SLURM_NO_BACKOFF})" in summary
    assert ev["backoff_setting"] == SLURM_NO_BACKOFF
