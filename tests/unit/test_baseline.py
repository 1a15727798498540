"""Canary baselines: storage (machine id, numbering, atomic writes, refusals), the band maths on
synthetic trajectories, and the canary on the toy job (no torch) saving a baseline, passing
inside its band and failing a job that learns more slowly.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

import trainguard.checks.baseline as bl
from tests.helpers import each_refused, report_evidence
from trainguard._internal.machine import machine_id
from trainguard.checks.band import (
    BandEvidence,
    build_band,
    compare_to_band,
    rolling_median,
    smoothing_window,
)
from trainguard.checks.baseline import (
    FORMAT_VERSION,
    BaselineError,
    find_baseline,
    load_baseline,
    save_baseline,
)
from trainguard.checks.statefiles import JobKey, StoredRequest
from trainguard.cli import main as cli_main
from trainguard.config import load_config, parse_config
from trainguard.errors import ConfigError
from trainguard.run.request import RunRequest
from trainguard.session import check

JOBS = Path(__file__).resolve().parents[1] / "data" / "jobs"
TOY = JOBS / "toy_train.py"

JOB = """\
job:
  name: toy-baseline
  command: "python toy.py --steps {steps} --seed {seed}"
  metrics:
    loss: 'step (?P<step>\\d+) loss (?P<value>\\S+)'
  timeout: 60
  stall_timeout: 20
checks:
  smoke: {steps: 3}
  canary: {steps: 40, min_loss_drop: 0.3}
