"""The runner's background lane: runs of later checks (the canary's, determinism's second) start
beside the checks before them, are taken by the check that needs them, nested under it in
MLflow, and stopped when nobody takes them -- and nothing that measures speed runs beside them.

Real toy jobs (tests/data/jobs/toy_train.py), a real MLflow sqlite store for the nesting.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.helpers import report_evidence, runs_by_kind, wait_for_a_background_run
from trainguard.config import load_config
from trainguard.config.settings import Settings
from trainguard.run.runner import JobRunner
from trainguard.run.scheduling import AheadRun
from trainguard.session import check, lane_plan, run_checks

pytestmark = pytest.mark.timeout(180)

JOBS = Path(__file__).resolve().parents[1] / "data" / "jobs"

CHECKS = """
  canary: {steps: 8, min_loss_drop: 0.1, max_seconds: 60}
  parallel: {steps: 6, world_size: 2, rtol: 0.05}  # the toy loss has 1% per-rank noise
  profile: {steps: 6, warmup_steps: 1, world_sizes: [1]}
"""


@pytest.fixture
def jobs(tmp_path: Path) -> Path:
    root = Path(shutil.copytree(JOBS, tmp_path / "jobs"))
    toy = root / "toy.trainguard.yaml"
    toy.write_text(toy.read_text() + CHECKS)  # smoke 5, determinism 8 steps, canary, profile
    return root


def spans(runner: JobRunner) -> dict[str, tuple[float, float]]:
    return {c.label: c.span for c in runner.curves}


def test_the_plan_takes_runs_of_later_checks_that_are_not_timed() -> None:
    job_file = load_config(JOBS / "toy.trainguard.yaml")
    runner = JobRunner(job_file, Settings())
    from trainguard.config import (
        CanaryCheck,
        DeterminismCheck,
        ParallelCheck,
        ProfileCheck,
        SmokeCheck,
    )

    smoke, canary, determinism = SmokeCheck(steps=5), CanaryCheck(steps=8, max_seconds=30), DeterminismCheck(steps=8)
    parallel = ParallelCheck(steps=6, world_size=2)
    plan = lane_plan(runner, [("smoke", smoke), ("canary", canary), ("determinism", determinism),
                              ("parallel", parallel)])
    # parallel's 2-rank run of 6 steps is the shortest uninterrupted run of the job at its world
    # size: smoke folds into it and launches it in the foreground, so the lane does not
    assert [(a.check, a.label, a.request.steps, a.request.world_size) for a in plan] == [
        ("canary", "canary", 8, 2), ("determinism", "determinism-repeat", 8, 2)]
    assert plan[0].request.timeout is not None  # the canary's run keeps its limits
    alone = lane_plan(runner, [("canary", canary), ("determinism", determinism), ("parallel", parallel)])
    assert [(a.check, a.label) for a in alone] == [("determinism", "determinism-repeat"), ("parallel", "reference")]
    # the first check has nothing to overlap with; nothing starts behind a timed check
    only = lane_plan(runner, [("canary", canary), ("determinism", determinism)])
    assert [a.check for a in only] == ["determinism"]
    assert lane_plan(runner, [("profile", ProfileCheck()), ("canary", canary)]) == []


def test_later_checks_take_the_runs_started_beside_smoke(jobs: Path) -> None:
    job_file = load_config(jobs / "toy.trainguard.yaml")
    runner = JobRunner(job_file, Settings())
    try:
        report = run_checks(job_file, runner)
    finally:
        runner.close()
    assert report.status == "passed", [(c.name, c.summary) for c in report.checks]
    assert [c.name for c in report.checks] == ["smoke", "canary", "determinism", "parallel", "profile"]
    by_name = {c.name: c for c in report.checks}
    canary, determinism = by_name["canary"], by_name["determinism"]
    assert any(v["beside"] in ("smoke", "canary") for v in report_evidence(determinism)["started_ahead"].values())
    labels = [c.label for c in runner.curves]
    # no extra launch: smoke judged parallel's 6-step 2-rank run (the shortest of the job at its
    # world size; it launched it) and resumed from a copy of its checkpoint; the canary's run,
    # started in the lane, is determinism's first, its second the lane's; parallel's 1-rank run is
    # the profile's (6 steps on 1 rank, run first)
    assert sorted(labels) == sorted(["profile-n1", "reference", "smoke-resume", "canary", "determinism-repeat"]), labels
    assert "the uninterrupted run the other checks share" in by_name["smoke"].summary
    assert report_evidence(canary)["started_ahead"]["beside"] == "smoke"
    assert by_name["parallel"].status == "passed"
    times = spans(runner)
    # the profile measures speed: it ran first, alone; every other run started after it ended
    starts = [c.span[0] for c in runner.curves if c.label != "profile-n1"]
    assert times["profile-n1"][1] <= min(starts), times


def test_closing_the_lane_stops_a_run_nobody_took(jobs: Path) -> None:
    runner = JobRunner(load_config(jobs / "long.trainguard.yaml"), Settings())
    spec = runner.job_file.checks.smoke
    assert spec is not None
    request = runner.request_for(spec)
    runner.scheduling.start_lane([AheadRun("canary", request, "canary")])
    wait_for_a_background_run(runner)
    started = time.monotonic()
    runner.close()
    assert time.monotonic() - started < 20
    assert not runner._inflight
    assert runner.scheduling.take_ahead("canary", request) is None  # stopped: a check would run it again
    lane_thread = runner.scheduling.lane_thread
    assert lane_thread is not None and not lane_thread.is_alive()


def test_a_run_taken_by_its_check_is_nested_under_that_check_in_mlflow(
    jobs: Path, monkeypatch: pytest.MonkeyPatch, new_mlflow_store: Callable[[Path], Path]
) -> None:
    monkeypatch.setenv("TRAINGUARD_TRACKING", "on")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    new_mlflow_store(jobs / ".trainguard" / "mlflow.db")
    report = check(jobs / "toy.trainguard.yaml", only=["canary", "determinism"])
    assert report.status == "passed"
    runs = runs_by_kind(f"sqlite:///{jobs / '.trainguard' / 'mlflow.db'}")
    checks = {r.data.tags["trainguard.check"]: r for r in runs["check"]}
    # determinism's second run started in the lane beside the canary, and is nested under
    # determinism, which took it
    (repeat,) = [r for r in runs["launch"] if r.info.run_name == "determinism-repeat"]
    assert repeat.data.tags["trainguard.started_ahead"] == "true"
    assert repeat.data.tags["trainguard.check"] == "determinism"
    assert repeat.data.tags["mlflow.parentRunId"] == checks["determinism"].info.run_id
    (canary_launch,) = [r for r in runs["launch"] if r.info.run_name == "canary"]
    assert canary_launch.data.tags["mlflow.parentRunId"] == checks["canary"].info.run_id
