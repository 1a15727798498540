"""Trajectory comparison, the determinism and smoke checks on real toy jobs, the check registry
and the report contract.

The jobs are ``tests/data/jobs/*.trainguard.yaml`` copied into a temporary directory (checks
write ``.trainguard/`` next to the job file). Each planted defect must be caught, with the
evidence a person needs to act on it.
"""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
from pathlib import Path

import pytest

import trainguard.session.orchestrate as checks_module
from tests.helpers import check_context, report_evidence, wait_for_a_background_run
from trainguard._version import __version__
from trainguard.checks.equivalence import (
    NONDETERMINISM_CAUSES,
    compare_trajectories,
    run_determinism,
)
from trainguard.checks.smoke import run_smoke
from trainguard.config import DeterminismCheck, load_config
from trainguard.config.settings import Settings
from trainguard.report import CheckResult, SkipReason
from trainguard.run.runner import JobRunner
from trainguard.session import available_checks, check, run_check, run_checks

JOBS = Path(__file__).resolve().parents[1] / "data" / "jobs"


@pytest.fixture
def jobs(tmp_path: Path) -> Path:
    """A private copy of the toy jobs (their run directories land next to the job files)."""
    return Path(shutil.copytree(JOBS, tmp_path / "jobs"))


def runner_for(jobs: Path, name: str, **settings: object) -> JobRunner:
    return JobRunner(load_config(jobs / f"{name}.trainguard.yaml"), Settings(**settings))  # type: ignore[arg-type]


# --------------------------------------------------------------------------------------------
# compare_trajectories
# --------------------------------------------------------------------------------------------


def test_identical_trajectories_match_exactly() -> None:
    traj = {1: 1.0, 2: 0.5, 3: 0.25}
    diff = compare_trajectories(dict(traj), traj)
    assert diff.ok
    assert diff.compared_steps == 3
    assert diff.first_divergent_step is None
    assert diff.max_abs_diff == 0.0 and diff.max_rel_diff == 0.0
    assert diff.missing_in_actual == [] and diff.missing_in_expected == []


def test_exact_comparison_names_the_first_divergent_step() -> None:
    expected = {3: 0.3, 1: 1.0, 2: 0.5, 4: 0.2}  # insertion order is not step order
    actual = {1: 1.0, 2: 0.5 + 1e-12, 3: 0.4, 4: 0.2}
    diff = compare_trajectories(actual, expected, metric="loss")
    assert not diff.ok
    assert diff.first_divergent_step == 2
    assert diff.first_values == (0.5 + 1e-12, 0.5)  # (actual, expected)
    assert diff.max_abs_diff == pytest.approx(0.1)
    assert diff.max_rel_diff == pytest.approx(0.1 / 0.3)
    evidence = diff.as_evidence().to_dict()
    assert evidence["metric"] == "loss"
    assert evidence["first_divergent_step"] == 2
    assert evidence["values_at_first_divergence"] == [0.5 + 1e-12, 0.5]


def test_tolerances_accept_small_differences_only() -> None:
    expected = {1: 1.0, 2: 100.0}
    actual = {1: 1.0 + 1e-7, 2: 100.0 + 5e-5}
    assert not compare_trajectories(actual, expected).ok
    assert compare_trajectories(actual, expected, rtol=1e-6).ok  # 5e-5 <= 1e-6 * 100
    assert compare_trajectories(actual, expected, atol=1e-6).first_divergent_step == 2
    assert compare_trajectories(actual, expected, atol=1e-3).ok
    # relative tolerance is taken on the expected value
    diff = compare_trajectories({1: 2.0}, {1: 1.0}, rtol=0.99)
    assert diff.first_divergent_step == 1


