"""The parts of calibration that launch nothing: the per-step statistics, the envelope and band a
check allows, the files read as data (every bad key named), which calibration a run uses, and the
determinism note."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tests.helpers import each_refused
from trainguard.checks.calibration import (
    BAND_FACTOR,
    CalibrationError,
    CalibrationRuns,
    ToleranceUsed,
    find_calibration,
    load_calibration,
    metric_stats,
    save_calibration,
    spread_note,
)
from trainguard.checks.equivalence import compare_trajectories
from trainguard.checks.statefiles import JobKey
from trainguard.config import JobFile
from trainguard.run.request import RunRequest

REQUEST = RunRequest.make(steps=4, seed=0, world_size=1)
#: the job the calibrations of these tests were made for
JOB = JobKey("trainguard.yaml", "0" * 64, ("python", "t.py"), ("loss",))


def test_the_statistics_of_same_seed_and_seeded_runs() -> None:
    same = [{1: 1.0, 2: 0.5, 3: 0.25, 4: 0.2}, {1: 1.0, 2: 0.5 + 4e-16, 3: 0.25, 4: 0.2},
            {1: 1.0, 2: 0.5, 3: 0.25 - 1e-16, 4: 0.2, 5: 9.0}]
    across = [same[0], {1: 1.2, 2: 0.7, 3: 0.3, 4: 0.1}]
    stats = metric_stats(same, across)
    assert stats is not None and stats.steps == [1, 2, 3, 4]  # step 5: not in every run
    assert stats.same_spread[0] == 0 and stats.same_spread[1] == pytest.approx(4e-16, rel=0.5)
    # noise seen once may show again at any later step, and one printed unit at any step
    smallest = min(v for v in stats.same_spread if v > 0)
    assert stats.envelope() == {1: smallest, 2: stats.same_spread[1], 3: stats.same_spread[1], 4: stats.same_spread[1]}
    rounded = metric_stats([{1: 1.0, 2: 0.5, 3: 0.4}, {1: 1.0, 2: 0.500001, 3: 0.400003}], [])
    assert rounded is not None and rounded.envelope() == pytest.approx({1: 1e-6, 2: 1e-6, 3: 3e-6})
    assert stats.across_std[0] == pytest.approx(0.1414, rel=1e-3) and stats.across_mean[0] == pytest.approx(1.1)
    assert metric_stats([{1: 1.0}, {2: 1.0}], []) is None


JOB_TEXT = ("job:\n  name: j\n  command: \"python {script} --steps {{steps}} --ckpt {{checkpoint_dir}}\"\n"
            "  resume_args: \"--resume\"\n"
            "  metrics: {{loss: 'step (?P<step>\\\\d+) loss (?P<value>\\\\S+)'}}\n"
            "checks:\n  resume: {{steps: 4, after_step: 2}}\n  canary: {{steps: 4}}\n")


def _job_files(tmp_path: Path, *names: str) -> list[JobFile]:
    """Job files side by side in ``tmp_path`` (one ``.trainguard/``), each its own script."""
    from trainguard.config import load_config

    out = []
    for name in names or ("trainguard.yaml",):
        (tmp_path / name).write_text(JOB_TEXT.format(script=name.replace(".yaml", ".py")))
        out.append(load_config(tmp_path / name))
    return out


def _saved(tmp_path: Path, spread: float, request: RunRequest = REQUEST, job: JobKey = JOB) -> Path:
    stats = metric_stats([{s: 1.0 / s for s in range(1, 5)}, {s: 1.0 / s + (spread if s == 2 else 0) for s in range(1, 5)},
                          {s: 1.0 / s for s in range(1, 5)}], [{s: 1.0 / s for s in range(1, 5)}])
    assert stats is not None
    return save_calibration(tmp_path, tmp_path, request, CalibrationRuns(3, [0]), {"loss": stats}, job=job)


def test_a_check_allows_three_times_the_envelope_and_says_where_it_came_from(tmp_path: Path) -> None:
    path = _saved(tmp_path, 1e-12)
    found, note = find_calibration(tmp_path, REQUEST, JOB)
    assert found is not None and found.path == path and note == ""
    tol = ToleranceUsed(0.0, 0.0, "test", found, {"loss": {s: BAND_FACTOR * v for s, v in found.metrics["loss"].envelope().items()}})
    expected = {s: 1.0 / s for s in range(1, 5)}
    within = {s: v + 2.9e-12 if s >= 2 else v for s, v in expected.items()}
    beyond = {s: v + 3.1e-12 if s == 3 else v for s, v in expected.items()}
    assert compare_trajectories(within, expected, band=tol.band("loss")).ok
    assert not compare_trajectories(within, expected).ok  # exact without the band
    diff = compare_trajectories(beyond, expected, band=tol.band("loss"))
    assert diff.first_divergent_step == 3 and tol.ratio("loss", 3, 3.1e-12) == pytest.approx(3.1, rel=1e-3)
    # step 1 showed no noise in the calibration, but the job is noisy: one measured unit allowed
    assert compare_trajectories({1: 1.0 + 2e-12, 2: 0.5}, {1: 1.0, 2: 0.5}, band=tol.band("loss")).ok
    assert not compare_trajectories({1: 1.0 + 4e-12, 2: 0.5}, {1: 1.0, 2: 0.5}, band=tol.band("loss")).ok
    assert not tol.exact_state and "within 3x" in tol.within()
    # a calibration of another run is not used
    assert find_calibration(tmp_path, RunRequest.make(steps=4, seed=1, world_size=1), JOB)[0] is None
    assert find_calibration(tmp_path, RunRequest.make(steps=4, seed=0, world_size=2), JOB)[0] is None


def test_a_deterministic_job_calibrates_to_an_exact_comparison(tmp_path: Path) -> None:
    job_file = _job_files(tmp_path)[0]
    _saved(job_file.state_dir, 0.0, job=JobKey.of(job_file))
    found, _ = find_calibration(job_file.state_dir, REQUEST, JobKey.of(job_file))
    assert found is not None and max(found.metrics["loss"].same_spread) == 0
    assert "agree exactly" in spread_note(job_file, REQUEST)


def _with_loss(good: dict, **changes: object) -> str:
    """``good`` with its loss statistics changed as given (``same_seed``, ``steps``, ...)."""
    loss = dict(good["metrics"]["loss"])
    for key, value in changes.items():
        if key in ("mean", "spread"):
            loss["same_seed"] = {**loss["same_seed"], key: value}
        else:
            loss[key] = value
    return json.dumps({**good, "metrics": {"loss": loss}})


def test_calibration_files_are_data_and_each_bad_key_is_named(tmp_path: Path) -> None:
    good = json.loads(_saved(tmp_path, 1e-12).read_text())
    spread = good["metrics"]["loss"]["same_seed"]["spread"]
    cases = {
        "not json": ("{", "not a readable calibration"),
        "other kind": (json.dumps({**good, "kind": "x"}), "not a trainguard calibration"),
        "version": (json.dumps({**good, "format_version": 9}), "format version 9"),
        "version 1": (json.dumps({**good, "format_version": 1}), "format version 1 .made before calibrations were keyed"),
        "runs": (json.dumps({**good, "runs": 1}), "runs must be a whole number from 3"),
        "short": (_with_loss(good, mean=[1]), "metrics.loss.same_seed.mean must be a list of 4 numbers"),
        "steps": (_with_loss(good, steps=["1"]), "metrics.loss.steps must be a non-empty list of step numbers"),
        "deep": ("[" * 100_000, "not a readable calibration"),
        # issue 42: values that would make a band of inf, or of nothing, or of another run
        "spread 1e308": (_with_loss(good, spread=[0, 1e308, 0, 0]), r"same_seed.spread\[1\] is 1e\+308: each must be a finite"),
        "spread NaN": (_with_loss(good, spread=[0, math.nan, 0, 0]), r"same_seed.spread\[1\] is nan"),
        "mean Infinity": (_with_loss(good, mean=[1, math.inf, 1, 1]), r"same_seed.mean\[1\] is inf"),
        "negative spread": (_with_loss(good, spread=[0, -1, 0, 0]), r"same_seed.spread\[1\] is -1: each must be a finite number from 0"),
        "huge integer": (_with_loss(good, spread=[0, 10**400, 0, 0]), "is a 401-digit number"),
        "huge steps": (json.dumps({**good, "request": {**good["request"], "steps": 10**400}}), "request.steps must be a whole number"),
        "other steps": (_with_loss(good, steps=[1, 2, 3, 99]), "metrics.loss.steps holds step 99 after step 3: steps rise from 0 to the run's 4"),
        "steps twice": (_with_loss(good, steps=[1, 2, 2, 3]), "holds step 2 after step 2"),
        "entry not a dict": (json.dumps({**good, "metrics": {"loss": [1]}}), "metrics.loss must be an object"),
        "same_seed not a dict": (_with_loss(good, same_seed="x"), "metrics.loss.same_seed must be an object"),
        "request not a dict": (json.dumps({**good, "request": []}), "request must be an object"),
        "no metrics": (json.dumps({**good, "metrics": {}}), "metrics holds no metric"),
        "no job": (json.dumps({k: v for k, v in good.items() if k != "job_key"}), "job_key is missing or not an object"),
        "job not a dict": (json.dumps({**good, "job_key": "trainguard.yaml"}), "job_key is missing or not an object"),
        "job digest": (json.dumps({**good, "job_key": {**good["job_key"], "run_sha256": "x"}}), "job_key.run_sha256 must be 64 hex"),
    }
    assert spread[1] > 0
    each_refused(tmp_path, cases, load_calibration, CalibrationError, "trainguard calibrate")
    # a broken newer file is skipped for an older good one, and said
    directory = _saved(tmp_path, 1e-12).parent
    (directory / "9999_broken.json").write_text("{")
    found, note = find_calibration(tmp_path, REQUEST, JOB)
    assert found is not None and "9999_broken.json" in note


def test_a_calibration_of_an_infinite_band_is_refused_and_the_check_stays_exact(tmp_path: Path) -> None:
    """issue 42: a spread of 1e308 made a band of inf, "(at most inf)", that passed any resume."""
    from trainguard.checks.calibration import tolerance_for
    from trainguard.run.runner import JobRunner

    (job_file,) = _job_files(tmp_path)
    runner = JobRunner(job_file)
    path = _saved(job_file.state_dir, 1e-12, job=JobKey.of(job_file))
    data = json.loads(path.read_text())
    data["metrics"]["loss"]["same_seed"]["spread"] = [1e308] * 4
    path.write_text(json.dumps(data))
    tol = tolerance_for(runner.job_file, job_file.checks.resume, REQUEST, "resume")
    assert tol.calibration is None and tol.band("loss") is None and "inf" not in tol.within()
    assert f"calibration files skipped: {path}: malformed calibration (metrics.loss.same_seed.spread[0] is 1e+308" in tol.source
    assert not compare_trajectories({1: 1.0, 2: 0.9}, {1: 1.0, 2: 0.5}, band=tol.band("loss")).ok


def test_a_calibration_is_used_only_by_the_job_it_was_made_for(tmp_path: Path) -> None:
    """issue 42: a noisy job file's calibration beside another job file (same steps, seed, world
    size, args) let that file's resume bug pass "within 3x the same-seed spread"."""
    from trainguard.checks.calibration import tolerance_for

    noisy, other = _job_files(tmp_path, "noisy.yaml", "other.yaml")
    _saved(noisy.state_dir, 1e-6, job=JobKey.of(noisy))
    expected = {s: 1.0 / s for s in range(1, 5)}
    resumed = {s: v + 2e-6 if s >= 3 else v for s, v in expected.items()}  # a resume bug of 2e-6
    tol = tolerance_for(other, other.checks.resume, REQUEST, "resume")
    assert tol.calibration is None and tol.band("loss") is None
    assert "0001_nogit.json was made for another job (job file 'noisy.yaml' (this run: 'other.yaml'))" in tol.source
    assert not compare_trajectories(resumed, expected, band=tol.band("loss")).ok  # caught
    # the job it was made for still uses it: the same difference is inside its measured noise
    own = tolerance_for(noisy, noisy.checks.resume, REQUEST, "resume")
    assert own.calibration is not None and "within 3x" in own.within()
    assert compare_trajectories(resumed, expected, band=own.band("loss")).ok
    # the same job file with another command is another job
    (tmp_path / "noisy.yaml").write_text(JOB_TEXT.format(script="noisy.py --fast"))
    from trainguard.config import load_config

    changed = load_config(tmp_path / "noisy.yaml")
    found, note = find_calibration(changed.state_dir, REQUEST, JobKey.of(changed))
    assert found is None and "job.command 'python noisy.py --steps {steps} --ckpt {checkpoint_dir}'" in note


