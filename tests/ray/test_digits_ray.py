"""The Ray Train version of the digits example under trainguard, on a real local Ray.

``examples/digits_ray/ray_digits.py`` is run unchanged with ``TorchTrainer`` by trainguard's
driver; the checks are the same as for a command job. One embedded Ray head serves all runs of
a check session and is stopped at its end (no Ray process may be left).

Default run: resume and a kill drill in one session, with MLflow tracking on (4 fits: the
uninterrupted 2-worker run is resume's and the drill's reference); every launch run must hold
every reported step exactly once (the workers' designated writer and the launcher share it,
docs/ray-train.md). Slow: determinism (one fit more: ~60 s of the suite's shared budget, and the
check's code is the command jobs' own), smoke and the canary, the parallel check (clean, and its
planted defect); the planted defects -- a train_func that ignores ``ray.train.get_checkpoint()`` must fail the
resume check, one whose workers train on different data must fail the parallel check.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.helpers import copy_digits_ray_example, report_evidence
from trainguard.launch.hook import PACE_DIR, STEPS_DIR
from trainguard.launch.pace import read_pace
from trainguard.launch.steps import read_steps
from trainguard.raytrain.local_ray import running_ray_processes, stopped_head_processes
from trainguard.session import check

pytestmark = [pytest.mark.ray, pytest.mark.timeout(900)]
pytest.importorskip("ray.train", reason="needs ray[train] (pip install trainguard[ray])")

# the default run's budget is 4 Ray fits: resume's reference, its killed and resumed fits, the
# kill drill (its reference is resume's); determinism, smoke and the canary run in slow tests,
# parallel in its own
# Ray Train V2's controller drains the workers' reports every RAY_TRAIN_HEALTH_CHECK_INTERVAL_S
# (Ray: 2 s, so a step takes >= 2 s); trainguard's embedded head polls every 0.25 s by default
# (trainguard.raytrain.RAY_TRAIN_DEFAULTS), which makes a 20-step fit ~4x shorter than a 12-step
# one at Ray's pace and leaves the kill drill 14 steps (~3.5 s) after its trigger for the
# driver's forwarded output to arrive
CHECKS = """
checks:
  resume: {steps: 20, after_step: 6}
  drills:
    - {name: kill-worker1, fault: kill_rank, rank: 1, steps: 20, after_step: 6, max_lost_steps: 4}
