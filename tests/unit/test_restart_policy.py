"""trainguard's own restart policy (``job.restart``, :mod:`trainguard.run.restarts`): the backoff
doubles to ``max_backoff_s`` while attempts make no progress, ``jitter`` lengthens each wait within
its bound, ``max_attempts_without_progress`` stops a crash loop before ``max_restarts`` runs out,
and a bad value is an error naming the file, the key and the fix.

The real-process cases run ``tests/data/jobs/trainer_dirs_train.py`` (pure Python, checkpoints
every 2 steps) with ``--crash-at 5``: every attempt dies at step 5 (a poison batch).
"""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import pytest

from trainguard.config import load_config
from trainguard.config.restart import RestartPolicy
from trainguard.config.settings import Settings
from trainguard.errors import ConfigError
from trainguard.run.request import RunRequest
from trainguard.run.restarts import Backoff
from trainguard.run.runner import JobRunner

JOBS = Path(__file__).resolve().parents[1] / "data" / "jobs"


def policy(**keys: object) -> RestartPolicy:
    return RestartPolicy.model_validate(keys)


def test_the_backoff_doubles_to_its_cap_without_progress_and_starts_over_after_progress() -> None:
    backoff = Backoff(policy(backoff_s=1.0, max_backoff_s=5.0))
    waits = [backoff.after(i, 4) for i in range(5)]  # attempt 0 reached 4: progress, then none
    assert [w.wait_s for w in waits if w] == [1.0, 2.0, 4.0, 5.0, 5.0]
    assert [w.progress for w in waits if w] == [True, False, False, False, False]
    after = backoff.after(5, 6)  # got past step 4: back to the first wait
    assert after is not None and after.progress and after.wait_s == 1.0


def test_jitter_lengthens_each_wait_within_its_bound_and_never_past_the_cap() -> None:
    backoff = Backoff(policy(backoff_s=1.0, max_backoff_s=3.0, jitter=0.5), random.Random(3))
    waits = [w.wait_s for w in (backoff.after(i, 2) for i in range(6)) if w]
    assert waits[0] != 1.0 and 1.0 <= waits[0] <= 1.5
    assert 2.0 <= waits[1] <= 3.0 and all(w <= 3.0 for w in waits)
    assert len(set(waits)) > 1  # not one fixed number
    plain = Backoff(policy(backoff_s=1.0, max_backoff_s=3.0))
    assert [w.wait_s for w in (plain.after(i, 2) for i in range(3)) if w] == [1.0, 2.0, 3.0]


def test_the_policy_gives_up_after_attempts_without_progress() -> None:
    backoff = Backoff(policy(backoff_s=0.0, max_attempts_without_progress=2))
    assert backoff.after(0, 4) is not None  # progress
    assert backoff.after(1, 4) is not None  # one without progress
    assert backoff.after(2, 3) is None
    assert "2 attempt(s) in a row got no further than step 4" in backoff.gave_up
    assert "max_attempts_without_progress 2" in backoff.gave_up


def crash_loop_job(tmp_path: Path, restart: str, max_restarts: int) -> JobRunner:
    shutil.copy(JOBS / "trainer_dirs_train.py", tmp_path)
    text = (JOBS / "trainer_dirs.trainguard.yaml").read_text()
    text = text.replace("--output-dir {checkpoint_dir}", "--output-dir {checkpoint_dir} --sleep 0.01 --crash-at 5")
    text = text.replace("  timeout: 60\n", f"  timeout: 60\n  max_restarts: {max_restarts}\n  restart: {restart}\n")
    path = tmp_path / "trainguard.yaml"
    path.write_text(text)
    return JobRunner(load_config(path), Settings())


def test_a_crash_loop_stops_without_progress_and_waits_its_backoff(tmp_path: Path) -> None:
    runner = crash_loop_job(tmp_path, "{backoff_s: 0.2, max_backoff_s: 0.3, max_attempts_without_progress: 2}", 8)
    run = runner.supervise(RunRequest.make(steps=8, seed=0, world_size=1), label="loop")
    # attempt 0 reached step 4 (progress); attempts 1 and 2 resumed from checkpoint-4 and died at 5
    assert [a.last_step for a in run.attempts] == [4, None, None]  # printed nothing past the resume
    assert "gave up: 2 attempt(s) in a row got no further than step 4" in run.gave_up
    assert [w.wait_s for w in run.waits] == [0.2, 0.3]
    assert all(w.measured_s is not None and w.measured_s >= w.wait_s for w in run.waits)


@pytest.mark.slow
def test_without_the_stop_the_loop_runs_until_max_restarts(tmp_path: Path) -> None:
    runner = crash_loop_job(tmp_path, "{backoff_s: 0.0}", 3)
    run = runner.supervise(RunRequest.make(steps=8, seed=0, world_size=1), label="loop")
    assert run.restarts == 3 and run.gave_up == "" and not run.ok


@pytest.mark.parametrize(("restart", "key", "words"), [
    ("{backoff_s: -1}", "job.restart.backoff_s", "expected a value >= 0"),
    ("{jitter: 2}", "job.restart.jitter", "expected a value <= 1"),
    ("{max_attempts_without_progress: 0}", "job.restart.max_attempts_without_progress", "expected a value >= 1"),
    ("{backoff_s: 10, max_backoff_s: 5}", "job.restart", "raise max_backoff_s to at least 10"),
    ("{max_backof_s: 5}", "job.restart.max_backof_s", "max_backoff_s"),
])
def test_a_bad_restart_key_names_the_file_the_key_and_the_fix(tmp_path: Path, restart: str, key: str,
                                                               words: str) -> None:
    with pytest.raises(ConfigError) as info:
        crash_loop_job(tmp_path, restart, 1)
    message = str(info.value)
    assert str(tmp_path / "trainguard.yaml") in message and key in message and words in message, message
