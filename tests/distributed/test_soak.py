"""The chaos soak end to end on the toy job (2 ranks, gloo): faults drawn from a seed strike one
run; trainguard restarts it after each and judges the whole run against the uninterrupted one.

Default run: the clean job passes a soak of kill_rank and preempt faults, the same seed replays
the same schedule with the same verdict, and a planted job that checkpoints only at exit fails
(it starts again from step 1 after the first fault). Collection: one pytest item per seed, and
the soak_seed setting replays one. The example's soaks (3 seeds, 5+ faults each, replayed) are
in tests/distributed/test_digits_soak.py (slow).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import report_evidence, toy_job
from trainguard.config import load_config
from trainguard.drills import run_drill
from trainguard.report import CheckResult
from trainguard.run.runner import JobRunner

pytestmark = pytest.mark.timeout(240)

STEPS = 40
SOAK = ("{name: chaos, fault: soak, steps: " + str(STEPS) + ", params: {kinds: [kill_rank, preempt], "
        "faults: 3, seed: 8, min_gap: 4, fault_params: {preempt: {grace: 5}}}}")
CLEAN = "--sleep 0.05 --ckpt-every 3 --on-notice save"


def _soak(runner: JobRunner) -> CheckResult:
    return run_drill(runner, runner.job_file.checks.drills[0])


@pytest.fixture(scope="module")
def clean(tmp_path_factory: pytest.TempPathFactory) -> JobRunner:
    path = toy_job(tmp_path_factory.mktemp("soak") / "toy.trainguard.yaml", "soak-clean", CLEAN, [SOAK])
    return JobRunner(load_config(path))


def _struck(result: CheckResult) -> list[tuple[Any, ...]]:
    return [(f["kind"], f["rank"], f["step"], f["attempt"]) for f in report_evidence(result)["faults"]]


def test_a_clean_job_recovers_from_every_fault_and_the_soak_measures_each(clean: JobRunner) -> None:
    result = _soak(clean)
    assert result.status == "passed", result.summary
    ev = report_evidence(result)
    assert ev["seed"] == 8 and len(ev["schedule"]) == 3
    assert ev["restarts"] == 3
    assert {f["kind"] for f in ev["faults"]} == {"kill_rank", "preempt"}
    for fault in ev["faults"]:
        assert fault["injected_after_step"] >= fault["step"]
        assert fault["fault_to_first_step_after_restart_s"] > 0
        # a checkpoint every 3 steps: the resume starts at the last one before the fault's step
        # or later (the rank runs on while trainguard reads its line and injects, by how many
        # steps a loaded machine decides: 12 at load 10, so the steps lost are not bounded
        # here); from scratch, or from an older checkpoint, fails
        assert fault["lost_steps"] >= 0
        assert fault["resumed_from_step"] > 0
        assert fault["resumed_from_step"] >= fault["step"] - 3
    measured = ev["measured"]
    assert measured["faults"] == 3
    assert measured["checkpoint_every_steps"] == 3
    assert 0 < measured["goodput"] < 1
    assert measured["wall_s"] > measured["failure_free_wall_s"]
    assert measured["forecast"]["inputs"]["faults"] == 3
    assert set(measured["forecast"]["inputs"]["restart_s_by_kind"]) == {"kill_rank", "preempt"}
    assert ev["trajectory"]["compared_steps"] == STEPS

    replay = _soak(clean)  # the same seed: the same schedule, the same faults struck, same verdict
    assert replay.status == result.status
    assert report_evidence(replay)["schedule"] == ev["schedule"]
    assert _struck(replay) == _struck(result)


def exit_only_soak_job(directory: Path) -> Path:
    """The planted job: it checkpoints only at exit; the soak strikes it with kill_rank alone."""
    return toy_job(directory / "toy.trainguard.yaml", "soak-planted", "--sleep 0.05 --ckpt-at-exit-only",
                   [SOAK.replace("kill_rank, preempt", "kill_rank").replace(", fault_params: {preempt: {grace: 5}}", "")])


def test_a_job_that_checkpoints_only_at_exit_fails_the_soak(tmp_path: Path) -> None:
    path = exit_only_soak_job(tmp_path)
    result = _soak(JobRunner(load_config(path)))
    assert result.status == "failed", result.summary
    assert "began again at step 1" in result.summary
    assert report_evidence(result)["likely_causes"][0].startswith("no checkpoint before the fault")


def test_one_pytest_item_per_seed_and_the_setting_replays_one(pytester: pytest.Pytester) -> None:
    toy_job(pytester.path / "trainguard.yaml", "soak-items", CLEAN,
            [SOAK.replace("seed: 8", "seeds: [1, 2]")])
    pytester.makeini("[pytest]\naddopts = -p no:hypothesispytest\n")
    listed = pytester.runpytest_subprocess("--collect-only", "-q")
    listed.stdout.fnmatch_lines(["trainguard.yaml::drill:chaos[[]seed=1[]]",
                                 "trainguard.yaml::drill:chaos[[]seed=2[]]", "*2 tests collected*"])
    replay = pytester.runpytest_subprocess("--collect-only", "-q", "--trainguard-soak-seed", "77")
    replay.stdout.fnmatch_lines(["trainguard.yaml::drill:chaos[[]seed=77[]]", "*1 test collected*"])
    marked = pytester.runpytest_subprocess("--collect-only", "-q", "-m", "fault")
    marked.stdout.fnmatch_lines(["*2 tests collected*"])


def test_trainguard_soak_names_a_job_file_without_a_soak(tmp_path: Path) -> None:
    path = toy_job(tmp_path / "toy.trainguard.yaml", "no-soak", CLEAN,
                   ["{name: k, fault: kill_rank, steps: 10}"])
    proc = subprocess.run([sys.executable, "-m", "trainguard.cli", "soak", str(path)], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert "no soak drill" in proc.stderr and "checks.drills" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_the_soak_cli_prints_the_measured_costs_and_writes_the_report(tmp_path: Path) -> None:
    path = toy_job(tmp_path / "toy.trainguard.yaml", "soak-cli", CLEAN,
                   [SOAK.replace("faults: 3", "faults: 1")])
    report = tmp_path / "soak.json"
    proc = subprocess.run([sys.executable, "-m", "trainguard.cli", "soak", str(path), "--seed", "3",
                           "--report-json", str(report)], capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "seed 3: 1 fault(s); restart (fault -> first step) median" in proc.stdout
    assert "goodput" in proc.stdout
    data = json.loads(report.read_text())
    (check,) = data["checks"]
    assert check["name"] == "drill:chaos" and check["evidence"]["seed"] == 3