"""


def _job_file(tmp_path: Path, text: str = JOB) -> Path:
    path = tmp_path / "trainguard.yaml"
    path.write_text(text)
    return path


def _request(steps: int = 40, seed: int = 0, args: tuple[str, ...] = ()) -> RunRequest:
    return RunRequest.make(steps=steps, seed=seed, world_size=1, args=args)


def _curve(steps: int = 40, scale: float = 1.0) -> dict[int, float]:
    return {s: 2.0 * math.exp(-0.05 * s) * scale + 0.1 for s in range(1, steps + 1)}


# --------------------------------------------------------------------------------------------
# storage
# --------------------------------------------------------------------------------------------


def test_machine_id_names_system_python_and_cpu_architecture() -> None:
    major, minor, _ = platform.python_version_tuple()
    expected = f"{platform.system()}-{platform.python_implementation()}-{major}.{minor}-{platform.machine()}"
    assert machine_id() == expected
    assert "/" not in machine_id() and " " not in machine_id()


def test_saves_are_numbered_per_machine_and_hold_everything_to_judge_them(tmp_path: Path) -> None:
    job_file = load_config(_job_file(tmp_path))
    first = save_baseline(job_file, _request(), {"loss": _curve()})
    second = save_baseline(job_file, _request(seed=3), {"loss": _curve(), "val": {20: 0.5, 40: 0.4}})
    machine_dir = tmp_path / ".trainguard" / "baselines" / machine_id()
    assert (first.parent, first.name) == (machine_dir, "0001_nogit.json")  # not in a git repository
    assert second.name == "0002_nogit.json"
    data = json.loads(second.read_text())
    assert data["format_version"] == FORMAT_VERSION and data["trainguard_version"]
    assert data["request"] == {"steps": 40, "seed": 3, "world_size": 1, "args": [], "env": {}}
    assert data["job"]["file_sha256"] == hashlib.sha256(job_file.path.read_bytes()).hexdigest()
    assert data["machine_info"]["id"] == machine_id() and data["created_at"].endswith("+00:00")
    assert data["trajectories"]["val"] == [[20, 0.5], [40, 0.4]]
    loaded = load_baseline(second)
    assert loaded.trajectories["loss"] == pytest.approx(_curve())
    assert sorted(p.name for p in machine_dir.iterdir()) == ["0001_nogit.json", "0002_nogit.json"]  # no temp files


def test_the_file_name_carries_the_commit_and_marks_uncommitted_changes(tmp_path: Path) -> None:
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(tmp_path), *args], check=True, capture_output=True,
                              text=True, env={**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t",
                                              "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"}).stdout

    path = _job_file(tmp_path)
    git("init", "-q")
    git("add", "trainguard.yaml")
    git("commit", "-q", "-m", "job")
    commit = git("rev-parse", "HEAD").strip()
    job_file = load_config(path)
    clean = save_baseline(job_file, _request(), {"loss": _curve()})
    assert clean.name == f"0001_{commit[:12]}.json"
    assert load_baseline(clean).commit == commit and load_baseline(clean).dirty is False
    path.write_text(JOB + "# an edit\n")
    dirty = save_baseline(job_file, _request(), {"loss": _curve()})
    assert dirty.name == f"0002_{commit[:12]}_dirty.json" and load_baseline(dirty).dirty is True


def test_concurrent_savers_never_overwrite_each_other(tmp_path: Path) -> None:
    job_file = load_config(_job_file(tmp_path))
    paths: list[Path] = []
    lock = threading.Lock()

    def saver(i: int) -> None:
        path = save_baseline(job_file, _request(seed=i), {"loss": _curve()})
        with lock:
            paths.append(path)

    threads = [threading.Thread(target=saver, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(p.name for p in paths) == [f"{n:04d}_nogit.json" for n in range(1, 9)]
    assert sorted(load_baseline(p).request.seed for p in paths) == list(range(8))


def test_a_saver_that_lost_the_race_for_a_number_takes_the_next(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    job_file = load_config(_job_file(tmp_path))
    first = save_baseline(job_file, _request(), {"loss": _curve()})
    before = first.read_bytes()
    monkeypatch.setattr(bl, "baseline_files", lambda directory: [])  # it believes 0001 is free
    second = save_baseline(job_file, _request(seed=1), {"loss": _curve()})
    assert second.name == "0002_nogit.json" and first.read_bytes() == before


def test_unreadable_or_foreign_files_are_refused_with_the_fix(tmp_path: Path) -> None:
    job_file = load_config(_job_file(tmp_path))
    path = save_baseline(job_file, _request(), {"loss": _curve()})
    data = json.loads(path.read_text())
    newer = tmp_path / "v2.json"
    newer.write_text(json.dumps({**data, "format_version": FORMAT_VERSION + 1}))
    with pytest.raises(BaselineError, match=r"has baseline format version 3; trainguard .* reads version 2"):
        load_baseline(newer)
    older = tmp_path / "v1.json"  # issue 42: saved before baselines were keyed to their job file
    older.write_text(json.dumps({**data, "format_version": 1}))
    with pytest.raises(BaselineError, match=r"format version 1; .* Save a new baseline .*--save-baseline.*version 1 "
                       "files were not keyed to their job file"):
        load_baseline(older)
    (tmp_path / "torn.json").write_text('{"format_version": 1, "kind"')
    with pytest.raises(BaselineError, match="not a readable baseline file"):
        load_baseline(tmp_path / "torn.json")
    (tmp_path / "other.json").write_text("{}")
    with pytest.raises(BaselineError, match="not a trainguard canary baseline"):
        load_baseline(tmp_path / "other.json")
    with pytest.raises(BaselineError, match="no such baseline file"):
        load_baseline(tmp_path / "missing.json")


def test_latest_is_the_newest_baseline_saved_for_the_same_request(tmp_path: Path) -> None:
    job_file = load_config(_job_file(tmp_path))
    request = StoredRequest.of(_request())
    assert find_baseline(job_file, "latest", request) is None  # none saved: not an error
    first = save_baseline(job_file, _request(), {"loss": _curve()})
    second = save_baseline(job_file, _request(), {"loss": _curve(scale=1.1)})
    save_baseline(job_file, _request(steps=60), {"loss": _curve(60)})  # another request: skipped
    found = find_baseline(job_file, "latest", request)
    assert found is not None and found.path == second
    explicit = find_baseline(job_file, os.path.relpath(first, tmp_path), request)  # relative to the job file
    assert explicit is not None and explicit.path == first


def test_a_baseline_of_another_request_is_refused_naming_the_difference(tmp_path: Path) -> None:
    job_file = load_config(_job_file(tmp_path))
    path = save_baseline(job_file, _request(steps=60, args=("--lr", "0.1")), {"loss": _curve(60)})
    request = StoredRequest.of(_request())
    with pytest.raises(BaselineError) as latest:
        find_baseline(job_file, "latest", request)
    message = str(latest.value)
    assert "no baseline of this machine" in message
    assert "steps 60 (this run: 40)" in message and "args '--lr 0.1' (this run: '')" in message
    assert "trainguard check" in message and "--only canary --save-baseline" in message
    with pytest.raises(BaselineError, match=r"was saved for a different run: steps 60 \(this run: 40\)"):
        find_baseline(job_file, str(path), request)


def _tampered(good: dict, **changes: object) -> str:
    """``good`` (a saved baseline) with top-level keys, or its loss points (``loss=``), changed."""
    if "loss" in changes:
        changes = {**changes, "trajectories": {**good["trajectories"], "loss": changes.pop("loss")}}
    return json.dumps({**good, **changes})


def test_baseline_values_are_checked_on_read_and_each_bad_key_is_named(tmp_path: Path) -> None:
    """issue 42: a baseline whose loss is NaN, Infinity, empty or on other steps put a slower job
    "inside the baseline band"; huge integers and non-objects raised tracebacks."""
    job_file = load_config(_job_file(tmp_path))
    good = json.loads(save_baseline(job_file, _request(), {"loss": _curve()}).read_text())
    points = good["trajectories"]["loss"]
    cases = {
        "nan": (_tampered(good, loss=[[1, math.nan], *points[1:]]), r"trajectories.loss \(its values\)\[0\] is nan"),
        "infinity": (_tampered(good, loss=[*points[:-1], [40, math.inf]]), r"\(its values\)\[39\] is inf"),
        "1e308": (_tampered(good, loss=[[1, 1e308], *points[1:]]), r"\[0\] is 1e\+308: each must be a finite"),
        "huge integer": (_tampered(good, loss=[[1, 10**400], *points[1:]]), "is a 401-digit number"),
        "empty": (_tampered(good, loss=[]), r"trajectories.loss \(its steps\) must be a non-empty list"),
        "no loss": (_tampered(good, trajectories={"val": points}), "trajectories holds no `loss`"),
        "other steps": (_tampered(good, loss=[[s + 1000, v] for s, v in points]),
                        r"holds step 1001 after step -1: steps rise from 0 to the run's 40 steps"),
        "huge step": (_tampered(good, loss=[[10**400, 1.0]]), "holds step a 401-digit number"),
        "not pairs": (_tampered(good, loss=[1, 2]), "trajectories.loss must be a list of .step, value. pairs"),
        "trajectories a list": (_tampered(good, trajectories=[]), "trajectories must be an object"),
        "request a list": (_tampered(good, request=[40]), "request must be an object"),
        "huge steps": (_tampered(good, request={**good["request"], "steps": 10**400}), "request.steps must be a whole number"),
        "seed Infinity": (_tampered(good, request={**good["request"], "seed": math.inf}), "request.seed must be a whole number"),
        "commit_info a list": (_tampered(good, commit_info=[]), "commit_info must be an object"),
        "job a string": (_tampered(good, job="x"), "job must be an object"),
        "no job key": (json.dumps({k: v for k, v in good.items() if k != "job_key"}), "job_key is missing"),
    }
    each_refused(tmp_path, cases, load_baseline, BaselineError, "save a new baseline")


def test_a_baseline_is_used_only_by_the_job_it_was_saved_for(tmp_path: Path) -> None:
    """issue 42: baselines were matched on steps, seed, world size and args only, so a job file
    took the baseline of another job file beside it."""
    saved_for = load_config(_job_file(tmp_path))
    (tmp_path / "other.yaml").write_text(JOB.replace("toy.py", "other.py"))
    other = load_config(tmp_path / "other.yaml")
    request = StoredRequest.of(_request())
    path = save_baseline(saved_for, _request(), {"loss": _curve(scale=0.5)})
    assert find_baseline(other, "latest", request) is None  # another job file's: none of this one
    with pytest.raises(BaselineError, match=r"saved for a different run: job file 'trainguard.yaml' \(this run: 'other.yaml'\)"):
        find_baseline(other, str(path), request)
    found = find_baseline(saved_for, "latest", request)  # the job it was saved for still uses it
    assert found is not None and found.path == path and found.job == JobKey.of(saved_for)
    _job_file(tmp_path, JOB.replace("--seed {seed}", "--seed {seed} --fast"))  # its command changed
    with pytest.raises(BaselineError, match=r"job.command 'python toy.py --steps {steps} --seed {seed}' "
                       r"\(this run: 'python toy.py --steps {steps} --seed {seed} --fast'\)"):
        find_baseline(load_config(tmp_path / "trainguard.yaml"), "latest", request)


def test_a_band_compares_the_same_steps_only() -> None:
    run = _curve(10)
    assert bl.steps_differ("loss", run, dict(run), "baseline b.json") is None
    few = bl.steps_differ("loss", run, {s: v for s, v in run.items() if s <= 3}, "baseline b.json")
    assert few == ("baseline b.json holds loss at 3 step(s) (1-3), this run printed it at 10 step(s) (1-10): a band "
                   "compares the same steps of the same run")


def test_the_canary_options_are_validated() -> None:
    base = JOB.replace("canary: {steps: 40, min_loss_drop: 0.3}", "canary: {steps: 40, baseline_tolerance: 0}")
    with pytest.raises(ConfigError, match=r"checks\.canary\.baseline_tolerance: expected a value > 0"):
        parse_config(base)
    spec = parse_config(JOB).checks.canary
    assert spec is not None and (spec.baseline, spec.baseline_tolerance) == ("latest", 0.2)


# --------------------------------------------------------------------------------------------
# band maths
# --------------------------------------------------------------------------------------------


def test_smoothing_window_is_odd_and_grows_with_the_run() -> None:
    assert [smoothing_window(n) for n in (2, 4, 5, 30, 50, 60, 200)] == [1, 1, 5, 5, 5, 7, 21]


def test_rolling_median_is_centred_and_shrinks_at_the_ends() -> None:
    values = {1: 1.0, 2: 9.0, 3: 2.0, 4: 3.0, 5: 4.0}
    assert rolling_median(values, 3) == {1: 5.0, 2: 2.0, 3: 3.0, 4: 3.0, 5: 3.5}
    assert rolling_median(values, 1) == values


def test_the_band_is_the_smoothed_baseline_plus_minus_the_tolerance() -> None:
    band = build_band("loss", {s: 2.0 for s in range(1, 11)}, 0.2)
    assert band.window == 5 and band.bounds(3) == pytest.approx((1.6, 2.4))


def test_the_same_trajectory_and_isolated_outliers_stay_inside() -> None:
    base = _curve()
    band = build_band("loss", base, 0.2)
    assert compare_to_band(base, band).ok
    noisy = dict(base)
    noisy[10] *= 5  # one exploded batch
    noisy[25] *= 0.1
    noisy[26] *= 0.1  # two unlucky ones in a row
    verdict = compare_to_band(noisy, band)
    assert verdict.ok and verdict.failing == [], verdict.excursions


def test_a_run_that_learns_worse_leaves_the_band_and_says_where_and_by_how_much() -> None:
    base = _curve()
    worse = {s: v * (1.0 if s < 15 else 1.4) for s, v in base.items()}
    verdict = compare_to_band(worse, build_band("loss", base, 0.2))
    assert not verdict.ok
    (excursion,) = verdict.failing
    assert (excursion.first_step, excursion.last_step, excursion.side) == (15, 40, "above")
    assert excursion.worst_deviation == pytest.approx(0.4)
    problem = verdict.problem() or ""
    assert problem.startswith("loss left the baseline band at steps 15-40 (26 of 40 points outside): up to 40% above")
    assert "band ±20%, rolling median of 5 point(s), fails from 3 consecutive" in problem


def test_a_run_below_the_band_is_reported_too() -> None:
    base = _curve()
    better = {s: v * (0.5 if 20 <= s <= 30 else 1.0) for s, v in base.items()}
    (excursion,) = compare_to_band(better, build_band("loss", base, 0.2)).failing
    assert excursion.side == "below" and 20 <= excursion.first_step <= 22 and 28 <= excursion.last_step <= 30


def test_a_sparse_metric_is_not_smoothed_and_one_point_can_fail() -> None:
    band = build_band("val_loss", {20: 0.64, 30: 0.54}, 0.2)
    assert band.window == 1
    verdict = compare_to_band({20: 0.87, 30: 0.60}, band)
    assert [(e.first_step, e.points) for e in verdict.failing] == [(20, 1)]
    assert compare_to_band({20: 0.70, 30: 0.55}, band).ok


def test_steps_the_run_lacks_are_listed_not_compared() -> None:
    base = _curve(10)
    verdict = compare_to_band({s: v for s, v in base.items() if s <= 8}, build_band("loss", base, 0.2))
    assert verdict.ok and verdict.missing_steps == [9, 10] and len(verdict.compared_steps) == 8


def test_the_plot_is_a_png(tmp_path: Path) -> None:
    base = _curve()
    verdicts = [compare_to_band({s: v * 1.3 for s, v in base.items()}, build_band("loss", base, 0.2)),
                compare_to_band({20: 0.9, 40: 0.5}, build_band("val_loss", {20: 0.6, 40: 0.5}, 0.2))]
    path = bl.plot_bands(tmp_path / "band.png", verdicts, title="test")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000


# --------------------------------------------------------------------------------------------
# the canary on the toy job
# --------------------------------------------------------------------------------------------


def _toy(tmp_path: Path, decay: float = 0.05) -> Path:
    """The toy job as toy.py next to the job file; ``decay`` < 0.05 learns more slowly."""
    text = TOY.read_text()
    old = "math.exp(-0.05 * step)"
    assert text.count(old) == 1, "the toy's loss curve changed; update this test"
    (tmp_path / "toy.py").write_text(text.replace(old, f"math.exp(-{decay} * step)"))
    return _job_file(tmp_path)


def test_save_then_pass_inside_the_band_then_fail_a_slower_learner(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    job = _toy(tmp_path)
    report = tmp_path / "report.json"
    none = check(job, only=["canary"], report_json=str(report)).checks[0]
    assert none.status == "passed" and "no baseline saved for this machine (save one: trainguard check " in none.summary
    assert report_evidence(none)["baseline"]["status"] == "none"

    monkeypatch.setenv("TRAINGUARD_SAVE_BASELINE", "1")  # the setting, as pytest items get it
    saved = check(job, only=["canary"], report_json=str(report)).checks[0]
    monkeypatch.delenv("TRAINGUARD_SAVE_BASELINE")
    assert saved.status == "passed" and "saved as the baseline " in saved.summary, saved.summary
    path = Path(report_evidence(saved)["baseline"]["path"])
    assert path.name == "0001_nogit.json" and load_baseline(path).request.steps == 40
    assert Path(report_evidence(saved)["plots"][0]).is_file()

    same = check(job, only=["canary"], report_json=str(report)).checks[0]
    assert same.status == "passed", same.summary
    assert "inside the baseline band of 0001_nogit.json (±20%: loss off by at most 0%)" in same.summary
    assert report_evidence(same)["baseline"]["metrics"]["loss"]["max_deviation"] == 0
    assert Path(report_evidence(same)["plots"][0]).name == "baseline_band.png"

    _toy(tmp_path, decay=0.03)  # still learns (the plain canary passes), but more slowly
    slower = check(job, only=["canary"], report_json=str(report)).checks[0]
    assert slower.status == "failed"
    assert report_evidence(slower)["loss"]["drop"] > 0.3  # the min_loss_drop test alone would pass it
    assert slower.summary.startswith("loss left the baseline band at steps "), slower.summary
    assert "% above the baseline at step " in slower.summary
    plot = Path(report_evidence(slower)["plots"][0])
    assert f"; plot: {plot}" in slower.summary and plot.read_bytes()[:4] == b"\x89PNG"


def test_a_mismatched_baseline_is_a_canary_error_with_the_fix(tmp_path: Path) -> None:
    job = _toy(tmp_path)
    check(job, only=["canary"], report_json=str(tmp_path / "r.json"), save_baseline=True)
    result = check(job, only=["canary"], seed=7, report_json=str(tmp_path / "r.json")).checks[0]
    assert result.status == "error"  # the band was not compared: not a pass, nor the job's failure
    assert result.summary.startswith("baseline refused: no baseline of this machine")
    assert "seed 0 (this run: 7)" in result.summary
    off = job.read_text().replace("min_loss_drop: 0.3}", "min_loss_drop: 0.3, baseline: 'off'}")
    job.write_text(off)
    result = check(job, only=["canary"], seed=7, report_json=str(tmp_path / "r.json")).checks[0]
    assert result.status == "passed" and report_evidence(result)["baseline"] == {"status": "off"}


@pytest.mark.parametrize("tamper", ["nan", "other steps", "fewer steps"])
def test_a_baseline_it_cannot_trust_is_a_canary_error_never_inside_the_band(tmp_path: Path, tamper: str) -> None:
    """issue 42: a slower learner passed "inside the baseline band" of a baseline whose loss was
    NaN, or on steps the run never printed; now the canary is an error saying why."""
    job = _toy(tmp_path)
    saved = check(job, only=["canary"], report_json=str(tmp_path / "r.json"), save_baseline=True).checks[0]
    path = Path(report_evidence(saved)["baseline"]["path"])
    data = json.loads(path.read_text())
    points = data["trajectories"]["loss"]
    # "other steps": step 0 alone, a step of the run's range the run never printed
    data["trajectories"]["loss"] = {"nan": [[s, math.nan] for s, _ in points], "other steps": [[0, 1.0]],
                                    "fewer steps": points[:3]}[tamper]
    path.write_text(json.dumps(data))
    _toy(tmp_path, decay=0.03)  # learns more slowly: outside a band it could be compared with
    result = check(job, only=["canary"], report_json=str(tmp_path / "r.json")).checks[0]
    assert result.status == "error", result.summary
    assert result.summary.startswith("baseline refused: ") and "inside the baseline band" not in result.summary
    assert report_evidence(result)["baseline"]["status"] == "refused"
    assert "save a new baseline" in result.summary


def test_a_failing_canary_is_not_saved(tmp_path: Path) -> None:
    job = _toy(tmp_path, decay=0.001)  # does not learn
    result = check(job, only=["canary"], report_json=str(tmp_path / "r.json"), save_baseline=True).checks[0]
    assert result.status == "failed" and result.summary.endswith("; baseline not saved (the canary failed)")
    assert not (tmp_path / ".trainguard" / "baselines").exists()


def test_save_baseline_without_the_canary_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    job = _toy(tmp_path)
    assert cli_main(["check", str(job), "--only", "smoke", "--save-baseline"]) == 2
    err = capsys.readouterr().err
    assert "--save-baseline saves the canary's trajectory, but the canary is not run (--only smoke leaves it out)" in err
    with pytest.raises(ConfigError, match=r"the job file has no checks\.canary"):
        check(_job_file(tmp_path, JOB.replace("  canary: {steps: 40, min_loss_drop: 0.3}\n", "")),
              save_baseline=True)


@pytest.fixture
def private_fallback(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """The fallback directory a failed save writes to, inside the test's own (not /tmp)."""
    import tempfile

    from trainguard._internal.atomic import fallback_dir

    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    fallback_dir.cache_clear()
    yield tmp_path / "tmp"
    fallback_dir.cache_clear()


