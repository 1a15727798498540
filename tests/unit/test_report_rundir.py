"""The report contract, atomic writes, run directories and the GPU inventory."""

from __future__ import annotations

import importlib.machinery
import json
import os
import re
import stat
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

import numpy as np
import pytest

from trainguard._internal.atomic import atomic_write_bytes, atomic_write_text
from trainguard._internal.machine import gpu_inventory
from trainguard._version import __version__
from trainguard.errors import CheckFailed
from trainguard.evidence import Recorded
from trainguard.launch.rundir import ensure_state_dir, new_run_dir, prune_runs
from trainguard.report import REPORT_SCHEMA_VERSION, CheckResult, Report, load_report

REPORT_KEYS = {
    "tracking_uri",
    "interrupted",
    "trainguard_version",
    "schema_version",
    "job",
    "job_file",
    "status",
    "checks",
    "created_at",
    "host",
}
CHECK_KEYS = {"name", "status", "summary", "evidence", "duration_s", "reproduce"}


def result(status: str, name: str = "smoke") -> CheckResult:
    return CheckResult(name=name, status=status, summary=f"{name} {status}")  # type: ignore[arg-type]


# --------------------------------------------------------------------------------------------
# Report contract
# --------------------------------------------------------------------------------------------


def test_report_json_has_the_contract_keys() -> None:
    report = Report(job="mlp", job_file="trainguard.yaml")
    report.add(
        CheckResult(
            name="smoke",
            status="passed",
            summary="5 steps in 1.2 s",
            evidence=Recorded({"steps": 5}),
            duration_s=1.25,
            reproduce="trainguard check --only smoke",
        )
    )
    data = json.loads(report.to_json())
    assert set(data) == REPORT_KEYS
    assert data["trainguard_version"] == __version__
    assert data["schema_version"] == REPORT_SCHEMA_VERSION == 1
    assert data["job"] == "mlp"
    assert data["status"] == "passed"
    assert data["checks"] == [
        {
            "name": "smoke",
            "status": "passed",
            "summary": "5 steps in 1.2 s",
            "evidence": {"steps": 5},
            "duration_s": 1.25,
            "reproduce": "trainguard check --only smoke",
        }
    ]
    assert set(data["checks"][0]) == CHECK_KEYS


@pytest.mark.parametrize(
    ("statuses", "expected"),
    [
        ((), "passed"),
        (("passed",), "passed"),
        (("skipped",), "skipped"),  # nothing was tested: not passed (issue 24)
        (("skipped", "skipped"), "skipped"),
        (("passed", "skipped", "passed"), "passed"),
        (("failed",), "failed"),
        (("error",), "failed"),
        (("passed", "skipped", "failed"), "failed"),
        (("skipped", "error", "passed"), "failed"),
    ],
)
def test_report_status(statuses: tuple[str, ...], expected: str) -> None:
    report = Report(job="mlp", checks=[result(s, f"c{i}") for i, s in enumerate(statuses)])
    assert report.status == expected
    assert report.to_dict()["status"] == expected


@pytest.mark.parametrize(
    ("status", "ok"), [("passed", True), ("skipped", True), ("failed", False), ("error", False)]
)
def test_check_result_ok(status: str, ok: bool) -> None:
    assert result(status).ok is ok


@pytest.mark.parametrize("status", ["ok", "PASSED", "fail", ""])
def test_check_result_rejects_unknown_status(status: str) -> None:
    with pytest.raises(ValueError, match="status must be one of"):
        result(status)


def test_evidence_with_paths_numpy_and_tuples_serializes() -> None:
    import torch

    report = Report(job="mlp")
    report.add(
        CheckResult(
            name="determinism",
            status="failed",
            summary="diverged at step 3",
            evidence=Recorded({
                "dir": Path("/tmp/run"),
                "max_diff": np.float32(0.5),
                "steps": np.int64(3),
                "loss": torch.tensor(1.5),
                "shape": (2, 3),
                "ranks": {1},
                "other": object(),
            }),
        )
    )
    evidence = json.loads(report.to_json())["checks"][0]["evidence"]
    assert evidence["dir"] == "/tmp/run"
    assert evidence["max_diff"] == 0.5
    assert evidence["steps"] == 3
    assert evidence["loss"] == 1.5
    assert evidence["shape"] == [2, 3]
    assert evidence["ranks"] == [1]
    assert evidence["other"].startswith("<object object")


