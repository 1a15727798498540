"""The maths of profiles with known inputs: step statistics, scaling efficiency, Amdahl/USL fits,
regression expressions (a planted regression caught, a clean profile passed), baselines, sizing."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from trainguard._internal import envvars
from trainguard.config import ProfileCheck, Target, parse_config
from trainguard.errors import ConfigError
from trainguard.launch import RunResult
from trainguard.launch.hook import PACE_DIR
from trainguard.launch.pace import judge_pace, read_pace
from trainguard.profiling.compare import (
    RegressionExpressionError,
    compare_profiles,
    latest_profile_baseline,
    parse_regression,
    parse_regressions,
    save_profile_baseline,
)
from trainguard.profiling.measure import (
    SizeProfile,
    _CheckpointWatcher,
    _Observed,
    _ResourceSampler,
    _summarise,
)
from trainguard.profiling.render import render_html, render_markdown, render_plots
from trainguard.profiling.sizing import (
    SizeInputs,
    checkpoint_interval_s,
    predict_duration_s,
    size_run,
)
from trainguard.profiling.stats import fit_scaling, phrase_scaling, scaling_table, step_stats
from trainguard.run.runner import JobRunner

# ---------------------------------------------------------------------------- step statistics


def test_step_stats_excludes_warmup_and_uses_arrival_differences() -> None:
    # steps 1..3 are slow (warm-up), then 0.1 s each with one 1.0 s step (a checkpoint)
    arrivals = {1: 5.0, 2: 7.0, 3: 8.0}
    t = 8.0
    for step in range(4, 24):
        t += 1.0 if step == 10 else 0.1
        arrivals[step] = t
    stats = step_stats(arrivals, warmup_steps=3)
    assert stats.count == 20  # steps 4..23
    assert 3 not in stats.durations and 4 in stats.durations
    assert stats.p50_s == pytest.approx(0.1)
    assert stats.max_s == pytest.approx(1.0)
    assert stats.mean_s == pytest.approx((19 * 0.1 + 1.0) / 20)
    # the 99th percentile sees the slow step, the median does not
    assert stats.p99_s > 0.8 > stats.p90_s


def test_step_stats_skips_gaps_and_explains_too_few_steps() -> None:
    stats = step_stats({1: 0.0, 2: 1.0, 4: 3.0, 5: 3.5}, warmup_steps=0)
    assert sorted(stats.durations) == [2, 5]  # step 4 has no predecessor line
    with pytest.raises(ValueError, match="lower warmup_steps"):
        step_stats({1: 0.0, 2: 1.0}, warmup_steps=5)


# ---------------------------------------------------------------------------- scaling


def test_efficiency_weak_and_strong_and_the_sentence() -> None:
    table = scaling_table({1: 100.0, 2: 180.0, 4: 240.0}, "strong")
    assert table[2]["speedup"] == pytest.approx(1.8)
    assert table[4]["efficiency"] == pytest.approx(0.6)
    # strong scaling: T_1 / (N T_N) with a fixed global batch of 64 samples
    t1, t4 = 64 / 100.0, 64 / 240.0
    assert table[4]["efficiency"] == pytest.approx(t1 / (4 * t4))
    # weak scaling: thr_N / (N thr_1)
    weak = scaling_table({1: 100.0, 4: 360.0}, "weak")
    assert weak[4]["efficiency"] == pytest.approx(360 / (4 * 100))
    text = phrase_scaling(table, "strong", "GPUs")
    assert text.startswith("2 GPUs give 1.80x (90% efficient), 4 give 2.40x (60% efficient)")
    assert "strong scaling" in text


def _amdahl(sigma: float, n: int) -> float:
    return n / (1 + sigma * (n - 1))


def _usl(sigma: float, kappa: float, n: int) -> float:
    return n / (1 + sigma * (n - 1) + kappa * n * (n - 1))


def test_fit_recovers_amdahl_and_keeps_it_over_usl() -> None:
    thr = {n: 50.0 * _amdahl(0.1, n) for n in (1, 2, 4, 8)}
    fit = fit_scaling(thr)
    assert fit.chosen == "amdahl"
    assert fit.amdahl is not None and fit.amdahl.sigma == pytest.approx(0.1, abs=1e-9)
    assert fit.amdahl.rms_residual == pytest.approx(0.0, abs=1e-9)
    assert fit.throughput(16) == pytest.approx(50.0 * _amdahl(0.1, 16))
    assert fit.extrapolated(16) and not fit.extrapolated(4)


def test_fit_picks_usl_when_throughput_turns_down() -> None:
    thr = {n: 10.0 * _usl(0.05, 0.02, n) for n in (1, 2, 4, 8, 16)}
    fit = fit_scaling(thr)
    assert fit.chosen == "usl", fit.why
    assert fit.usl is not None
    assert fit.usl.sigma == pytest.approx(0.05, abs=1e-6)
    assert fit.usl.kappa == pytest.approx(0.02, abs=1e-6)
    assert fit.amdahl is not None and fit.amdahl.rms_residual > 0.1
    peak = fit.usl.peak()
    assert peak is not None and peak == pytest.approx(math.sqrt(0.95 / 0.02))


def test_fit_with_few_points_is_honest() -> None:
    two = fit_scaling({1: 100.0, 2: 150.0})
    assert two.chosen == "amdahl"
    assert two.amdahl is not None and two.amdahl.unvalidated
    assert "measure a third world size" in two.why
    assert two.amdahl.sigma == pytest.approx(2 / 1.5 - 1)  # C(2) = 1.5 -> sigma = 1/3
    three = fit_scaling({1: 100.0, 2: 150.0, 4: 190.0})
    assert three.usl is not None and three.usl.unvalidated  # 2 points for 2 parameters
    assert three.chosen == "amdahl"
    one = fit_scaling({2: 100.0})
    assert one.chosen is None and one.throughput(4) is None
    assert "nothing to fit" in one.why


def test_fit_relative_to_a_base_other_than_one() -> None:
    # measured at 2, 4, 8 ranks; the model is fitted on N/2
    thr = {n: 30.0 * _amdahl(0.2, n // 2) for n in (2, 4, 8)}
    fit = fit_scaling(thr)
    assert fit.amdahl is not None and fit.amdahl.sigma == pytest.approx(0.2, abs=1e-9)
    assert fit.throughput(16) == pytest.approx(30.0 * _amdahl(0.2, 8))


# ---------------------------------------------------------------------------- compare expressions


def test_parse_regression_expressions() -> None:
    c = parse_regression("p50_step_time:+10%")
    assert (c.metric, c.direction, c.limit, c.relative, c.world_size) == ("p50_step_time", 1, 0.1, True, None)
    d = parse_regression(" throughput@2 : -5% ")
    assert (d.metric, d.direction, d.world_size) == ("throughput", -1, 2)
    e = parse_regression("startup:+1.5")
    assert not e.relative and e.limit == 1.5


@pytest.mark.parametrize(
    ("expression", "message"),
    [
        ("p50_step_time+10%", "no ':'"),
        ("throughput:5%", "needs a sign"),
        ("thruput:-5%", "did you mean 'throughput'"),
        ("throughput:-five%", "expected METRIC"),
        ("", "empty"),
        ("throughput@0:-5%", "not a world size"),
    ],
)
def test_bad_expressions_say_what_and_how(expression: str, message: str) -> None:
    with pytest.raises(RegressionExpressionError, match=message):
        parse_regression(expression)


def test_all_bad_expressions_reported_at_once() -> None:
    with pytest.raises(RegressionExpressionError) as info:
        parse_regressions(["throughput:-5%", "bogus:+1%", "p50_step_time:1%"])
    text = str(info.value)
    assert "bogus" in text and "p50_step_time:1%" in text


def _profile(p50: dict[int, float], thr: dict[int, float]) -> dict[str, Any]:
    sizes = []
    for n in p50:
        sizes.append(
            {
                "world_size": n,
                "step": {"p50_s": p50[n], "p90_s": p50[n] * 1.2, "p99_s": p50[n] * 1.5, "mean_s": p50[n]},
                "throughput_sps": thr[n],
                "startup_s": 4.0,
                "peak_rss_mb": {"0": 500.0},
                "peak_gpu_mb": {},
                "checkpoint": {"cost_s": 0.05},
            }
        )
    return {"sizes": sizes, "scaling": {"table": {}}}


def test_compare_catches_a_planted_regression_and_passes_a_clean_profile() -> None:
    checks = parse_regressions(["p50_step_time:+10%", "throughput:-5%"])
    baseline = _profile({1: 0.100, 2: 0.060}, {1: 640.0, 2: 1070.0})
    clean = _profile({1: 0.104, 2: 0.061}, {1: 620.0, 2: 1050.0})  # +4 %, -3 %: noise
    assert not any(r.regressed for r in compare_profiles(baseline, clean, checks))
    slow = _profile({1: 0.100, 2: 0.070}, {1: 640.0, 2: 915.0})  # rank 2 step +17 %, thr -14 %
    results = compare_profiles(baseline, slow, checks)
    bad = [(r.check.metric, r.world_size) for r in results if r.regressed]
    assert bad == [("p50_step_time", 2), ("throughput", 2)]
    text = next(r for r in results if r.regressed).describe()
    assert "REGRESSION" in text and "+16.7%" in text and "limit +10%" in text


def test_compare_at_one_world_size_and_missing_values() -> None:
    baseline = _profile({1: 0.1, 2: 0.06}, {1: 640.0, 2: 1070.0})
    current = _profile({1: 0.1}, {1: 640.0})
    results = compare_profiles(baseline, current, parse_regressions(["throughput@2:-5%"]))
    assert len(results) == 1 and not results[0].regressed
    assert "not compared" in results[0].describe()


def test_profile_baselines_are_numbered_per_machine(tmp_path: Path) -> None:
    assert latest_profile_baseline(tmp_path) is None
    first = save_profile_baseline(tmp_path, tmp_path, _profile({1: 0.1}, {1: 640.0}))
    second = save_profile_baseline(tmp_path, tmp_path, _profile({1: 0.2}, {1: 320.0}))
    assert first.name.startswith("0001_") and second.name.startswith("0002_")
    assert first.parent == second.parent and first.parent.parent.name == "baselines"
    latest = latest_profile_baseline(tmp_path)
    assert latest is not None and latest["path"] == str(second)
    assert latest["profile"]["sizes"][0]["throughput_sps"] == 320.0
    (first.parent / "0003_broken.json").write_text("{not json")
    assert latest_profile_baseline(tmp_path)["path"] == str(second)  # type: ignore[index]


# ---------------------------------------------------------------------------- sizing


def test_checkpoint_interval_young_daly_and_the_cap() -> None:
    interval, rule = checkpoint_interval_s(60.0, 1800.0, 600.0)
    assert interval == pytest.approx(math.sqrt(2 * 60 * 1800))  # 464.8 s, under the cap
    assert "Young/Daly" in rule
    capped, rule = checkpoint_interval_s(60.0, 36_000.0, 600.0)
    assert capped == 600.0 and "capped" in rule


def test_predict_duration() -> None:
    assert predict_duration_s(5.0, 0.1, 101, 2.0) == pytest.approx(5 + 10 + 2)
    # warm-up as measured (steps 2..5 took 1.2 s), then 96 steps at the mean
    assert predict_duration_s(5.0, 0.1, 101, 2.0, warmup_s=1.2, warmup_steps=5) == pytest.approx(5 + 1.2 + 9.6 + 2)


def _inputs(n: int, thr: float) -> SizeInputs:
    return SizeInputs(n, thr, 64, startup_s=10.0, tail_s=0.0, checkpoint_cost_s=2.0, peak_mem_mb=900.0)


def _budget(n: int) -> tuple[float | None, str]:
    return 1000.0, "test budget"


def test_sizing_recommends_cheapest_size_meeting_the_deadline() -> None:
    # 1 rank: 100 samples/s; 2: 190; 4: 340 (Amdahl-like). 720,000 samples at 64 per step
    measured = {1: _inputs(1, 100.0), 2: _inputs(2, 190.0), 4: _inputs(4, 340.0)}
    fit = fit_scaling({n: m.throughput_sps for n, m in measured.items()})
    target = Target(samples=720_000, max_gpus=8, price_per_gpu_hour=2.0, deadline_hours=1.5,
                    min_efficiency=0.7, mtbf_hours=1000.0)
    sizing = size_run(target, measured, fit, samples_per_step=lambda n: 64, device="gpu",
                      memory_budget_mb=_budget)
    one = sizing.candidate(1)
    assert one is not None and one.hours > 1.5 and not one.feasible  # 7200 s of steps = 2 h
    assert sizing.recommended == 2, sizing.recommendation
    two = sizing.candidate(2)
    assert two is not None and not two.extrapolated
    assert two.steps == 11_250  # 720,000 samples / 64 per step
    assert two.gpu_hours == pytest.approx(2 * two.hours_with_failures)
    assert two.cost == pytest.approx(two.gpu_hours * 2.0)
    assert two.memory_headroom_mb == pytest.approx(100.0)
    eight = sizing.candidate(8)
    assert eight is not None and eight.extrapolated and eight.efficiency < 0.75
    assert any("never exceed" in line for line in sizing.limits)


def test_sizing_says_why_no_size_fits() -> None:
    measured = {1: _inputs(1, 100.0), 2: _inputs(2, 110.0)}
    fit = fit_scaling({1: 100.0, 2: 110.0})
    target = Target(steps=1_000_000, max_gpus=4, deadline_hours=1.0, min_efficiency=0.5)
    sizing = size_run(target, measured, fit, samples_per_step=lambda n: 64, device="cpu",
                      memory_budget_mb=_budget)
    assert sizing.recommended is None
    assert "fastest with efficiency" in sizing.recommendation and "deadline" in sizing.recommendation


# ---------------------------------------------------------------------------- config and reports

_JOB = """
job:
  name: t
  command: "python train.py --steps {steps}"
  metrics: {loss: 'step (?P<step>\\\\d+) loss (?P<value>\\\\S+)'}