def test_a_baseline_that_cannot_be_written_fails_the_save_with_the_fix(
    tmp_path: Path, private_fallback: Path
) -> None:
    job = _toy(tmp_path)
    (tmp_path / ".trainguard").mkdir()
    (tmp_path / ".trainguard" / "baselines").write_text("a file where the directory should be")
    result = check(job, only=["canary"], report_json=str(tmp_path / "r.json"), save_baseline=True).checks[0]
    assert result.status == "failed"
    assert result.summary.startswith(f"could not save the baseline in {tmp_path / '.trainguard' / 'baselines'}")
    assert report_evidence(result)["baseline"]["status"] == "not_saved"


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a read-only tmpfs needs root")
def test_a_baseline_on_a_read_only_disk_is_saved_aside_and_said(tmp_path: Path, private_fallback: Path) -> None:
    """issue 13, item 9: the trajectory a --save-baseline run computed is never lost."""
    job = _toy(tmp_path)
    baselines = tmp_path / ".trainguard" / "baselines"
    baselines.mkdir(parents=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(baselines)],
                             capture_output=True, timeout=30, check=False)
    if mounted.returncode != 0:
        pytest.skip("cannot mount a tmpfs here")
    try:
        result = check(job, only=["canary"], report_json=str(tmp_path / "r.json"), save_baseline=True).checks[0]
    finally:
        subprocess.run(["umount", "-l", str(baselines)], capture_output=True, timeout=30, check=False)
    where = bl.baselines_dir(tmp_path / ".trainguard")
    assert result.status == "failed"
    assert result.summary.startswith(
        f"could not save the baseline in {where}: Read-only file system (EROFS); it was saved to ")
    aside = Path(report_evidence(result)["baseline"]["saved_aside"])
    assert f"it was saved to {aside} instead: copy that file into {where} to use it" in result.summary
    assert load_baseline(aside).request.steps == 40 and aside.is_relative_to(private_fallback)


