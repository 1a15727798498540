"""trainguard's own writes never lose a computed result (issue 13, items 9 and 10).

Real file systems, not mocks: a size-limited tmpfs fills up for real (ENOSPC) and a tmpfs mounted
read-only refuses for real (EROFS). Every mount is undone in ``finally``. The CLI runs as users
run it, in a subprocess, with its temp directory (the fallback) inside the test's own.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers import report_evidence
from trainguard._internal.atomic import fallback_dir, unwritable_reason, write_or_fallback
from trainguard.launch import Launcher, LaunchSpec
from trainguard.launch.ranklog import RankLog

JOBS = Path(__file__).resolve().parents[1] / "data" / "jobs"
_SCRIPT = Path(sys.executable).parent / "trainguard"
TRAINGUARD = [str(_SCRIPT)] if _SCRIPT.exists() else [sys.executable, "-m", "trainguard.cli"]
ENOSPC = "No space left on device (ENOSPC)"
EROFS = "Read-only file system (EROFS)"
LOSS = r"step (?P<step>\d+) loss (?P<value>\S+)"

needs_root = pytest.mark.skipif(
    not hasattr(os, "geteuid") or os.geteuid() != 0, reason="mounting a tmpfs needs root"
)


@contextlib.contextmanager
def tmpfs(point: Path, *, size: str = "64k", read_only: bool = False, fill: bool = False) -> Iterator[Path]:
    """A real tmpfs of ``size`` at ``point`` (filled to the last byte, or read-only), unmounted
    on the way out whatever happens."""
    point.mkdir(parents=True, exist_ok=True)
    options = f"size={size}" + (",ro" if read_only else "")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(point)],
                          capture_output=True, text=True, timeout=30, check=False)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        if fill:
            with contextlib.suppress(OSError), open(point / "fill", "wb") as handle:
                while True:
                    handle.write(b"\0" * 4096)
                    handle.flush()
        yield point
    finally:
        subprocess.run(["umount", "-l", str(point)], capture_output=True, timeout=30, check=False)


def run_cli(*args: str | Path, cwd: Path, tmp: Path, timeout: float = 120,
            tracking: str = "off", **extra: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TRAINGUARD_", "MLFLOW_"))}
    env.update({"TRAINGUARD_TRACKING": tracking, "TMPDIR": str(tmp), **extra})
    tmp.mkdir(parents=True, exist_ok=True)
    return subprocess.run([*TRAINGUARD, *map(str, args)], cwd=cwd, env=env, stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=timeout, check=False)


@pytest.fixture(autouse=True)
def private_fallback(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """This process's fallback directory inside the test's own (never the machine's /tmp)."""
    import tempfile

    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    fallback_dir.cache_clear()
    yield tmp_path / "tmp"
    fallback_dir.cache_clear()


@pytest.fixture
def jobs(tmp_path: Path) -> Path:
    """A private copy of the toy jobs (their checkpoints in the run directory, the default)."""
    return Path(shutil.copytree(JOBS, tmp_path / "jobs", ignore=shutil.ignore_patterns(".trainguard")))


def fallback_reports(tmp: Path) -> list[Path]:
    return sorted(tmp.glob("trainguard-*/unwritten-*/**/*report.json"))


# -- the one error path ----------------------------------------------------------------------


@needs_root
@pytest.mark.parametrize(("read_only", "errno_words"), [(False, ENOSPC), (True, EROFS)])
def test_a_failing_write_says_the_path_and_errno_and_falls_back(
    tmp_path: Path, read_only: bool, errno_words: str
) -> None:
    said: list[str] = []
    with tmpfs(tmp_path / "disk", read_only=read_only, fill=not read_only) as disk:
        target = disk / "report.json"
        written = write_or_fallback(target, "x" * 10_000, what="the report", say=said.append)
        assert not target.exists()
    assert written.fell_back and written.path is not None and written.path.read_text() == "x" * 10_000
    assert written.path.is_relative_to(tmp_path / "tmp")
    assert said == [written.problem]
    assert f"cannot write the report to {target}: {errno_words}; wrote it to {written.path} instead" == said[0]


def test_the_fallback_never_follows_a_planted_link(tmp_path: Path, private_fallback: Path) -> None:
    """A shared /tmp: another user's link at trainguard-<uid> must not receive root's reports."""
    (tmp_path / "elsewhere").mkdir()
    (private_fallback / f"trainguard-{os.getuid()}").symlink_to(tmp_path / "elsewhere")
    here = fallback_dir()
    try:
        assert here is not None and not here.is_relative_to(private_fallback)
        assert list((tmp_path / "elsewhere").iterdir()) == []
    finally:
        if here is not None:
            shutil.rmtree(here, ignore_errors=True)
            with contextlib.suppress(OSError):
                here.parent.rmdir()  # the trainguard-<uid> this test made there, when empty


def test_a_write_that_works_is_not_moved(tmp_path: Path) -> None:
    written = write_or_fallback(tmp_path / "a" / "r.json", b"{}", what="the report", say=None)
    assert written.path == tmp_path / "a" / "r.json" and written.problem is None


@pytest.mark.parametrize(
    ("path", "needle"),
    [("DIR", "is a directory; name a file in it"), ("/proc/x/report.json", "cannot create a file in /proc"),
     ("/dev/null/report.json", "/dev/null is not a directory")],
)
def test_an_unwritable_target_is_named_before_anything_runs(tmp_path: Path, path: str, needle: str) -> None:
    reason = unwritable_reason(tmp_path if path == "DIR" else path)
    assert reason is not None and needle in reason
    assert unwritable_reason(tmp_path / "new" / "dir" / "report.json") is None
    assert [p.name for p in tmp_path.iterdir()] == ["tmp"]  # the probe left nothing behind


# -- trainguard check: the report ------------------------------------------------------------


@needs_root
def test_check_with_a_full_report_disk_keeps_the_verdict_and_the_report(jobs: Path, tmp_path: Path) -> None:
    """The reproducer: the checks print PASSED, then (before) exit 1 with a traceback and no
    report. Now: exit 0, the path and ENOSPC said, the report in the fallback, its path printed."""
    with tmpfs(tmp_path / "full", fill=True) as full:
        done = run_cli("check", "toy.trainguard.yaml", "--only", "smoke", "--report-json",
                       full / "report.json", cwd=jobs, tmp=tmp_path / "tmp")
    assert "Traceback" not in done.stdout + done.stderr
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"cannot write the report to {full / 'report.json'}: {ENOSPC}" in done.stderr
    [aside] = fallback_reports(tmp_path / "tmp")
    assert done.stdout.splitlines()[-1] == f"PASSED: 1 check(s); report: {aside}"
    report = json.loads(aside.read_text())
    assert report["status"] == "passed" and [c["name"] for c in report["checks"]] == ["smoke"]


@needs_root
def test_check_with_a_read_only_state_dir_runs_and_says_where_everything_went(jobs: Path, tmp_path: Path) -> None:
    with tmpfs(jobs / ".trainguard", read_only=True):
        done = run_cli("check", "toy.trainguard.yaml", "--only", "smoke", cwd=jobs, tmp=tmp_path / "tmp")
    assert "Traceback" not in done.stdout + done.stderr
    assert done.returncode == 0, done.stdout + done.stderr
    state = jobs / ".trainguard"
    assert f"cannot create a run directory under {state}: {EROFS}; run directories go to" in done.stderr
    assert f"cannot write the report to {state / 'report.json'}: {EROFS}" in done.stderr
    [aside] = fallback_reports(tmp_path / "tmp")
    assert json.loads(aside.read_text())["checks"][0]["evidence"]["run_dir"].startswith(str(tmp_path / "tmp"))


@pytest.mark.slow  # a real drill (3-4 s); the report path it takes is check()'s, tested above
@needs_root
def test_drill_with_a_read_only_state_dir_keeps_its_report(jobs: Path, tmp_path: Path) -> None:
    """The default drills report is no usage error when .trainguard/ is read-only: it falls back."""
    job = jobs / "toy.trainguard.yaml"
    job.write_text(job.read_text() + "  drills:\n    - {name: kill1, fault: kill_rank, rank: 1, after_step: 2}\n")
    with tmpfs(jobs / ".trainguard", read_only=True):
        done = run_cli("drill", job.name, cwd=jobs, tmp=tmp_path / "tmp")
    assert done.returncode in (0, 1) and "Traceback" not in done.stderr, done.stdout + done.stderr
    assert f"cannot write the report to {jobs / '.trainguard' / 'drills-report.json'}: {EROFS}" in done.stderr
    [aside] = fallback_reports(tmp_path / "tmp")
    assert aside.name == "drills-report.json" and done.stdout.splitlines()[-1].endswith(f"report: {aside}")
    assert [c["name"] for c in json.loads(aside.read_text())["checks"]] == ["drill:kill1"]


@pytest.mark.parametrize("where", ["a directory", "/proc/x/report.json"])
def test_a_bad_report_json_is_a_usage_error_before_any_check_runs(jobs: Path, tmp_path: Path, where: str) -> None:
    target = str(tmp_path) if where == "a directory" else where
    started = time.monotonic()
    done = run_cli("check", "toy.trainguard.yaml", "--report-json", target, cwd=jobs, tmp=tmp_path / "tmp")
    assert done.returncode == 2, done.stdout + done.stderr
    assert "Traceback" not in done.stderr
    assert done.stderr.startswith(f"trainguard: error: --report-json: cannot write the report to {target}")
    assert not (jobs / ".trainguard" / "runs").exists()  # nothing ran
    assert time.monotonic() - started < 30


# -- the MLflow store --------------------------------------------------------------------------


@needs_root
@pytest.mark.parametrize(("read_only", "errno_words"), [(False, ENOSPC), (True, EROFS)])
def test_tracking_to_a_store_on_a_full_or_read_only_disk_stops_with_one_warning(
    tmp_path: Path, read_only: bool, errno_words: str
) -> None:
    pytest.importorskip("mlflow")
    from trainguard.tracking import Tracker

    warnings: list[str] = []
    with tmpfs(tmp_path / "store", size="256k", read_only=read_only) as store:
        uri = f"sqlite:///{store / 'mlflow.db'}"
        tracker = Tracker(uri, artifact_location=(store / "art").as_uri(), warn=warnings.append)
        try:
            run = tracker.start_run("session", params={"job": "toy"})
            for step in range(200):  # the schema alone nearly fills 256k: these cannot fit
                tracker.log_metrics(run, [(f"m{k}", 1.0, step, 0) for k in range(50)])
            deadline = time.monotonic() + 60
            while tracker.unwritable is None and time.monotonic() < deadline:
                time.sleep(0.1)
            tracker.log_metrics(run, [("late", 1.0, 0, 0)])  # dropped, not kept in memory
        finally:
            started = time.monotonic()
            result = tracker.close()
            closing_s = time.monotonic() - started
    assert tracker.unwritable == errno_words
    assert closing_s < 5  # no retries until the flush bound
    [warning] = warnings
    assert warning.startswith(f"trainguard tracking: the MLflow store {uri} cannot be written: {errno_words}")
    assert "TRAINGUARD_TRACKING=off" in warning and result.unwritten


def test_tracking_to_a_store_under_a_non_utf8_directory_stops_at_once_saying_why(tmp_path: Path) -> None:
    """A directory whose name is not UTF-8 (made by another system): the store's URI cannot name
    it. Retried as a passing failure, it stalled the end of a check by 70 s (issue 24, item 6)."""
    pytest.importorskip("mlflow")
    from trainguard.tracking import Tracker

    store = Path(os.fsdecode(os.fsencode(tmp_path) + b"/job\xff"))
    store.mkdir()
    uri = f"sqlite:///{store / 'mlflow.db'}"
    warnings: list[str] = []
    tracker = Tracker(uri, warn=warnings.append)
    try:
        run = tracker.start_run("session", params={"job": "toy"})
        tracker.log_metrics(run, [("loss", 1.0, 1, 0)])
        deadline = time.monotonic() + 60
        while tracker.unwritable is None and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        started = time.monotonic()
        result = tracker.close()
        closing_s = time.monotonic() - started
    assert tracker.unwritable is not None and "is not UTF-8" in tracker.unwritable
    assert closing_s < 5 and result.unwritten  # no retries until the flush bound
    [warning] = warnings
    assert "MLFLOW_TRACKING_URI" in warning and "TRAINGUARD_TRACKING=off" in warning


# -- the run directory (item 10) ---------------------------------------------------------------


def _spec(run_dir: Path, code: str, **kw: object) -> LaunchSpec:
    return LaunchSpec(argv=[sys.executable, "-c", code], run_dir=run_dir, world_size=1,
                      metric_regexes={"loss": LOSS}, stall_timeout=8, timeout=60, **kw)  # type: ignore[arg-type]


_CHATTY = ("for i in range(1, 401):\n    print(f'step {i} loss {1 / i}', flush=True)\n"
           "    print('x' * 1000, flush=True)\n")


@needs_root
def test_a_full_run_dir_disk_keeps_the_output_drained_and_says_so(tmp_path: Path) -> None:
    """The reproducer: 400 kB of output into a 64 kB run directory. Before, the output thread
    died on ENOSPC, the rank blocked on its pipe and the verdict read "no new metric line for
    8 s" with 64 of 400 steps. Now every step is parsed and the evidence names the disk."""
    with tmpfs(tmp_path / "disk") as disk:
        started = time.monotonic()
        result = Launcher(_spec(disk / "run", _CHATTY)).run()
        took = time.monotonic() - started
    assert result.outcome == "ok", result.reason
    assert sorted(result.trajectory()) == list(range(1, 401))
    assert took < 8  # never waited into the stall limit
    disk_evidence = report_evidence(result)["run_dir_disk"]
    assert disk_evidence["path"] == str(disk / "run") and disk_evidence["error"] == ENOSPC
    [log] = disk_evidence["logs_not_written"]
    assert log["path"].endswith("rank0.stdout.log") and log["lost_bytes"] > 0


@needs_root
def test_a_rank_that_dies_of_the_full_disk_gets_a_reason_naming_it(tmp_path: Path) -> None:
    code = ("import os, sys\nprint('step 1 loss 1.0', flush=True)\n"
            "open(os.path.join(os.environ['TRAINGUARD_RUN_DIR'], 'ckpt'), 'wb').write(b'0' * 10**6)\n")
    with tmpfs(tmp_path / "disk") as disk:
        result = Launcher(_spec(disk / "run", code)).run()
    assert result.outcome == "failed"
    assert result.reason.startswith("rank 0 exited with code 1; the run directory ")
    assert f"{disk / 'run'} is on a full or failing disk ({ENOSPC})" in result.reason


def test_a_rank_that_prints_tens_of_megabytes_gets_a_capped_log_and_every_metric(tmp_path: Path) -> None:
    code = ("import sys\nline = 'y' * 1023 + '\\n'\nfor i in range(1, 32001):\n"
            "    sys.stdout.write(line)\n"
            "    if i % 100 == 0: sys.stdout.write(f'step {i // 100} loss {1 / i}\\n')\n"
            "print('the end', flush=True)\n")
    started = time.monotonic()
    result = Launcher(_spec(tmp_path / "run", code, log_limit_mb=1.0)).run()
    took = time.monotonic() - started
    assert result.outcome == "ok", result.reason
    assert sorted(result.trajectory()) == list(range(1, 321))  # parsing saw every line
    log = result.log_path(0, "stdout")
    data = log.read_bytes()
    [capped] = report_evidence(result)["logs_truncated"]
    assert capped["path"] == str(log) and capped["bytes"] > 32_000_000
    assert data.startswith(b"y" * 1023 + b"\n") and data.endswith(b"step 320 loss 3.125e-05\nthe end\n")
    assert f"[trainguard: {capped['dropped_bytes']} bytes of this log dropped here".encode() in data
    start = data.index(b"\n[trainguard:")
    end = data.index(b")]\n", start) + 3
    kept = len(data) - (end - start)
    assert 2**20 - 1100 < kept <= 2**20  # the first half MB, the last half MB from a line start
    assert capped["dropped_bytes"] == capped["bytes"] - kept  # every byte accounted for
    assert sorted(p.name for p in log.parent.iterdir()) == [
        "rank0.stderr.log", "rank0.stdout.log"]  # the tail segments were joined and removed
    assert took < 60


def test_a_rank_log_without_a_cap_keeps_everything(tmp_path: Path) -> None:
    log = RankLog(tmp_path / "r.log", None)
    for _ in range(1000):
        log.write(b"z" * 99 + b"\n")
    log.close()
    assert (tmp_path / "r.log").stat().st_size == 100_000 and not log.truncated
    assert log.summary() == {"path": str(tmp_path / "r.log"), "bytes": 100_000}


_FILLING_JOB = """\
job:
  name: fill
  command: "python fill.py {steps}"
  metrics:
    loss: 'step (?P<step>\\d+) loss (?P<value>\\S+)'
  timeout: 60
checks:
  smoke: {steps: 5}
"""
_FILL = """\
import os, sys
try:  # the job fills its run directory's disk and goes on
    with open(os.path.join(os.environ["TRAINGUARD_RUN_DIR"], "blob"), "wb") as f:
        f.write(b"0" * (4 << 20))
except OSError:
    pass
for step in range(1, int(sys.argv[1]) + 1):
    print("x" * 2000)
    print(f"step {step} loss {1 / step}", flush=True)
"""


@needs_root
def test_a_check_that_passes_on_a_full_run_dir_disk_says_so_in_its_verdict(tmp_path: Path) -> None:
    (tmp_path / "fill.py").write_text(_FILL)
    (tmp_path / "fill.trainguard.yaml").write_text(_FILLING_JOB)
    with tmpfs(tmp_path / ".trainguard", size="1m"):
        done = run_cli("check", "fill.trainguard.yaml", cwd=tmp_path, tmp=tmp_path / "tmp")
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stdout + done.stderr
    first = done.stdout.splitlines()[0]
    assert first.startswith("PASSED  smoke: 5 steps in ") and "; the run directory " in first
    assert f"is on a full or failing disk ({ENOSPC}): 1 rank log(s) could not be written" in first
    [aside] = fallback_reports(tmp_path / "tmp")
    [disk] = json.loads(aside.read_text())["checks"][0]["evidence"]["run_dir_disk"]
    assert disk["error"] == ENOSPC and disk["path"].startswith(str(tmp_path / ".trainguard" / "runs"))


def test_a_capped_log_is_in_the_checks_evidence(tmp_path: Path) -> None:
    (tmp_path / "fill.py").write_text(_FILL)
    (tmp_path / "fill.trainguard.yaml").write_text(_FILLING_JOB)
    done = run_cli("check", "fill.trainguard.yaml", "--report-json", tmp_path / "r.json", cwd=tmp_path,
                   tmp=tmp_path / "tmp", TRAINGUARD_RANK_LOG_MB="0.004")  # 4 KiB a log
    assert done.returncode == 0, done.stdout + done.stderr
    [run] = json.loads((tmp_path / "r.json").read_text())["checks"][0]["evidence"]["logs_truncated"]
    [log] = run["logs"]
    assert log["path"].endswith("rank0.stdout.log") and log["dropped_bytes"] > 4000
    assert Path(log["path"]).stat().st_size < 4300


# -- the gate's reports and pytest's report ------------------------------------------------------


@needs_root
def test_the_gate_reports_on_a_read_only_disk_go_to_the_fallback(tmp_path: Path) -> None:

    from trainguard.config.gate import GatePolicy
    from trainguard.gate.policy import Capabilities, Decision
    from trainguard.gate.provenance import provenance_for
    from trainguard.gate.run import GateReport, write_gate_report
    from trainguard.report import CheckResult, Report

    job = JOBS / "toy.trainguard.yaml"
    report = Report(job="toy", checks=[CheckResult("smoke", "passed", "5 steps")])
    gate = GateReport(job="toy", job_file=str(job), decision=Decision("promote"), report=report,
                      provenance=provenance_for(job), capabilities=Capabilities(gpus=0, root=True, ray=False),
                      policy=GatePolicy.model_validate({}))
    with tmpfs(tmp_path / "gate", read_only=True) as out:
        paths = write_gate_report(gate, out)
    for key in ("json", "json_stamped", "markdown", "html"):
        assert paths[key].startswith(str(tmp_path / "tmp")) and Path(paths[key]).is_file(), key
    assert json.loads(Path(paths["json"]).read_text())["verdict"] == "promote"


def test_pytest_refuses_an_unwritable_report_json_before_any_test(tmp_path: Path) -> None:
    (tmp_path / "test_one.py").write_text("def test_one():\n    pass\n")
    done = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q",
                           "--trainguard-report-json", "/proc/x/report.json", "test_one.py"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 4, done.stdout + done.stderr  # pytest's usage error
    assert "--trainguard-report-json: cannot write the report to /proc/x/report.json" in done.stderr
    assert "1 passed" not in done.stdout and "Traceback" not in done.stderr


@needs_root
def test_track_init_on_a_full_store_disk_leaves_the_training_untracked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("mlflow")
    from trainguard.tracking import track

    for name in ("TRAINGUARD_MLFLOW_RUN_ID", "MLFLOW_RUN_ID", "RANK"):
        monkeypatch.delenv(name, raising=False)
    with tmpfs(tmp_path / "store", fill=True) as store:
        uri = f"sqlite:///{store / 'mlflow.db'}"
        assert track.init("train", tracking_uri=uri) is None
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"trainguard tracking: the MLflow store {uri} cannot be written: {ENOSPC}; this run is not tracked")


@needs_root
def test_pytest_keeps_its_report_when_the_report_disk_is_full(tmp_path: Path) -> None:
    (tmp_path / "test_one.py").write_text("def test_one():\n    pass\n")
    (tmp_path / "tmp").mkdir(exist_ok=True)
    env = {**os.environ, "TMPDIR": str(tmp_path / "tmp"), "TRAINGUARD_TRACKING": "off"}
    with tmpfs(tmp_path / "full", fill=True) as full:
        done = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q",
                               "--trainguard-report-json", str(full / "r.json"), "test_one.py"],
                              cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0 and "Traceback" not in done.stdout + done.stderr, done.stdout + done.stderr
    [aside] = sorted((tmp_path / "tmp").glob("trainguard-*/unwritten-*/full/r.json"))
    assert f"report: {aside} (cannot write the report to {full / 'r.json'}: {ENOSPC}; wrote it to {aside} instead)" \
        in done.stdout
    assert json.loads(aside.read_text())["job"] == "pytest-session"