def test_the_cli_refuses_too_few_runs_and_a_job_with_nothing_to_calibrate(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from trainguard.cli.main import main

    with pytest.raises(SystemExit) as usage:
        main(["calibrate", str(tmp_path), "--runs", "2"])
    assert usage.value.code == 2 and "use 3 to 100" in capsys.readouterr().err
    job = tmp_path / "trainguard.yaml"
    job.write_text("job:\n  name: j\n  command: \"python t.py --steps {steps}\"\n"
                   "  metrics: {loss: 'step (?P<step>\\\\d+) loss (?P<value>\\\\S+)'}\n"
                   "checks:\n  smoke: {}\n")
    assert main(["calibrate", str(job)]) == 2
    err = capsys.readouterr().err
    assert str(job) in err and "nothing to calibrate" in err and "(canary, resume, compat, parallel, reshard)" in err


def test_parallel_and_reshard_read_the_calibration_of_their_n_rank_run(tmp_path: Path) -> None:
    from trainguard.checks.calibration import calibration_requests, tolerance_for
    from trainguard.config import load_config
    from trainguard.run.runner import JobRunner

    job = tmp_path / "trainguard.yaml"
    job.write_text("job:\n  name: j\n  command: \"python t.py --steps {steps} --ckpt {checkpoint_dir}\"\n"
                   "  resume_args: \"--resume\"\n"
                   "  metrics: {loss: 'step (?P<step>\\\\d+) loss (?P<value>\\\\S+)'}\n"
                   "checks:\n  parallel: {steps: 4, world_size: 2, rtol: 0.001}\n"
                   "  reshard: {steps: 4, after_step: 2, pairs: [[2, 1], [4, 2]]}\n  resume: {steps: 4, after_step: 2}\n")
    runner = JobRunner(load_config(job))
    wanted = {(r.world_size, tuple(names)) for r, names in calibration_requests(runner)}
    assert wanted == {(1, ("resume",)), (2, ("parallel", "reshard")), (4, ("reshard",))}
    two = RunRequest.make(steps=4, seed=runner.settings.seed, world_size=2)
    spec = runner.job_file.checks.parallel
    before = tolerance_for(runner.job_file, spec, two, "parallel")
    assert before.calibration is None and before.source == "checks.parallel.rtol (job file)"
    _saved(tmp_path / ".trainguard", 1e-9, two, JobKey.of(runner.job_file))
    after = tolerance_for(runner.job_file, spec, two, "parallel")
    assert after.calibration is not None and after.band("loss") and max(after.band("loss").values()) == pytest.approx(3e-9, rel=1e-3)
    assert after.source.startswith("the larger of checks.parallel.rtol (job file) and 3 x the same-seed spread")
    # rtol stays the floor: a difference it allows passes though the band is smaller
    assert compare_trajectories({1: 1.0005, 2: 0.5}, {1: 1.0, 2: 0.5}, rtol=after.rtol, band=after.band("loss")).ok
    # the 1-rank run has no calibration: resume compares exactly
    assert tolerance_for(runner.job_file, runner.job_file.checks.resume,
                         RunRequest.make(steps=4, seed=runner.settings.seed, world_size=1), "resume").calibration is None


def test_a_trajectory_compared_on_no_step_is_not_a_match() -> None:
    """Two runs with no step of the metric in common compared nothing: not ``ok`` (issue 42: a
    check passes only on a comparison it made)."""
    empty = compare_trajectories({}, {}, metric="val", steps=range(6, 11))
    assert empty.compared_steps == 0 and not empty.ok
    assert empty.missing_words().startswith("has no step of val in common")
    apart = compare_trajectories({1: 1.0}, {2: 1.0}, metric="loss", steps=[3])
    assert not apart.ok
    same = compare_trajectories({6: 1.0, 7: 0.5}, {6: 1.0, 7: 0.5}, steps=range(6, 8))
    assert same.ok and same.compared_steps == 2


def test_a_trajectory_missing_steps_names_them() -> None:
    missing = compare_trajectories({6: 1.0}, {6: 1.0, 7: 0.5, 8: 0.25}, steps=range(6, 9))
    assert not missing.ok and missing.missing_words() == "is missing steps [7, 8]"