def test_a_baseline_file_is_read_within_the_read_limits_and_a_fifo_is_not_waited_on(tmp_path: Path) -> None:


    from trainguard._internal.readers import ReadLimits, active_limits, use_limits

    big = tmp_path / "0001_big.json"
    big.write_text('{"kind": "trainguard-canary-baseline", "pad": "' + "x" * 4096 + '"}')
    fifo = tmp_path / "0002_fifo.json"
    os.mkfifo(fifo)
    before = active_limits()
    use_limits(ReadLimits(max_bytes=1024))
    try:
        with pytest.raises(BaselineError, match="not a readable baseline file") as over:
            load_baseline(big)
        assert "limit" in str(over.value)
        with pytest.raises(BaselineError, match="not a readable baseline file"):
            load_baseline(fifo)  # a FIFO with no writer: refused, not waited on
    finally:
        use_limits(before)


def _band_verdict() -> BandEvidence:
    values = {1: 1.0, 2: 0.9, 3: 0.8}
    return compare_to_band(values, build_band("loss", values, 0.1)).as_evidence()


@pytest.mark.parametrize(("evidence", "keys"), [
    (bl.BaselineEvidence("none", machine_id="m", directory="/d", how_to_save="trainguard check --save-baseline"),
     ["status", "machine_id", "directory", "how_to_save"]),
    (bl.BaselineEvidence("saved", path="/d/0001.json", machine_id="m", metrics=["loss"], tolerance=0.1,
                         plot_error="ValueError: x"),
     ["status", "path", "machine_id", "metrics", "tolerance", "plot_error"]),
    (bl.BaselineEvidence("compared", path="/d/0001.json", commit=None, dirty=None, created_at="2026-01-01",
                         job_file_changed=False, metrics={"loss": _band_verdict()}, not_compared={"val": "why"}),
     ["status", "path", "commit", "dirty", "created_at", "job_file_changed", "metrics", "not_compared"]),
    (bl.BaselineEvidence("not_saved", reason="disk full", saved_aside="/tmp/a.json"), ["status", "reason", "saved_aside"]),
    (bl.BaselineEvidence("refused", reason="other steps", path="/d/0001.json"), ["status", "reason", "path"]),
])
def test_the_baseline_step_is_a_record_written_key_for_key_as_before_and_read_back(
        evidence: bl.BaselineEvidence, keys: list[str]) -> None:
    data = evidence.to_dict()
    assert list(data) == keys  # the report's keys, in the order the dicts before the record wrote them
    assert bl.BaselineEvidence.from_dict(json.loads(json.dumps(data))) == evidence