def test_missing_steps_fail_and_are_listed() -> None:
    expected = {1: 1.0, 2: 0.9, 3: 0.8, 4: 0.7}
    actual = {1: 1.0, 3: 0.8, 5: 0.1}  # step 5 is extra: not judged
    diff = compare_trajectories(actual, expected)
    assert not diff.ok
    assert diff.first_divergent_step is None
    assert diff.missing_in_actual == [2, 4]
    assert diff.compared_steps == 2
    assert diff.as_evidence().to_dict()["missing_steps"] == [2, 4]


def test_explicit_steps_restrict_the_comparison() -> None:
    expected = {1: 1.0, 2: 0.9, 3: 0.8}
    actual = {1: 5.0, 2: 0.9, 3: 0.8}
    assert compare_trajectories(actual, expected, steps=[2, 3]).ok
    diff = compare_trajectories(actual, expected, steps=range(2, 6))
    assert diff.ok  # steps the reference never printed are not the actual run's fault
    assert diff.missing_in_expected == [4, 5]
    assert diff.compared_steps == 2


def test_nan_equals_nan_but_not_a_number() -> None:
    nan = math.nan
    same = compare_trajectories({1: 1.0, 2: nan}, {1: 1.0, 2: nan})
    assert same.ok and same.compared_steps == 2
    assert not math.isnan(same.max_abs_diff)

    diff = compare_trajectories(
        {1: 1.0, 2: nan, 3: 0.5}, {1: 1.0, 2: 0.7, 3: 0.5}, rtol=1.0, atol=1.0
    )
    assert diff.first_divergent_step == 2
    assert not math.isnan(diff.max_abs_diff)
    assert compare_trajectories({1: 0.7}, {1: nan}, atol=10.0).first_divergent_step == 1


def test_infinities_must_match_exactly() -> None:
    inf = math.inf
    assert compare_trajectories({1: inf}, {1: inf}).ok
    assert compare_trajectories({1: -inf}, {1: inf}, atol=1e300).first_divergent_step == 1
    assert compare_trajectories({1: 1e308}, {1: inf}, rtol=1.0).first_divergent_step == 1


# --------------------------------------------------------------------------------------------
# The determinism check
# --------------------------------------------------------------------------------------------


def test_determinism_passes_on_the_clean_toy_job(jobs: Path) -> None:
    runner = runner_for(jobs, "toy")
    spec = runner.job_file.checks.determinism
    assert spec is not None
    result = run_determinism(check_context(runner, "determinism", spec))

    assert result.status == "passed", result.summary
    assert result.summary == "two runs with seed 0 match on all 8 steps of loss"
    (metric,) = report_evidence(result)["metrics"]
    assert metric["compared_steps"] == 8 and metric["first_divergent_step"] is None
    first, second = report_evidence(result)["run_dirs"]
    assert first != second and Path(first).is_dir() and Path(second).is_dir()
    assert result.duration_s > 0
    assert "likely_causes" not in report_evidence(result)


def test_determinism_fails_on_an_unseeded_rng_naming_the_step_and_causes(jobs: Path) -> None:
    runner = runner_for(jobs, "nondet", seed=7)
    spec = runner.job_file.checks.determinism
    assert spec is not None
    result = run_determinism(check_context(runner, "determinism", spec))

    assert result.status == "failed"
    assert result.summary.startswith("loss differs from step 1 on (")
    assert "with the same seed 7" in result.summary
    (metric,) = report_evidence(result)["metrics"]
    assert metric["first_divergent_step"] == 1
    a, b = metric["values_at_first_divergence"]
    assert a != b
    assert report_evidence(result)["likely_causes"] == list(NONDETERMINISM_CAUSES)
    assert any("unseeded RNG" in cause for cause in report_evidence(result)["likely_causes"])
    assert result.reproduce is not None
    assert result.reproduce.startswith("run twice and diff: ")
    assert "toy_train.py --steps 6 --seed 7 " in result.reproduce
    assert "--seed 7" in result.reproduce and "--nondet" in result.reproduce