def test_write_then_load_round_trips(tmp_path: Path) -> None:
    report = Report(job="mlp", job_file="/p/trainguard.yaml", created_at=1700000000.123456)
    report.add(CheckResult("smoke", "passed", "ok", Recorded({"steps": 5, "losses": [2.5, 2.25]}), 0.5))
    report.add(
        CheckResult(
            "resume", "failed", "diverged", Recorded({"step": 26}), 3.0, "trainguard check --only resume"
        )
    )
    path = report.write(tmp_path / "sub" / "report.json")

    assert path == tmp_path / "sub" / "report.json"
    assert path.read_text(encoding="utf-8") == report.to_json()
    loaded = load_report(path)
    assert loaded == report
    assert loaded.status == "failed"
    assert loaded.checks[1].reproduce == "trainguard check --only resume"
    assert loaded.to_json() == report.to_json()


def test_write_replaces_previous_report(tmp_path: Path) -> None:
    path = tmp_path / "report.json"
    Report(job="first").write(path)
    Report(job="second").write(path)
    assert json.loads(path.read_text())["job"] == "second"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.json"]


# --------------------------------------------------------------------------------------------
# Atomic writes
# --------------------------------------------------------------------------------------------


def test_failed_rename_leaves_old_content_and_no_temp_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "report.json"
    Report(job="old").write(path)
    old = path.read_bytes()

    def refuse(src: str, dst: str) -> None:
        assert Path(src).parent == tmp_path  # the temp file lives next to the target
        assert Path(src).read_bytes() != old  # and already holds the new content
        raise OSError("disk on fire")

    monkeypatch.setattr(os, "replace", refuse)
    with pytest.raises(OSError, match="disk on fire"):
        Report(job="new").write(path)
    monkeypatch.undo()

    assert path.read_bytes() == old
    assert [p.name for p in tmp_path.iterdir()] == ["report.json"]


def test_failed_fsync_leaves_old_content_and_no_temp_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "data.txt"
    atomic_write_text(path, "old")

    def fail(fd: int) -> None:
        raise OSError("I/O error")

    monkeypatch.setattr(os, "fsync", fail)
    with pytest.raises(OSError, match="I/O error"):
        atomic_write_text(path, "new")
    monkeypatch.undo()

    assert path.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["data.txt"]


def test_interrupt_during_write_removes_temp_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "data.bin"

    def interrupt(src: str, dst: str) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "replace", interrupt)
    with pytest.raises(KeyboardInterrupt):
        atomic_write_bytes(path, b"x")
    assert list(tmp_path.iterdir()) == []


def test_atomic_write_creates_parent_directories(tmp_path: Path) -> None:
    path = atomic_write_bytes(tmp_path / "a" / "b" / "c.bin", b"\x00\x01")
    assert path.read_bytes() == b"\x00\x01"


@pytest.mark.skipif(not hasattr(os, "fchmod"), reason="POSIX file modes")
def test_atomic_write_gives_a_new_file_the_mode_open_would(tmp_path: Path) -> None:
    # mkstemp's 0o600 would lock out a CI uploader or another user reading reports/checkpoints
    (tmp_path / "plain.txt").write_text("x")
    expected = stat.S_IMODE((tmp_path / "plain.txt").stat().st_mode)
    path = atomic_write_text(tmp_path / "report.json", "{}")
    assert stat.S_IMODE(path.stat().st_mode) == expected


@pytest.mark.skipif(not hasattr(os, "fchmod"), reason="POSIX file modes")
def test_atomic_write_keeps_the_mode_of_the_file_it_replaces(tmp_path: Path) -> None:
    path = tmp_path / "report.json"
    path.write_text("old")
    path.chmod(0o640)
    atomic_write_text(path, "new")
    assert path.read_text() == "new"
    assert stat.S_IMODE(path.stat().st_mode) == 0o640


def test_atomic_write_to_a_directory_path_fails_cleanly(tmp_path: Path) -> None:
    target = tmp_path / "taken"
    target.mkdir()
    with pytest.raises(OSError):
        atomic_write_text(target, "x")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["taken"]


# --------------------------------------------------------------------------------------------
# Run directories
# --------------------------------------------------------------------------------------------


def test_new_run_dir_layout_and_gitignore(tmp_path: Path) -> None:
    state = tmp_path / "proj" / ".trainguard"
    run = new_run_dir(state, "mlp", "smoke")

    assert run.is_dir() and [p.name for p in run.iterdir()] == [".owner"]
    assert (run / ".owner").read_text() == str(os.getpid())
    assert run.parent == state / "runs"
    assert re.fullmatch(r"\d{8}-\d{6}-mlp-+smoke", run.name), run.name
    ignore = state / ".gitignore"
    assert ignore.is_file()
    assert "*" in ignore.read_text().splitlines()