"""


def copy_examples(tmp_path: Path, checks: str = CHECKS) -> Path:
    """Both example folders (the Ray one imports the digits package by a relative path)."""
    return copy_digits_ray_example(tmp_path, checks)


def ray_pids() -> set[int]:
    return {p.pid for p in running_ray_processes()}


def test_resume_and_a_kill_drill_of_a_ray_train_function(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, new_mlflow_store: Callable[[Path], Path]
) -> None:
    pytest.importorskip("mlflow")
    monkeypatch.setenv("TRAINGUARD_TRACKING", "on")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", raising=False)  # trainguard's default pace
    job = copy_examples(tmp_path)
    new_mlflow_store(job.parent / ".trainguard" / "mlflow.db")
    before = ray_pids()
    report = check(job)
    assert [c.name for c in report.checks] == ["resume", "drill:kill-worker1"]
    for result in report.checks:
        assert result.status == "passed", f"{result.name}: {result.summary}"
    # every run's workers recorded their optimizer steps, each under its world rank
    run_dirs = report_evidence(report.checks[0])["run_dirs"]
    resumed_from = report_evidence(report.checks[0])["resumed_from_step"]
    for role, steps in (("reference", 20), ("resumed", 20 - resumed_from)):
        assert sorted(p.name for p in (Path(run_dirs[role]) / STEPS_DIR).iterdir()) == ["rank0.jsonl", "rank1.jsonl"]
        records = read_steps(Path(run_dirs[role]))
        assert [len(records.ranks[r].steps) for r in (0, 1)] == [steps, steps], role
        # and each step's clocks (docs/drills.md "Stragglers"), written at the end of the fit
        assert [len(c) for _, c in sorted(read_pace(Path(run_dirs[role]) / PACE_DIR).items())] == [steps, steps], role
    resumed = read_steps(Path(run_dirs["resumed"]))
    assert all("Optimizer.load_state_dict" in {c.call for c in resumed.ranks[r].restores} for r in (0, 1))
    drill = report.checks[1]
    print(f"\n{drill.summary}")
    ray = report_evidence(drill)["ray"]
    assert ray["restarts"] == 1 and ray["max_failures"] == 1  # Ray Train recovered it in the same fit
    assert len(report_evidence(drill)["attempts"]) == 1 and report_evidence(drill)["trajectory"]["compared_steps"] == 20
    assert report_evidence(drill)["fault_evidence"]["pid"] not in ray["workers_after"].values()
    assert not stopped_head_processes(before), f"Ray processes left behind: {stopped_head_processes(before)}"
    # tracking: each launch run (the killed one of resume included) has each step once
    from mlflow import MlflowClient

    client = MlflowClient(f"sqlite:///{job.parent / '.trainguard' / 'mlflow.db'}")
    exp = client.get_experiment_by_name("trainguard")
    assert exp is not None
    launches = [r for r in client.search_runs([exp.experiment_id]) if r.data.tags.get("trainguard.kind") == "launch"]
    written = backfilled = requests = 0
    write_s = 0.0
    for run in launches:
        steps = Counter(m.step for m in client.get_metric_history(run.info.run_id, "loss"))
        if run.info.run_name.startswith("drill-"):
            # Ray Train restarted the workers inside this fit: the steps after the checkpoint
            # were computed twice and are logged twice (each by its own writer), the rest once
            twice = sorted(k for k, n in steps.items() if n == 2)
            assert set(steps) == set(range(1, 21)) and set(steps.values()) <= {1, 2}, steps
            # (a re-done step the killed group's writer had not flushed yet is logged once)
            assert len(twice) <= report_evidence(drill)["lost_steps"], (twice, report_evidence(drill)["lost_steps"])
            continue
        assert steps and set(steps.values()) == {1}, (run.info.run_name, steps)
        if run.info.run_name == "resume-killed" and run.data.tags["trainguard.ray_writer"] == "none":
            # killed ~1.5 s into training, before the writer's first flush (every 2 s) and its
            # record: the launcher logged every step, once
            backfilled += len(steps)
            continue
        assert run.data.tags["trainguard.ray_writer"] == "world rank 0", (run.info.run_name, run.data.tags)
        written += int(run.data.tags["trainguard.ray_writer.written_rows"])
        backfilled += int(run.data.tags["trainguard.ray_writer.backfilled_rows"])
        requests += int(run.data.tags.get("trainguard.ray_writer.requests", 0))
        write_s += float(run.data.tags.get("trainguard.ray_writer.write_s", 0.0))
    print(f"\n{len(launches)} launch runs: {written} rows written by the workers' writer in {requests} "
          f"log_batch requests ({write_s:.2f} s in its thread), {backfilled} by the launcher")
    assert len(launches) == 4 and written > 0


@pytest.mark.slow
def test_determinism_of_a_ray_train_function(tmp_path: Path) -> None:
    """Two 2-worker fits of the same seed print the same losses."""
    report = check(copy_examples(tmp_path, "checks:\n  determinism: {steps: 20}\n"))
    (determinism,) = report.checks
    assert determinism.status == "passed", determinism.summary


@pytest.mark.slow
def test_parallel_of_a_ray_train_function(tmp_path: Path) -> None:
    """2 workers match 1 worker (1 fit more than the default run's, so it is slow)."""
    report = check(copy_examples(tmp_path, "checks:\n  parallel: {steps: 20, world_size: 2}\n"))
    (parallel,) = report.checks
    assert parallel.status == "passed", parallel.summary
    assert "2 ranks match 1 rank on 20 steps of loss" in parallel.summary


@pytest.mark.slow
def test_smoke_and_canary_of_a_ray_train_function(tmp_path: Path) -> None:
    job = copy_examples(tmp_path, "checks:\n  smoke: {steps: 6}\n"
                        "  canary: {steps: 40, max_seconds: 240, min_loss_drop: 0.3}\n")
    report = check(job)
    smoke, canary = report.checks
    print(f"\n{canary.summary} ({canary.duration_s:.1f} s)")
    assert smoke.status == "passed", smoke.summary
    assert "resumed from the checkpoint of step 6 at step 7" in smoke.summary
    assert canary.status == "passed", canary.summary


@pytest.mark.slow
def test_workers_on_different_data_fail_parallel(tmp_path: Path) -> None:
    """Planted defect: each worker shuffles with its own seed, so 2 workers no longer see the
    batches 1 worker sees."""
    job = copy_examples(tmp_path, "checks:\n  parallel: {steps: 12, world_size: 2}\n")
    code = tmp_path / "digits_ray" / "ray_digits.py"
    text = code.read_text()
    planted = text.replace("shuffle=True,\n                                          seed=seed,",
                           "shuffle=True,\n                                          seed=seed + rank,")
    assert planted != text
    code.write_text(planted)
    report = check(job)
    (parallel,) = report.checks
    assert parallel.status == "failed", parallel.summary
    assert "2 ranks diverge from 1 rank at step" in parallel.summary


@pytest.mark.slow
def test_a_train_func_that_ignores_its_checkpoint_fails_resume(tmp_path: Path) -> None:
    job = copy_examples(tmp_path)
    code = tmp_path / "digits_ray" / "ray_digits.py"
    text = code.read_text()
    planted = text.replace("checkpoint = ray.train.get_checkpoint()", "checkpoint = None  # planted")
    assert planted != text
    code.write_text(planted)
    report = check(job, only=["resume"])
    (resume,) = report.checks
    assert resume.status == "failed", resume.summary


@pytest.mark.slow
def test_a_resume_that_loads_no_optimizer_state_is_observed_in_the_workers(tmp_path: Path) -> None:
    """The workers' step records (the driver installs the run agent in each) name what the
    resumed fit did not load: the optimizer state is absent at its first step."""
    job = copy_examples(tmp_path, "checks:\n  resume: {steps: 12, after_step: 6}\n")
    code = tmp_path / "digits_ray" / "ray_digits.py"
    text = code.read_text()
    planted = text.replace('        optimizer.load_state_dict(state["optimizer"])\n', "")
    assert planted != text
    code.write_text(planted)
    (resume,) = check(job, only=["resume"]).checks
    assert resume.status == "failed", resume.summary
    ev = report_evidence(resume)
    found = ev["first_divergence"]
    assert (found["kind"], found["step"], found["other"]) == ("optimizer state", 6, "absent"), found
    first = ev["diagnosis"][0]
    assert first["key"] == "optimizer" and first["observed"] is True, first
    assert "the resumed run loaded no optimizer state" in first["evidence"][0]