def test_determinism_reports_a_job_that_does_not_complete_as_an_error(jobs: Path) -> None:
    job_file = load_config(jobs / "die.trainguard.yaml")
    runner = JobRunner(job_file, Settings())
    result = run_determinism(check_context(runner, "determinism", DeterminismCheck.model_validate({"steps": 5})))
    assert result.status == "error"
    # rank 0 may have finished its 5 steps first (it is then named as what rank 1 waited for)
    assert result.summary.startswith("the job did not complete: rank 1 exited with code 3"), result.summary
    assert report_evidence(result)["failed_rank"] == 1
    assert "planted failure at step 3" in report_evidence(result)["stderr_tail"]


def test_determinism_with_jsonl_metrics(jobs: Path) -> None:
    runner = runner_for(jobs, "jsonl")
    spec = runner.job_file.checks.determinism
    assert spec is not None
    result = run_determinism(check_context(runner, "determinism", spec))
    assert result.status == "passed", result.summary
    assert report_evidence(result)["metrics"][0]["compared_steps"] == 6


# --------------------------------------------------------------------------------------------
# The smoke check
# --------------------------------------------------------------------------------------------


def smoke(jobs: Path, name: str) -> CheckResult:
    runner = runner_for(jobs, name)
    spec = runner.job_file.checks.smoke
    assert spec is not None
    return run_smoke(check_context(runner, "smoke", spec))


def test_smoke_passes_on_the_clean_job(jobs: Path) -> None:
    result = smoke(jobs, "toy")
    assert result.status == "passed", result.summary
    assert "5 steps in" in result.summary
    assert "metrics for every step, 2 checkpoint file(s)" in result.summary
    evidence = report_evidence(result)
    assert evidence["outcome"] == "ok"
    assert evidence["exits"] == ["exit code 0", "exit code 0"]
    assert evidence["metric_steps_seen"] == 5
    assert sorted(Path(p).name for p in evidence["checkpoint_files"]) == [
        "rank0-step000005.json",
        "rank1-step000005.json",
    ]
    stages = evidence["stages"]
    assert 0 < stages["launch_to_first_metric_s"] <= stages["total_s"]
    assert stages["first_to_last_metric_s"] >= 0 and stages["last_metric_to_exit_s"] >= 0
    assert result.reproduce is not None
    assert "toy_train.py --steps 5 --seed 0 " in result.reproduce


def test_smoke_fails_when_a_rank_dies(jobs: Path) -> None:
    result = smoke(jobs, "die")
    assert result.status == "failed"
    assert "the job did not complete: rank 1 exited with code 3" in result.summary
    assert report_evidence(result)["outcome"] == "failed"
    assert report_evidence(result)["exits"][1] == "exit code 3"
    assert "planted failure at step 3" in report_evidence(result)["stderr_tail"]
    assert "--die-rank 1" in (result.reproduce or "")


def test_smoke_blames_a_crash_before_the_first_step_not_the_metric_regex(jobs: Path) -> None:
    # a public script that fails at start-up (torch.load of its own data) printed no loss line:
    # "check job.metrics.loss" would send the user after the regex
    job = jobs / "die.trainguard.yaml"
    job.write_text(job.read_text().replace("--die-rank 1 --die-step 3", "--die-rank 0 --die-step 1")
                   .replace("world_size: 2", "world_size: 1"))
    result = smoke(jobs, "die")
    assert result.status == "failed" and "rank 0 exited with code 3" in result.summary
    assert "no `loss` line" not in result.summary


def test_smoke_names_a_step_without_a_metric_line(jobs: Path) -> None:
    result = smoke(jobs, "skip")
    assert result.status == "failed"
    assert "no `loss` line for step(s) [3]" in result.summary
    assert "did not complete" not in result.summary
    assert report_evidence(result)["metric_steps_seen"] == 4


def test_smoke_fails_when_no_checkpoint_is_written(jobs: Path) -> None:
    result = smoke(jobs, "nockpt")
    assert result.status == "failed"
    assert "no checkpoint was written to" in result.summary
    assert report_evidence(result)["checkpoint_files"] == []
    assert report_evidence(result)["outcome"] == "ok"