"""


def test_config_profile_and_target() -> None:
    jf = parse_config(_JOB + "checks:\n  profile: {samples_per_step: 32, world_sizes: [1, 2, 4]}\n"
                      "target: {steps: 1000, max_gpus: 4}\n")
    assert jf.checks.profile is not None and jf.checks.profile.world_sizes == [1, 2, 4]
    assert jf.target is not None and jf.target.max_gpus == 4
    assert "profile" in [name for name, _ in jf.enabled_checks()]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ("checks:\n  profile: {samples_per_step: 8, steps: 5, warmup_steps: 4}\n", "warmup_steps"),
        ("checks:\n  profile: {samples_per_step: 8, world_sizes: [2, 2]}\n", "distinct"),
        ("checks:\n  profile: {samples_per_step: 8, step_metric: tokens}\n", "not one of job.metrics"),
        ("checks:\n  profile: {batch_size: 8, scaling: weak}\n", "weak scaling"),
        ("target: {steps: 10, samples: 5}\n", "exactly one of steps, samples or tokens"),
        ("target: {tokens: 10}\n", "tokens_per_sample"),
    ],
)
def test_config_profile_errors(extra: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_config(_JOB + extra)


def _report_data() -> dict[str, Any]:
    data = _profile({1: 0.10, 2: 0.06}, {1: 640.0, 2: 1070.0})
    for s in data["sizes"]:
        s.update(outcome="ok", cpu_util_pct={"0": 95.0}, gpu_util_pct=None, data_wait_share=None,
                 oversubscribed=None, loss={"1": 2.0, "2": 1.5, "3": 1.2},
                 step=dict(s["step"], durations={"6": 0.1, "7": 0.11, "8": 0.09}))
    table = scaling_table({1: 640.0, 2: 1070.0}, "strong")
    fit = fit_scaling({1: 640.0, 2: 1070.0})
    data.update(
        job="t", device="cpu", measured_on="CPU (2 cores)", created_at="now", trainguard_version="0",
        commit={"id": "abc", "dirty": False}, machine={"id": "m"}, job_file="t.yaml",
        settings={"steps": 10, "warmup_steps": 5, "world_sizes": [1, 2], "scaling": "strong"},
        scaling={"kind": "strong", "table": {str(k): v for k, v in table.items()},
                 "phrase": phrase_scaling(table, "strong"), "fit": fit.to_dict(),
                 "predictions": {str(n): {"throughput_sps": fit.throughput(n), "extrapolated": fit.extrapolated(n)}
                                 for n in range(1, 5)}},
        sizing=None, compare={}, saved_baseline=None, notes=["measured on CPU"],
    )
    return data


def test_reports_render_with_embedded_plots() -> None:
    data = _report_data()
    plots = render_plots(data)
    assert set(plots) == {"step_times", "scaling", "loss"}
    assert all(png.startswith(b"\x89PNG") for png in plots.values())
    html = render_html(data, plots)
    assert html.count("data:image/png;base64,") == 3
    assert "2 ranks give 1.67x" in html
    md = render_markdown(data)
    assert "| 2 | ok |" in md and "unvalidated" in md


def test_reports_render_without_the_plots_the_data_does_not_allow() -> None:
    data = _report_data()
    for s in data["sizes"]:
        s["loss"] = {}
    plots = render_plots(data)
    assert "loss" not in plots
    html = render_html(data, plots)  # a missing plot is left out, not an error
    assert html.count("data:image/png;base64,") == len(plots)


def test_the_loss_plot_shows_the_checks_runs_beside_the_profile_runs() -> None:
    data = _report_data()
    data["check_curves"] = [
        {"label": "canary", "world_size": 1, "metric": "loss", "outcome": "ok", "values": {"1": 2.0, "2": 1.0}},
        {"label": "resume-killed", "world_size": 1, "metric": "loss", "outcome": "stopped", "values": {"1": 2.0}},
    ]
    with_checks = render_plots(data)["loss"]
    data["check_curves"] = []
    assert render_plots(data)["loss"] != with_checks
    for s in data["sizes"]:
        s["loss"] = {}
    data["check_curves"] = [{"label": "canary", "world_size": 1, "values": {"1": 2.0, "2": 1.0}}]
    assert "loss" in render_plots(data)  # the checks' curves alone still make the plot


def test_cli_rejects_bad_expressions_before_running(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from trainguard.cli import main

    job = tmp_path / "trainguard.yaml"
    job.write_text(_JOB + "checks:\n  profile: {samples_per_step: 8}\n")
    assert main(["profile", str(job), "--compare", "throughput:5%"]) == 2
    err = capsys.readouterr().err
    assert "needs a sign" in err and "METRIC[@RANKS]" in err
    assert not (tmp_path / ".trainguard").exists()  # nothing ran


def test_fit_of_retrograde_scaling_uses_usl_with_a_warning() -> None:
    # throughput falls from 2 ranks on: Amdahl (speed-up >= 1 always) cannot follow it
    fit = fit_scaling({1: 800.0, 2: 550.0, 4: 630.0})
    assert fit.amdahl is not None and fit.amdahl.rms_residual > 0.1
    assert fit.chosen == "usl" and fit.usl is not None and fit.usl.unvalidated
    assert "proves nothing" in fit.why
    # sigma at its bound of 1 and kappa > 0 is what lets the USL fall below 1x
    assert fit.usl.sigma == pytest.approx(1.0) and fit.usl.kappa > 0
    assert fit.throughput(8) is not None and fit.throughput(8) < 800.0  # type: ignore[operator]


def test_fit_recovers_retrograde_usl_with_spare_points() -> None:
    thr = {n: 100.0 * _usl(1.0, 0.2, n) for n in (1, 2, 4, 8)}
    fit = fit_scaling(thr)
    assert fit.chosen == "usl" and fit.usl is not None and not fit.usl.unvalidated
    assert (fit.usl.sigma, fit.usl.kappa) == (pytest.approx(1.0), pytest.approx(0.2))


def test_bare_profile_counts_steps_and_weak_scaling_grows_the_batch() -> None:
    from trainguard.profiling.measure import batch_size_for, samples_per_step_for, throughput_unit

    bare = parse_config(_JOB + "checks:\n  profile:\n")
    assert bare.checks.profile is not None
    assert throughput_unit(bare, bare.checks.profile) == "steps/s"
    assert samples_per_step_for(bare, bare.checks.profile, 4) == 1
    weak_job = _JOB.replace("--steps {steps}", "--steps {steps} --batch-size {batch_size}")
    weak = parse_config(weak_job.replace("  metrics:", "  batch_size: 16\n  metrics:")
                        + "checks:\n  profile: {scaling: weak}\n")
    spec = weak.checks.profile
    assert spec is not None and throughput_unit(weak, spec) == "samples/s"
    assert batch_size_for(weak, spec, 4) == 64 and samples_per_step_for(weak, spec, 4) == 64


def test_a_checkpoint_written_after_a_late_read_line_goes_to_the_step_printed_after_it(tmp_path: Path) -> None:
    """The monitor can hand step lines 3, 4 and 5 over in one burst after the job wrote the
    checkpoint of step 5: the write belongs to step 5 (its line was read after the file was
    written), not to step 3 whose line was read before."""
    import os
    import time

    from trainguard.profiling.measure import _CheckpointWatcher

    watcher = _CheckpointWatcher()
    watcher.start(tmp_path)
    now = time.time()
    line_3, line_4, line_5 = now - 3.0, now - 2.0, now - 0.5
    ckpt = tmp_path / "step_5.pt"
    ckpt.write_bytes(b"x" * 1000)
    os.utime(ckpt, (now - 1.0, now - 1.0))  # written between the reads of lines 4 and 5
    for step, read_at in ((3, line_3), (4, line_4), (5, line_5)):
        watcher.at_step(step, read_at)
    assert watcher.writes == {5: 1000}

    rewritten = tmp_path / "step_5.pt"
    rewritten.write_bytes(b"x" * 1500)  # a later save grows it, read at once
    watcher.at_step(6, time.time() + 1.0)
    assert watcher.writes == {5: 1000, 6: 500}


def test_a_checkpoint_named_by_its_step_goes_to_that_step_however_late_the_lines_came(tmp_path: Path) -> None:
    """A loaded run read the lines of steps 2-5 in one burst after digits' train.py had written
    ckpt_000005.pt: every line was read after the file, and the write went to step 2. A new file
    named by its step (or in a folder named so) belongs to that step."""
    import time

    from trainguard.profiling.measure import _CheckpointWatcher

    watcher = _CheckpointWatcher()
    watcher.start(tmp_path)
    (tmp_path / "ckpt_000005.pt").write_bytes(b"x" * 1000)
    (tmp_path / "step_000005").mkdir()
    (tmp_path / "step_000005" / "__0_0.distcp").write_bytes(b"y" * 300)
    later = time.time() + 1.0
    for step in (2, 3, 4):
        watcher.at_step(step, later)
        assert watcher.writes == {}, step
    watcher.at_step(5, later)
    assert watcher.writes == {5: 1300}
    # a line read after the named step (its own line lost or late): still that step; a bare
    # number may be a rank: such a file goes by the lines as before
    (tmp_path / "ckpt_000010.pt").write_bytes(b"x" * 1000)
    (tmp_path / "model_rank1.pt").write_bytes(b"z" * 10)
    watcher.at_step(11, time.time() + 1.0)
    assert watcher.writes == {5: 1300, 10: 1000, 11: 10}


# ---------------------------------------------------------------------------- each rank's pace

PACE = Path(__file__).resolve().parents[1] / "data" / "pace"  # recorded: tests/unit/test_gate_stragglers.py


def test_the_profile_report_has_each_sizes_per_rank_table_and_its_straggler() -> None:
    data = _report_data()
    data["sizes"][1].update(pace=judge_pace(read_pace(PACE / "quota1.5-w2")).to_dict(), timed_rank=1)
    md = render_markdown(data)
    assert "**Ranks at 2** (stragglers: rank 1 2.27x as busy as the others" in md
    assert "steps timed from rank 1's lines" in md
    assert "| 0 | 77 | 0.35 | 0.44 | no |\n| 1 | 77 | 0.94 | 2.27 | yes, named at step 43 |" in md
    html = render_html(data, {})
    assert "<h2>Ranks at 2</h2>" in html and "yes, named at step 43" in html
    assert "Ranks at 1" not in md  # one rank: no table


def _timed(tmp_path: Path, pace_case: str) -> SizeProfile:
    """A 2-rank timed run's summary: rank 1's step lines arrive 0.3 s apart, rank 0's 0.2 s apart
    (its line of each step comes first), the pace judged from the recorded clocks of ``pace_case``."""
    job_file = parse_config(_JOB)
    spec = ProfileCheck(steps=12, warmup_steps=2)
    runner = JobRunner(job_file)
    try:
        seen = _Observed(_ResourceSampler(runner.backend), _CheckpointWatcher())
        seen.by_rank = {0: {s: 1.0 + 0.2 * s for s in range(1, 13)}, 1: {s: 1.0 + 0.3 * s for s in range(1, 13)}}
        result = RunResult("ok", [], tmp_path, 2, 0, [], [], 6.0, 1.2, pace=judge_pace(read_pace(PACE / pace_case)))
        return _summarise(job_file, spec, 2, None, 0, result, seen)
    finally:
        runner.close()


def test_the_steps_are_timed_from_the_named_stragglers_lines_else_rank_0s(tmp_path: Path) -> None:
    slow = _timed(tmp_path, "quota1.5-w2")
    assert slow.timed_rank == 1 and slow.step is not None and math.isclose(slow.step.mean_s, 0.3)
    assert slow.to_dict()["pace"]["stragglers"] == [1]
    clean = _timed(tmp_path, "clean-w2")
    assert clean.timed_rank == 0 and clean.step is not None and math.isclose(clean.step.mean_s, 0.2)


def test_a_timed_run_of_several_ranks_records_only_the_step_clocks(tmp_path: Path) -> None:
    """The run agent in a profile's timed run: each step's clocks at 2+ ranks, nothing at 1 rank
    or when the job turns the agent off."""
    def hook(ranks: int, **job: Any) -> dict[str, Any] | None:
        settings = {"record_samples": "false", **job}
        runner = JobRunner(parse_config(_JOB + "".join(f"  {k}: {v}\n" for k, v in settings.items())))
        try:
            env = runner._metric_sources({}, tmp_path, {}, step_records=False, ranks=ranks)[2]
        finally:
            runner.close()
        return json.loads(env[envvars.RUN_HOOK]) if env else None

    assert hook(2) == {"pace_dir": str(tmp_path / PACE_DIR)}
    assert hook(1) is None and hook(2, record_steps="false") is None