def test_gitignore_is_not_overwritten(tmp_path: Path) -> None:
    state = tmp_path / ".trainguard"
    state.mkdir()
    (state / ".gitignore").write_text("*\n!keep.txt\n")
    ensure_state_dir(state)
    assert (state / ".gitignore").read_text() == "*\n!keep.txt\n"


def test_unsafe_job_names_are_slugged(tmp_path: Path) -> None:
    run = new_run_dir(tmp_path / ".trainguard", "../my job/x", "a b:c")
    assert run.parent == tmp_path / ".trainguard" / "runs"
    assert "/" not in run.name and " " not in run.name and ":" not in run.name
    assert "my" in run.name and "job" in run.name and "a-b-c" in run.name


def test_run_dirs_are_unique_under_concurrency(tmp_path: Path) -> None:
    state = tmp_path / ".trainguard"
    threads_n, per_thread = 16, 8
    barrier = threading.Barrier(threads_n)
    made: list[Path] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def worker() -> None:
        try:
            barrier.wait()
            for _ in range(per_thread):
                run = new_run_dir(state, "mlp", "smoke", keep=1000)
                with lock:
                    made.append(run)
        except BaseException as exc:  # reported below, in the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(threads_n)]
    try:
        for t in threads:
            t.start()
    finally:
        for t in threads:
            t.join(timeout=60)
    assert not errors
    assert len(made) == threads_n * per_thread
    assert len(set(made)) == len(made)
    assert all(p.is_dir() for p in made)
    assert (state / ".gitignore").is_file()


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def _make_runs(state: Path, job: str, n: int, start: float, *, finished: bool = True) -> list[Path]:
    """n run directories of ``job`` with increasing mtimes (oldest first); ``finished``: their
    creating process is gone (as after an earlier session), so they may be pruned."""
    made = []
    dead = _dead_pid()
    for i in range(n):
        path = new_run_dir(state, job, f"check{i}", keep=1000)
        if finished:
            (path / ".owner").write_text(str(dead))
        os.utime(path, (start + i, start + i))
        made.append(path)
    return made


def test_prune_keeps_run_dirs_of_a_live_process(tmp_path: Path) -> None:
    # a reference run shared between checks of this session, or another xdist worker's run
    live = _make_runs(tmp_path, "mlp", 3, time.time() - 100, finished=False)
    assert prune_runs(tmp_path / "runs", "mlp", keep=1) == []
    assert all(p.is_dir() for p in live)


def test_prune_keeps_the_newest_n_of_that_job_only(tmp_path: Path) -> None:
    state = tmp_path / ".trainguard"
    runs = state / "runs"
    start = time.time() - 1000
    mine = _make_runs(state, "mlp", 5, start)
    other = _make_runs(state, "cnn", 4, start - 500)
    longer = _make_runs(state, "mlp-large", 3, start - 500)  # starts like "mlp": another job
    stray = runs / "notes"
    stray.mkdir()

    deleted = prune_runs(runs, "mlp", keep=2)

    assert sorted(deleted) == sorted(mine[:3])
    assert sorted(p for p in runs.iterdir()) == sorted([*mine[3:], *other, *longer, stray])


def test_prune_never_deletes_the_protected_dir(tmp_path: Path) -> None:
    mine = _make_runs(tmp_path, "mlp", 3, time.time() - 100)
    deleted = prune_runs(tmp_path / "runs", "mlp", keep=1, protect=mine[0])
    assert deleted == [mine[1]]
    assert mine[0].is_dir() and mine[2].is_dir()


def test_new_run_dir_prunes_old_runs_of_the_same_job(tmp_path: Path) -> None:
    state = tmp_path / ".trainguard"
    old = _make_runs(state, "mlp", 3, time.time() - 1000)
    other = new_run_dir(state, "mlp-large", "smoke", keep=1)
    run = new_run_dir(state, "mlp", "smoke", keep=2)
    assert sorted(p for p in (state / "runs").iterdir()) == sorted([old[2], other, run])


def test_run_dirs_of_jobs_sharing_a_prefix_are_kept_apart(tmp_path: Path) -> None:
    state = tmp_path / ".trainguard"
    big = _make_runs(state, "mlp-large", 3, time.time() - 100)
    small = _make_runs(state, "mlp", 3, time.time() - 50)
    newest = new_run_dir(state, "mlp", "c3", keep=1)
    assert all(p.is_dir() for p in big)
    assert [p for p in [*small, newest] if p.is_dir()] == [newest]


# --------------------------------------------------------------------------------------------
# GPU inventory
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("visible", ["", "-1", " ", "-1,-1"])
def test_cuda_visible_devices_hiding_everything(
    monkeypatch: pytest.MonkeyPatch, visible: str
) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    inventory = gpu_inventory()
    assert inventory.count == 0
    assert f"CUDA_VISIBLE_DEVICES={visible!r} hides every device" == inventory.how