def test_smoke_does_not_ask_for_checkpoints_a_job_is_not_given(jobs: Path) -> None:
    text = (jobs / "nockpt.trainguard.yaml").read_text().replace(" --ckpt-dir {checkpoint_dir}", "")
    (jobs / "plain.trainguard.yaml").write_text(text)
    result = smoke(jobs, "plain")
    assert result.status == "passed", result.summary


# --------------------------------------------------------------------------------------------
# Registry, run_checks and the report contract
# --------------------------------------------------------------------------------------------


def test_a_configured_check_this_version_cannot_run_is_skipped_with_the_reason(
    jobs: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = checks_module.check_for
    # canary is configured below; the registry this run sees lacks it (a job file validated
    # before its check was unregistered)
    monkeypatch.setattr(checks_module, "check_for", lambda name: None if name == "canary" else real(name))
    text = (jobs / "toy.trainguard.yaml").read_text() + "  canary: {steps: 10}\n"
    path = jobs / "canary.trainguard.yaml"
    path.write_text(text)
    job_file = load_config(path)
    runner = JobRunner(job_file, Settings())

    assert "canary" in available_checks()
    assert job_file.checks.canary is not None
    result = run_check(runner, "canary", job_file.checks.canary)
    assert result.status == "skipped" and result.skip_reason == SkipReason.NOT_IN_THIS_VERSION
    assert result.ok  # a skipped check does not fail the report
    assert result.summary.startswith(
        "the canary check is configured but not available in this trainguard version (available: smoke, "
    )

    seen: list[str] = []
    report = run_checks(
        job_file, runner, only=["canary", "smoke"], on_result=lambda r: seen.append(r.name)
    )
    assert seen == ["smoke", "canary"]  # run order, not the order asked for
    assert [c.status for c in report.checks] == ["passed", "skipped"]
    assert report.status == "passed"


def test_check_writes_the_report_contract(jobs: Path, tmp_path: Path) -> None:
    target = tmp_path / "out" / "report.json"
    report = check(jobs / "toy.trainguard.yaml", only=["smoke"], seed=3, report_json=str(target))

    assert report.path == str(target)
    data = json.loads(target.read_text())
    assert data["trainguard_version"] == __version__
    assert data["job"] == "toy"
    assert data["status"] == "passed"
    assert data["job_file"] == str((jobs / "toy.trainguard.yaml").resolve())
    (entry,) = data["checks"]
    assert {"name", "status", "summary", "evidence", "duration_s"} <= set(entry)
    assert entry["name"] == "smoke" and entry["status"] == "passed"
    assert isinstance(entry["evidence"], dict) and entry["evidence"]["steps"] == 5
    assert entry["duration_s"] > 0
    assert "--seed 3" in entry["reproduce"]


def test_check_reports_a_failure_and_defaults_next_to_the_job_file(jobs: Path) -> None:
    report = check(jobs / "nondet.trainguard.yaml")
    default = jobs / ".trainguard" / "report.json"
    assert report.path == str(default)
    data = json.loads(default.read_text())
    assert data["status"] == "failed"
    (entry,) = data["checks"]
    assert entry["name"] == "determinism" and entry["status"] == "failed"
    assert entry["evidence"]["metrics"][0]["first_divergent_step"] == 1


def test_check_of_an_unknown_name_is_a_config_error_naming_the_file(jobs: Path) -> None:
    from trainguard.errors import ConfigError

    with pytest.raises(ConfigError, match=r"toy\.trainguard\.yaml: unknown check name\(s\) bogus"):
        check(jobs / "toy.trainguard.yaml", only=["bogus"])
    assert not (jobs / ".trainguard" / "report.json").exists()


def test_aligned_trajectories_compare_a_partly_printed_step_on_its_ranks_only() -> None:
    """Rank 1 printed step 25 and was killed before rank 0 printed it: that step is compared on
    rank 1 alone, not as a false divergence; a real difference is still caught."""
    from trainguard.launch import MetricPoint as P
    from trainguard.launch.metrics import aligned_trajectories

    reference = [P("loss", 25, 1.0, 0, 0.0), P("loss", 25, 3.0, 1, 0.0), P("loss", 26, 2.0, 0, 0.0), P("loss", 26, 2.5, 1, 0.0)]
    recovered = [P("loss", 25, 3.0, 1, 0.0), P("loss", 26, 2.0, 0, 0.0), P("loss", 26, 2.5, 1, 0.0)]
    actual, expected = aligned_trajectories(recovered, reference)
    assert compare_trajectories(actual, expected).ok
    # the plain per-step means would have called step 25 divergent (3.0 vs 2.0)
    from trainguard.launch import trajectory

    assert not compare_trajectories(trajectory(recovered), trajectory(reference)).ok
    wrong = [P("loss", 25, 3.5, 1, 0.0), *recovered[1:]]
    actual, expected = aligned_trajectories(wrong, reference)
    assert compare_trajectories(actual, expected).first_divergent_step == 25
    # N ranks vs 1 rank: plain means
    single = [P("loss", 25, 2.0, 0, 0.0), P("loss", 26, 2.25, 0, 0.0)]
    actual, expected = aligned_trajectories(reference, single)
    assert actual == {25: 2.0, 26: 2.25} and expected == {25: 2.0, 26: 2.25}


# --------------------------------------------------------------------------------------------
# Shared and prefetched reference runs
# --------------------------------------------------------------------------------------------


def test_determinism_overlaps_its_two_runs_and_shares_the_first(jobs: Path) -> None:
    runner = runner_for(jobs, "toy")
    spec = runner.job_file.checks.determinism
    assert spec is not None
    result = run_determinism(check_context(runner, "determinism", spec))
    assert result.status == "passed", result.summary
    reference = runner.scheduling.reference(runner.request_for(spec))  # kept: no third launch
    labels = [c.label for c in runner.curves]
    assert sorted(labels) == ["determinism-repeat", "reference"], labels
    spans = {c.label: c.span for c in runner.curves}
    (ref_start, ref_end), (rep_start, rep_end) = spans["reference"], spans["determinism-repeat"]
    # the reference ran in the background while the repeat ran: their lifetimes overlap
    assert ref_start < rep_end and rep_start < ref_end, spans
    assert reference.ok


def test_a_completed_run_offered_as_reference_is_reused_whatever_its_limits(jobs: Path) -> None:
    import dataclasses

    runner = runner_for(jobs, "toy")
    request = runner.request_for(runner.job_file.checks.determinism)  # type: ignore[arg-type]
    limited = dataclasses.replace(request, timeout=30.0, max_rss_mb=4000.0)
    canary_like = runner.run(limited, label="canary")
    assert canary_like.ok, canary_like.reason
    runner.scheduling.offer_reference(limited, canary_like)
    assert runner.scheduling.reference(request) is canary_like
    assert [c.label for c in runner.curves] == ["canary"]  # nothing else launched


def test_a_failed_run_is_never_kept_as_a_reference(jobs: Path) -> None:
    runner = runner_for(jobs, "die")
    spec = runner.job_file.checks.smoke
    assert spec is not None
    request = runner.request_for(spec)
    failed = runner.run(request, label="canary")
    assert not failed.ok
    runner.scheduling.offer_reference(request, failed)
    assert runner.scheduling.reference(request) is not failed


def test_stop_background_ends_a_prefetched_run(jobs: Path) -> None:
    import time

    runner = runner_for(jobs, "long")
    spec = next(s for _, s in runner.job_file.enabled_checks(None))
    request = runner.request_for(spec)
    runner.scheduling.prefetch(request)
    wait_for_a_background_run(runner)
    (pending,) = runner.scheduling._pending.values()
    started = time.monotonic()
    runner.close()  # stops the background run and waits for its teardown
    result = pending.result(timeout=15)
    assert result.outcome == "stopped" and time.monotonic() - started < 15
    assert "closed" in (result.reason or "")
    assert not runner._inflight


# --------------------------------------------------------------------------------------------
# a kill that lands after the run finished
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("flags", ["--print-at-exit", "--print-at-exit --linger 0.5", ""],
                         ids=["finished", "killed-in-its-teardown", "clean"])
def test_a_kill_that_came_too_late_is_said_so_not_a_broken_metric_or_resume(jobs: Path, flags: str) -> None:
    """A job that prints its lines in a burst at exit shows step after_step only once it has done
    every step: the SIGKILL lands after it finished (or in its teardown). That tests no resume:
    an error saying the kill came too late, not "check job.metrics.loss" nor "the resumed run
    printed no `loss` line" (issue 24). The clean job's kill lands mid-run and passes."""
    from trainguard.checks.resume import run_resume_check
    from trainguard.config import ResumeCheck

    path = jobs / "toy.trainguard.yaml"
    # the ranks step together (a barrier per step): the clean kill leaves both at one checkpoint
    path.write_text(path.read_text().replace(
        "--sleep 0.02", f"--sleep 0.02 --sync-dir {{run_dir}}/sync --sync-timeout 10 {flags}"))
    runner = JobRunner(load_config(path))
    try:
        result = run_resume_check(check_context(runner, "resume", ResumeCheck(steps=10, after_step=6)))
    finally:
        runner.close()
    if not flags:
        assert result.status == "passed", result.summary
        return
    assert result.status == "error", result.summary
    assert result.summary.startswith("the kill came too late to test a resume: the run had "), result.summary
    assert "(step 10 of 10 printed) when trainguard read step 6 of `loss`" in result.summary
    assert "job.metrics" not in result.summary and report_evidence(result)["killed_after_step"] == 10
    # the uninterrupted run's copy after step 6 was the final state too: not kept, and said why
    assert "had printed its last step (10 of 10)" in report_evidence(result)["not_kept"], report_evidence(result)


# --------------------------------------------------------------------------------------------
# the report's status: never passed when nothing was tested or the run was cut short
# --------------------------------------------------------------------------------------------


def test_the_report_status_of_skips_and_interruptions() -> None:
    from trainguard.report import Report

    passed, skipped = CheckResult("smoke", "passed", ""), CheckResult("drill:k", "skipped", "no cgroups")
    failed = CheckResult("resume", "failed", "")
    assert Report("j", [passed, skipped]).status == "passed"
    assert Report("j", [skipped]).status == "skipped" and Report("j", [skipped]).ok
    assert Report("j", [passed], interrupted=True).status == "interrupted"
    assert not Report("j", [passed], interrupted=True).ok
    assert Report("j", [failed], interrupted=True).status == "failed"
    assert Report("j", [passed]).to_dict()["status"] == "passed"


def test_a_report_written_after_ctrl_c_is_not_passed(jobs: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Smoke passes, then Ctrl-C in the next check: the report written on the way out holds smoke
    and says `interrupted`, never `passed` (issue 24: a CI script reading only `status`)."""
    real = checks_module.check_for

    def ctrl_c(ctx: object) -> CheckResult:
        raise KeyboardInterrupt

    monkeypatch.setattr(checks_module, "check_for", lambda name: dataclasses.replace(real(name), run=ctrl_c)
                        if name == "determinism" else real(name))
    report_path = jobs / "r.json"
    with pytest.raises(KeyboardInterrupt):
        check(jobs / "toy.trainguard.yaml", report_json=str(report_path))
    data = json.loads(report_path.read_text())
    assert [c["name"] for c in data["checks"]] == ["smoke"] and data["interrupted"] is True
    assert data["status"] == "interrupted"
