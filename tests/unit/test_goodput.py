"""The goodput forecast (docs/profiling.md, "Goodput forecast"): the model against hand-computed
cases, its monotonicity, the interval optimum against Young/Daly and a grid search, the drills'
measured inputs, the recommended timeouts, and the gate's min_goodput threshold."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import drill_report, make_sizing, profile_evidence, soak_report
from trainguard.config import GatePolicy, Target, load_config
from trainguard.drills.evidence import SoakRuns
from trainguard.errors import ConfigError
from trainguard.evidence import record_dict
from trainguard.gate.policy import Capabilities, decide, sizing_of
from trainguard.profiling.goodput import (
    FailureInputs,
    goodput,
    interval_curve,
    measured_recovery,
    optimal_interval_s,
    wall_clock_s,
)
from trainguard.profiling.sizing import SizeInputs, apply_failure_inputs, size_run
from trainguard.profiling.stats import fit_scaling
from trainguard.profiling.timeouts import (
    RecommendedTimeout,
    poisson_quantile,
    recommend_restart_policy,
    recommend_timeouts,
)
from trainguard.report import CheckResult, Report

DEFAULTS = FailureInputs(restart_s=600.0, restart_source="default", load_s=None, load_source="default")


def test_hand_computed_case() -> None:
    # 1 h of work, a 10 s save every 10 min, MTBF 10 h, a failure costs 5 min + half an interval
    share = (300 + 300) / 36_000  # = 1/60
    assert wall_clock_s(3600, 600, 10, 36_000, 300) == pytest.approx(3600 * (1 + 10 / 600) / (1 - share))
    assert wall_clock_s(3600, 600, 10, 36_000, 300) == pytest.approx(3722.03, abs=0.01)
    assert goodput(600, 10, 36_000, 300) == pytest.approx((59 / 60) / (61 / 60))  # 0.96721
    assert goodput(600, 10, 36_000, 300) == pytest.approx(3600 / wall_clock_s(3600, 600, 10, 36_000, 300))
    # no failures, free checkpoints: all progress
    assert goodput(600, 0, math.inf, 0) == 1.0
    # a failure costing more than the time between failures: no progress at all
    assert goodput(600, 10, 500, 300) == 0.0 and wall_clock_s(3600, 600, 10, 500, 300) == math.inf


def test_goodput_falls_as_failures_cost_more_or_come_sooner() -> None:
    base = goodput(600, 10, 36_000, 300)
    assert goodput(600, 10, 36_000, 900) < base  # a slower restart
    assert goodput(600, 30, 36_000, 300) < base  # a slower save
    assert goodput(600, 10, 18_000, 300) < base  # twice the failures
    mtbfs = [3600 * h for h in (1, 2, 5, 10, 100)]
    assert [goodput(600, 10, m, 300) for m in mtbfs] == sorted(goodput(600, 10, m, 300) for m in mtbfs)
    assert wall_clock_s(7200, 600, 10, 36_000, 300) == pytest.approx(2 * wall_clock_s(3600, 600, 10, 36_000, 300))


@pytest.mark.parametrize(("save", "mtbf", "fixed"), [(10.0, 36_000.0, 300.0), (120.0, 7200.0, 900.0),
                                                     (1.0, 1e6, 0.0)])
def test_the_optimum_is_the_grid_maximum_and_below_young_daly(save: float, mtbf: float, fixed: float) -> None:
    choice = optimal_interval_s(save, mtbf, fixed, cap_s=1e9)
    assert choice.optimum_s is not None and choice.young_daly_s == pytest.approx(math.sqrt(2 * save * mtbf))
    grid = interval_curve(save, mtbf, fixed, around_s=choice.interval_s, points=2001)
    best_t, best_g = max(grid, key=lambda p: p[1])
    assert goodput(choice.interval_s, save, mtbf, fixed) >= best_g - 1e-12
    assert best_t == pytest.approx(choice.interval_s, rel=0.01)
    assert choice.interval_s <= choice.young_daly_s  # restart and save shorten it


def test_the_optimum_tends_to_young_daly_when_saves_and_restarts_are_cheap() -> None:
    choice = optimal_interval_s(1.0, 1e7, 0.0, cap_s=1e9)
    assert choice.interval_s == pytest.approx(math.sqrt(2e7), rel=1e-3)


def test_the_cap_and_the_floor() -> None:
    capped = optimal_interval_s(60.0, 36_000_000.0, 600.0, cap_s=600.0)
    assert capped.interval_s == 600.0 and "capped at the lost-work limit" in capped.rule
    floored = optimal_interval_s(0.001, 10.0, 0.0, cap_s=600.0, floor_s=0.5)
    assert floored.interval_s == 0.5 and "every step" in floored.rule
    free = optimal_interval_s(0.0, 36_000.0, 600.0, cap_s=300.0)
    assert free.interval_s == 300.0 and free.optimum_s is None


def _drill(name: str, status: str = "passed", **evidence: Any) -> CheckResult:
    return CheckResult(name, status, name, evidence=drill_report(**evidence))  # type: ignore[arg-type]


def test_the_recover_drills_measure_restart_and_lost_steps() -> None:
    checks = [
        _drill("drill:kill", fault_to_first_step_after_restart_s=4.0, lost_steps=2),
        _drill("drill:preempt", fault_to_first_step_after_restart_s=6.0, lost_steps=4),
        _drill("drill:broken", status="failed", fault_to_first_step_after_restart_s=90.0, lost_steps=50),
        CheckResult("drill:nan", "passed", "continued", evidence=drill_report(0, kind="continue")),
        CheckResult("smoke", "passed", "ok"),
    ]
    measured = measured_recovery(checks, DEFAULTS)
    assert measured.restart_s == 5.0 and measured.lost_steps == 3.0
    assert "drill:kill, drill:preempt" in measured.restart_source and measured.load_in_restart
    assert measured.fixed_s(save_s=10.0) == 5.0  # the load is inside the measured restart
    assert DEFAULTS.fixed_s(save_s=10.0) == 610.0  # by default the load takes as long as the save
    assert measured_recovery(checks[3:], DEFAULTS) == DEFAULTS


def test_a_passed_soak_counts_once_per_seed_with_its_mean_over_faults() -> None:
    one = CheckResult("drill:chaos", "passed", "ok", evidence=soak_report(1, 8.0, 2.0))
    several = CheckResult("drill:chaos2", "passed", "ok", evidence=SoakRuns(
        "soak", [2, 3], [soak_report(2, 10.0, 1.0), soak_report(3, 12.0, 3.0)]))
    failed = CheckResult("drill:chaos3", "failed", "no", evidence=soak_report(4, 99.0, 99.0))
    measured = measured_recovery([one, several, failed, _drill("drill:kill", fault_to_first_step_after_restart_s=4.0,
                                                                lost_steps=0)], DEFAULTS)
    assert measured.restart_s == 9.0  # the median of 4, 8, 10, 12
    assert measured.lost_steps == 1.5  # the median of 0, 2, 1, 3
    assert "drill:chaos seed 1" in measured.restart_source and "drill:chaos2 seed 3" in measured.restart_source


def _sizing() -> Any:
    measured = {1: SizeInputs(1, 100.0, 64, 10.0, 0.0, 2.0, 900.0, step_p99_s=0.8, step_max_s=1.2,
                              checkpoint_every_steps=50),
                2: SizeInputs(2, 190.0, 64, 10.0, 0.0, 2.0, 900.0, step_p99_s=0.5, step_max_s=0.6)}
    target = Target(samples=7_200_000, max_gpus=4, deadline_hours=48, mtbf_hours=200.0, max_lost_minutes=30)
    return size_run(target, measured, fit_scaling({1: 100.0, 2: 190.0}), samples_per_step=lambda n: 64,
                    device="gpu", memory_budget_mb=lambda n: (1000.0, "test"))


def test_the_sizing_forecasts_goodput_at_every_size() -> None:
    sizing = _sizing()
    assert sizing.failure_inputs.restart_source == "default: target.restart_minutes = 10"
    for c in sizing.candidates:
        work, mtbf = c.hours * 3600, c.mtbf_hours * 3600
        fixed = 600.0 + 2.0  # restart + a load as long as the save
        assert c.checkpoint_every_s == pytest.approx(-2 + math.sqrt(4 + 2 * (1 - fixed / mtbf) * 2 * mtbf))
        assert c.hours_with_failures * 3600 == pytest.approx(wall_clock_s(work, c.checkpoint_every_s, 2.0, mtbf, fixed))
        assert c.goodput == pytest.approx(work / (c.hours_with_failures * 3600))
        assert c.expected_failures == pytest.approx(c.hours_with_failures / c.mtbf_hours)
        assert c.wasted_gpu_hours == pytest.approx(c.gpus * (c.hours_with_failures - c.hours))
    one = sizing.candidate(1)
    assert one.job_checkpoint_every_steps == 50  # the job's own cadence, as profiled
    assert one.goodput_at_job_cadence == pytest.approx(goodput(50 * one.step_time_s, 2.0, one.mtbf_hours * 3600, 602.0))
    assert one.goodput_at_job_cadence < one.goodput  # 32 s between 2 s saves: 6 % of the time saving
    assert sizing.candidate(2).goodput_at_job_cadence is None  # not profiled at 2
    goodputs = [c.goodput for c in sizing.candidates]
    assert goodputs == sorted(goodputs, reverse=True)  # more GPUs: more failures
    assert sizing.goodput_curve is not None and sizing.goodput_curve.gpus == sizing.recommended
    assert sizing.recommendation.count("goodput") == 1


def test_measured_restart_raises_the_forecast() -> None:
    sizing = _sizing()
    before = {c.gpus: c.goodput for c in sizing.candidates}
    fast = FailureInputs(5.0, "measured", None, "included", load_in_restart=True)
    after = apply_failure_inputs(sizing, fast)
    assert all(c.goodput > before[c.gpus] for c in after.candidates)
    assert after.failure_inputs.restart_s == 5.0


def test_recommended_timeouts_follow_the_measured_tail_and_the_save() -> None:
    items = recommend_timeouts(step_p99_s=2.0, step_max_s=3.0, save_s=20.0, load_s=15.0, startup_s=40.0,
                               expected_failures=1.0, gpus=64)
    by = {t.setting.split(":")[0] if t.setting.startswith("Slurm") else t.setting: t for t in items}
    assert all(t.reason for t in items) and len(items) == 6
    collective = next(t for t in items if t.setting.startswith("collective"))
    stall = next(t for t in items if t.setting.startswith("job.stall_timeout"))
    assert collective.value == 80  # 2 x (3 + 20 + 15) = 76, rounded up to 10 s
    assert stall.value == 110  # 3 x 23 = 69 < collective + 30
    assert next(t for t in items if "max_failures" in t.setting).value == 4  # Poisson(1) 99 %
    assert by["Slurm"].value == 70  # 3 x (3 + 20) = 69 -> 70
    start = next(t for t in items if "START_TIMEOUT" in t.setting)
    assert start.value == 170  # 3 x (40 + 15)
    assert recommend_timeouts(step_p99_s=None, step_max_s=None, save_s=None, load_s=0.0, startup_s=None,
                              expected_failures=0.0, gpus=1) == []
    assert [poisson_quantile(m) for m in (0.0, 0.01, 1.0, 10.0)] == [0, 0, 4, 18]  # P(0 | 0.01) = 0.990


def test_the_restart_policy_follows_the_restart_cost_and_the_failure_rate() -> None:
    """job.restart from the forecast: the first wait a tenth of a restart, the cap four restarts,
    the stop without progress from the chance that a healthy attempt fails again before it passes
    its checkpoint; each reason quotes the numbers it came from."""
    def policy(fixed: float, mtbf_h: float, failures: float) -> dict[str, RecommendedTimeout]:
        items = recommend_restart_policy(fixed_s=fixed, restart_source="measured: drill kill", checkpoint_every_s=600,
                                         job_mtbf_s=mtbf_h * 3600, expected_failures=failures, wall_s=36_000,
                                         goodput=0.93, gpus=64)
        return {t.setting.split(" ")[0]: t for t in items}

    slow = policy(120.0, 10.0, 4.0)
    assert slow["job.restart.backoff_s"].value == 12 and slow["job.restart.max_backoff_s"].value == 480
    assert "120 s: measured: drill kill" in slow["job.restart.backoff_s"].reason
    assert "goodput 93.00%" in slow["job.restart.backoff_s"].reason
    # p = 1 - exp(-720 / 36000) = 0.0198; 0.0198^k < 0.001 / 4 -> k = 3
    assert slow["job.restart.max_attempts_without_progress"].value == 3
    assert "chance 0.02" in slow["job.restart.max_attempts_without_progress"].reason
    # failures far more often than the checkpoint interval: more attempts before giving up
    flaky = policy(120.0, 0.5, 20.0)
    assert flaky["job.restart.max_attempts_without_progress"].value > 3
    fast = policy(3.0, 10.0, 4.0)
    assert fast["job.restart.backoff_s"].value == 1 and fast["job.restart.max_backoff_s"].value == 12
    assert slow["job.restart.jitter"].value == 20


def _gate_report() -> Report:
    return Report(job="toy", checks=[CheckResult("smoke", "passed", "ok")])


def test_the_gate_blocks_below_min_goodput_naming_the_size_and_the_value() -> None:
    gate = GatePolicy.model_validate({"require": ["smoke"], "thresholds": {"min_goodput": 0.9}})
    caps = Capabilities(gpus=0, root=False, ray=True)
    low = decide(_gate_report(), gate, caps, sizing=make_sizing(goodput=0.85))
    assert low.verdict == "block"
    assert any("goodput 85.0% at 4 GPUs is below gate.thresholds.min_goodput 90.0%" in r for r in low.reasons), low.reasons
    high = decide(_gate_report(), gate, caps, sizing=make_sizing(goodput=0.95))
    assert high.promoted and any("min_goodput" in n for n in high.notes)


def test_the_gate_uses_the_drills_measured_restart() -> None:
    sizing = _sizing()
    profile = CheckResult("profile", "passed", "sized", evidence=profile_evidence(sizing))
    drill = _drill("drill:kill", fault_to_first_step_after_restart_s=3.0, lost_steps=1)
    plain = sizing_of(Report(job="toy", checks=[profile]))
    with_drill = sizing_of(Report(job="toy", checks=[profile, drill]))
    assert plain is not None and with_drill is not None
    assert plain.failure_inputs.restart_s == 600.0 and with_drill.failure_inputs.restart_s == 3.0
    assert with_drill.candidates[0].goodput > plain.candidates[0].goodput


@pytest.mark.parametrize("value", ["0", "1.5", "-0.2"])
def test_min_goodput_out_of_range_is_a_config_error_naming_the_key(tmp_path: Path, value: str) -> None:
    path = tmp_path / "trainguard.yaml"
    path.write_text("job:\n  name: t\n  command: python train.py\n  metrics: {loss: 'loss (?P<value>\\S+)'}\n"
                    f"gate:\n  thresholds: {{min_goodput: {value}}}\n")
    with pytest.raises(ConfigError, match=r"gate\.thresholds\.min_goodput"):
        load_config(path)


def test_the_reports_show_the_forecast_its_inputs_the_plot_and_the_timeouts() -> None:
    from tests.unit.test_profiling import _report_data
    from trainguard.profiling.render import plot_goodput, render_html, render_markdown, render_plots

    data = _report_data()
    data["sizing"] = _sizing().to_dict()
    plots = render_plots(data)
    assert plots["goodput"].startswith(b"\x89PNG")
    assert plot_goodput({"sizing": None}) is None
    md = render_markdown(data)
    assert "**Goodput forecast**" in md and "default: target.restart_minutes = 10" in md
    assert "measured by the profile" in md and "`job.stall_timeout (any step watchdog)`" in md
    html = render_html(data, plots)
    assert "<h2>Goodput forecast</h2>" in html and "<h2>Recommended timeouts at 1 rank(s)</h2>" in html
    assert html.count("data:image/png;base64,") == len(plots)


def test_the_gate_report_shows_the_goodput_and_the_threshold(tmp_path: Path) -> None:

    from trainguard.gate.policy import Decision
    from trainguard.gate.provenance import Provenance
    from trainguard.gate.run import GateReport, write_gate_report

    sizing = _sizing()
    gate = GateReport(job="toy", job_file=str(tmp_path / "trainguard.yaml"), decision=Decision("promote"),
                      report=_gate_report(), sizing=sizing,
                      provenance=Provenance(str(tmp_path / "trainguard.yaml"), "0" * 64, None, False, "0", 0.0),
                      capabilities=Capabilities(gpus=0, root=False, ray=False),
                      policy=GatePolicy.model_validate({"thresholds": {"min_goodput": 0.9}}))
    paths = write_gate_report(gate, tmp_path / "gate")
    md = Path(paths["markdown"]).read_text()
    best = sizing.candidate(sizing.recommended)
    assert f"**Goodput forecast:** {best.goodput:.2%} at {best.gpus} GPU(s)" in md
    assert "(gate.thresholds.min_goodput 90.0%)" in md
    assert "**Recommended restart policy** at 1 GPU(s)" in md
    assert "- `job.restart.backoff_s`:" in md and "default: target.restart_minutes" in md
    assert "- `job.restart.max_attempts_without_progress`:" in md
    html = Path(paths["html"]).read_text()
    assert "profile: Goodput forecast vs world size and vs checkpoint interval" in html
    assert "Recommended timeouts at 1 GPU(s)" in html and "default: target.restart_minutes" in html


def test_a_size_whose_failures_leave_no_progress_is_not_feasible_and_its_report_stays_readable(tmp_path: Path) -> None:
    import json

    measured = {1: SizeInputs(1, 100.0, 64, 10.0, 0.0, 2.0, 900.0), 2: SizeInputs(2, 190.0, 64, 10.0, 0.0, 2.0, 900.0)}
    # one GPU fails every 0.3 h: at 2 GPUs every 9 min, less than a 10-minute restart
    target = Target(steps=100_000, max_gpus=2, mtbf_hours=0.3, restart_minutes=10, min_efficiency=0.5)
    sizing = size_run(target, measured, fit_scaling({1: 100.0, 2: 190.0}), samples_per_step=lambda n: 64,
                      device="gpu", memory_budget_mb=lambda n: (1000.0, "test"))
    two = sizing.candidate(2)
    assert two.goodput == 0.0 and math.isinf(two.hours_with_failures) and not two.feasible
    assert any("no progress" in w for w in two.why_not)
    one = sizing.candidate(1)
    assert 0 < one.goodput < 0.5 and sizing.recommended == 1, sizing.recommendation
    from trainguard.gate.run import _check_sizing

    _check_sizing(json.loads(json.dumps(sizing.to_dict())), "report.json", "again")  # no error


def test_a_check_report_keeps_the_measured_restart_cost_not_the_default() -> None:
    """`trainguard check` with a profile and a recover drill: the saved report's sizing is the
    one the gate would compute (before, it kept target.restart_minutes beside the drill's 4 s)."""
    from trainguard.report import Report
    from trainguard.session.orchestrate import _measured_recovery_into_sizing

    report = Report(job="j", job_file="j.yaml")
    report.checks.append(CheckResult("profile", "passed", "ok", evidence=profile_evidence(_sizing())))
    report.checks.append(_drill("drill:kill", fault_to_first_step_after_restart_s=4.0, lost_steps=2))
    _measured_recovery_into_sizing(report)
    inputs = report.to_dict()["checks"][0]["evidence"]["sizing"]["failure_inputs"]
    assert inputs["restart_s"] == 4.0 and inputs["restart_source"].startswith("measured")
    assert record_dict(sizing_of(report).failure_inputs) == inputs  # type: ignore[union-attr]
    bare = Report(job="j", job_file="j.yaml")
    bare.checks.append(CheckResult("profile", "passed", "ok", evidence=profile_evidence(_sizing())))
    _measured_recovery_into_sizing(bare)
    assert bare.to_dict()["checks"][0]["evidence"]["sizing"]["failure_inputs"]["restart_source"].startswith("default")


def test_a_save_whose_cost_was_not_measurable_is_not_set_against_the_jobs_cadence() -> None:
    """A loaded machine read the profile's lines in bursts and the save measured 0 s: the interval
    falls back to the lost-work cap, and the job's cadence (free at 0 s) is not said to beat it."""
    measured = {1: SizeInputs(1, 100.0, 64, 10.0, 0.0, 0.0, 900.0, checkpoint_every_steps=5)}
    target = Target(samples=7_200_000, max_gpus=1, deadline_hours=48, mtbf_hours=200.0, max_lost_minutes=30)
    sizing = size_run(target, measured, fit_scaling({1: 100.0}), samples_per_step=lambda n: 64,
                      device="gpu", memory_budget_mb=lambda n: (1000.0, "test"))
    one = sizing.candidate(1)
    assert one.checkpoint_every_s == 1800 and "nothing measurable" in one.checkpoint_rule
    assert one.job_checkpoint_every_steps == 5 and one.goodput_at_job_cadence is None


def test_the_sizing_writes_the_json_it_wrote_as_a_dict_and_reads_it_back() -> None:
    """The sizing is a record (its failure inputs and goodput curve too): its JSON is what the
    dataclass's fields gave before (``asdict``, key for key, in order), and it reads back equal."""
    import dataclasses
    import json

    from trainguard.profiling.sizing import Sizing

    sizing = _sizing()
    assert sizing.failure_inputs is not None and sizing.goodput_curve is not None
    assert json.dumps(sizing.to_dict()) == json.dumps(dataclasses.asdict(sizing))
    assert Sizing.from_dict(json.loads(json.dumps(sizing.to_dict()))) == sizing


def test_the_timeouts_and_the_batch_headroom_are_records_written_key_for_key() -> None:
    """The recommended timeouts and the batch headroom are records: the report's keys, in the
    order the dicts had them, and they read back as records."""
    import json

    from trainguard.profiling.sizing import BatchHeadroom, Sizing

    sizing = _sizing()
    sizing.batch_headroom = BatchHeadroom(
        summary="headroom: largest batch 128", budget_mb=500, profile_batch=64, headroom_mb=100.0,
        peak_mb=400.0, peak_source="measured", largest_pass=128, safe_batch=96, world_size=1)
    data = json.loads(json.dumps(sizing.to_dict()))
    assert data["timeouts"] and all(list(t) == ["setting", "value", "reason", "gpus"] for t in data["timeouts"])
    assert list(data["batch_headroom"]) == ["summary", "budget_mb", "profile_batch", "headroom_mb", "peak_mb",
                                            "peak_source", "largest_pass", "safe_batch", "world_size"]
    back = Sizing.from_dict(data)
    assert back == sizing and back.timeouts[0].setting.startswith("job.stall_timeout")
    assert back.batch_headroom is not None and back.batch_headroom.safe_batch == 96
