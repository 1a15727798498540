"""The gate's cost: measured from the runner's launch records, planned from the last gate's,
projected onto the target with ``target.startup_minutes``; a crafted report's records are data."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from trainguard.run.runner import LaunchRecord
from trainguard.session.cost import LaunchCost, measured_cost, planned_cost, records_from_report

RECORDS = [
    LaunchRecord("reference", 1, 10.0, 4.0, 60),      # 6 s for 60 steps: 0.1 s a step
    LaunchRecord("determinism-repeat", 1, 11.0, 5.0, 60),
    LaunchRecord("parallel", 2, 8.0, 6.0, 20),        # 2 s for 20 steps at 2 ranks
]


def test_the_measured_cost_counts_rank_seconds_and_start_up() -> None:
    cost = measured_cost(RECORDS, None)
    assert cost.launches == 3 and cost.measured
    assert cost.rank_seconds == pytest.approx(10 + 11 + 2 * 8)
    assert cost.startup_s_per_launch == 5.0  # the median launch-to-first-step
    assert cost.startup_share == pytest.approx((4 + 5 + 2 * 6) / 37)
    assert cost.projection is None
    assert cost.line() == "cost: 3 launch(es), 37 rank-seconds, start-up 5.0 s a launch (57% of the rank-seconds)"


def test_the_projection_on_the_target_is_launches_times_start_up_plus_steps_times_step_time() -> None:
    cost = measured_cost(RECORDS, 6.0)
    p = cost.projection
    assert p is not None and p.startup_gpu_hours == pytest.approx((1 + 1 + 2) * 6 / 60)
    steps = (60 * 0.1 + 60 * 0.1 + 2 * 20 * 0.1) / 3600  # step time per world size, measured here
    assert p.steps_gpu_hours == pytest.approx(steps, abs=1e-3) and p.gpu_hours == pytest.approx(0.4 + steps, abs=1e-3)
    assert "on the target (6 min to a launch's first step): 0.40 GPU-hours, 0.40 of them starting up" in cost.line()


def test_the_plan_estimates_from_the_last_gates_launches(tmp_path: Path) -> None:
    report = tmp_path / "latest.json"
    report.write_text(json.dumps({"cost": measured_cost(RECORDS, None).to_dict()}))
    history = records_from_report(report)
    assert len(history) == 3
    cost = planned_cost([(1, 60), (1, 60), (2, 20)], history, str(report), 6.0)
    assert not cost.measured and cost.launches == 3
    assert cost.rank_seconds == pytest.approx(4.5 + 6 + 4.5 + 6 + 2 * (6 + 2), rel=1e-6)
    assert "estimated from the launches of" in cost.line() and cost.line().startswith("cost: 3 launch(es), about ")
    # a world size the last gate did not run: no guess
    unknown = planned_cost([(4, 20)], history, str(report), None)
    assert unknown.rank_seconds is None and "not every world size" in unknown.note
    first = planned_cost([(1, 60)], [], "", 6.0)
    assert first.rank_seconds is None and first.projection is not None and first.projection.gpu_hours is None
    assert "rank-seconds unknown until a gate has run here" in first.line()


def test_a_crafted_reports_records_are_data(tmp_path: Path) -> None:
    path = tmp_path / "latest.json"
    path.write_text(json.dumps({"cost": {"records": [
        {"world_size": 1, "seconds": 2.0, "steps": 5, "first_step_s": 1.0},
        {"world_size": -3, "seconds": 2.0, "steps": 5},          # negative: dropped
        {"world_size": True, "seconds": 2.0, "steps": 5},        # a bool: dropped
        {"world_size": 1, "seconds": float("inf"), "steps": 5},  # not finite: dropped
        "not a record", {"world_size": 1}]}}))
    assert records_from_report(path) == [LaunchCost(None, 1, 2.0, 1.0, 5)]
    (tmp_path / "deep.json").write_text("[" * 100_000)
    assert records_from_report(tmp_path / "deep.json") == []
    assert records_from_report(tmp_path / "missing.json") == []


def test_the_digits_gate_plans_16_launches_each_shared_run_named() -> None:
    # the shipped example (issue 29): the profile's two runs are the references of the canary,
    # determinism, resume and the drills; smoke folds into them; resume and reshard resume from
    # checkpoints kept mid-run; the four drills make two launches each
    from trainguard.config.settings import Settings
    from trainguard.session.plan import make_plan

    plan = make_plan(Path(__file__).resolve().parents[2] / "examples" / "digits" / "trainguard.yaml", Settings())
    assert plan.launches == 16
    assert plan.checks[0].name == "profile" and "runs first, alone" in plan.checks[0].note
    shared = {shape: set(names) for shape, names in plan.shared()}
    assert shared["reference run of 60 steps x 1 rank(s)"] == {
        "profile", "smoke", "canary", "determinism", "resume", "drill:disk-full"}
    assert shared["reference run of 60 steps x 2 rank(s)"] == {
        "profile", "drill:kill-rank1", "drill:hang-rank1", "drill:oom-rank1"}
    assert shared["resumed run of 60 steps x 1 rank(s)"] == {"smoke", "resume"}
    # only determinism's second run and parallel's N-rank run start early: the canary's is the profile's
    assert plan.ahead == ["determinism's second run", "parallel's N-rank run"]
    assert plan.cost.launches == 16