def _fake_torch(count: int) -> types.ModuleType:
    torch = types.ModuleType("torch")
    torch.cuda = types.SimpleNamespace(device_count=lambda: count)  # type: ignore[attr-defined]
    return torch


def test_torch_count_is_limited_by_cuda_visible_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch", _fake_torch(4))  # torch imported: asked directly
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,2")
    inventory = gpu_inventory()
    assert inventory.count == 2
    assert "torch.cuda.device_count()" in inventory.how
    assert "limited by CUDA_VISIBLE_DEVICES='0,2'" in inventory.how

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert gpu_inventory().count == 4


def _fake_pynvml(count: int | None) -> types.ModuleType:
    nvml = types.ModuleType("pynvml")
    nvml.__spec__ = importlib.machinery.ModuleSpec("pynvml", None)

    class NVMLError(Exception):
        pass

    def init() -> None:
        if count is None:
            raise NVMLError("Driver Not Loaded")

    nvml.NVMLError = NVMLError  # type: ignore[attr-defined]
    nvml.nvmlInit = init  # type: ignore[attr-defined]
    nvml.nvmlDeviceGetCount = lambda: count  # type: ignore[attr-defined]
    nvml.nvmlShutdown = lambda: None  # type: ignore[attr-defined]
    return nvml


def test_nvml_counts_without_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(sys.modules, "torch", raising=False)
    monkeypatch.setitem(sys.modules, "pynvml", _fake_pynvml(3))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert gpu_inventory().count == 3
    assert gpu_inventory().how == "NVML"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    assert gpu_inventory().count == 1
    assert "torch" not in sys.modules


def test_nvml_unavailable_counts_zero(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(sys.modules, "torch", raising=False)
    monkeypatch.setitem(sys.modules, "pynvml", _fake_pynvml(None))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    inventory = gpu_inventory()
    assert inventory.count == 0
    assert "NVML unavailable (Driver Not Loaded)" in inventory.how


@pytest.mark.skipif(not sys.platform.startswith("linux") or Path("/dev/nvidia0").exists()
                    or Path("/dev/kfd").exists(), reason="needs a Linux machine without a GPU driver")
def test_no_gpu_driver_counts_zero_without_importing_torch() -> None:
    # the gate probes the machine before its timed profile: importing torch to hear "0" took 2.3 s
    code = ("import sys; sys.modules['pynvml'] = None\n"
            "from trainguard._internal.machine import gpu_inventory\n"
            "i = gpu_inventory(); print(i.count, 'torch' in sys.modules, i.how)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True).stdout
    assert out.startswith("0 False no GPU driver"), out


def test_raise_for_failures_names_every_check_that_did_not_pass_and_passes_a_clean_report() -> None:
    report = Report(job="toy")
    report.add(CheckResult("smoke", "passed", "ok"))
    report.add(CheckResult("canary", "skipped", "no baseline"))
    report.raise_for_failures()  # passed and skipped: nothing raised
    report.checks[0].raise_for_status()
    failed = report.add(CheckResult("resume", "failed", "step 26 differs", reproduce="trainguard check --only resume"))
    report.add(CheckResult("drill:kill", "error", "the fault came too late"))
    with pytest.raises(CheckFailed, match=r"2 of 4 check\(s\) of toy did not pass") as failure:
        report.raise_for_failures()
    assert "resume failed: step 26 differs" in str(failure.value)
    assert "reproduce: trainguard check --only resume" in str(failure.value)
    assert [r.name for r in failure.value.results] == ["resume", "drill:kill"]
    with pytest.raises(CheckFailed, match="resume failed"):
        failed.raise_for_status()


def test_a_check_id_names_a_plain_check_or_a_drill_and_writes_the_report_name() -> None:
    from trainguard.report import CheckId

    drill = CheckId.parse("drill:kill_rank1")
    assert drill.is_drill and drill.check == "drill" and drill.drill == "kill_rank1"
    assert str(drill) == "drill:kill_rank1" and drill == CheckId.of_drill("kill_rank1")
    smoke = CheckId.parse("smoke")
    assert not smoke.is_drill and smoke.drill is None and str(smoke) == "smoke"
    assert CheckId.parse(drill) is drill
    # a drill named with a colon keeps it; the report name round-trips
    assert str(CheckId.parse("drill:a:b")) == "drill:a:b" and CheckId.parse("drill:a:b").drill == "a:b"
    assert CheckResult("drill:kill", "passed", "ok").check_id == CheckId.of_drill("kill")
    assert not CheckResult("profile", "passed", "ok").check_id.is_drill
