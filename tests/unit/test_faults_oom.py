"""The oom fault on real rank processes: a real kernel OOM kill in a memory cgroup, a real
RLIMIT_AS allocator failure, an injected torch.OutOfMemoryError the job does or does not handle,
and the cgroup facts the fault is built on (EBUSY below usage, charges stay behind).

Every test proves its teardown: no cgroup, no process left.
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import load_fault_harness, report_evidence
from trainguard.config.fault_params import FaultParams
from trainguard.faults.base import FaultContext, FaultUnavailable
from trainguard.faults.cgroups import MemoryCgroups
from trainguard.faults.oom import OomFault

harness = load_fault_harness()


def _cgroups_usable() -> bool:
    try:
        MemoryCgroups(1)
    except FaultUnavailable:
        return False
    return True


needs_cgroups = pytest.mark.skipif(not _cgroups_usable(), reason="needs root and a memory cgroup")


@needs_cgroups
def test_cgroup_mode_gets_the_rank_killed_by_the_kernel_oom_killer(tmp_path: Path) -> None:
    fault = OomFault(FaultParams({"mode": "cgroup", "headroom_mb": 24}), rank=1, after_step=2)

    def during(f: OomFault, ctx: FaultContext) -> dict[str, object]:
        assert f.cgroups is not None
        return {"parent": f.cgroups.parent}

    drive = harness.drive(fault, tmp_path, "oom_job.py", lambda ctx: ["--steps", "12"],
                          world_size=2, during=during)
    result = drive.result
    assert result.outcome == "failed", result.reason
    rank1 = result.exits[1]
    assert rank1.signal == "SIGKILL" and not rank1.killed_by_trainguard, result.exits
    assert drive.classification.startswith("killed by the kernel OOM killer"), drive.classification
    counters = report_evidence(drive)["cgroup_counters"]
    assert counters["oom_kill"] >= 1 and counters["failcnt"] >= 1, counters
    assert report_evidence(drive)["mode_ran"] == "cgroup" and "problems" not in report_evidence(drive)
    assert report_evidence(drive)["hook_fired"]
    # the limit was set just above the usage at injection: the rank never got much past it
    assert counters["peak_mb"] <= report_evidence(drive)["limit_mb"] + 1
    assert max(p.step for p in result.points if p.rank == 1) < 12
    assert not Path(drive.during["parent"]).exists()
    harness.assert_nothing_left(drive.tag)


@needs_cgroups
def test_auto_mode_picks_cgroup_as_root(tmp_path: Path) -> None:
    fault = OomFault(rank=0, after_step=1)
    ctx = FaultContext(work_dir=tmp_path, checkpoint_dir=tmp_path / "ckpt", world_size=2)
    fault.setup(ctx)
    try:
        assert fault.mode_ran == "cgroup" and fault.cgroups is not None
        assert fault.cgroups.path(0).is_dir() and fault.cgroups.path(1).is_dir()
    finally:
        fault.teardown()
    assert not fault.cgroups.parent.exists()
    fault.teardown()  # idempotent


def test_rlimit_mode_gives_the_allocator_runtime_error(tmp_path: Path) -> None:
    fault = OomFault(FaultParams({"mode": "rlimit", "headroom_mb": 32}), rank=0, after_step=2)
    drive = harness.drive(
        fault, tmp_path, "oom_job.py",
        lambda ctx: ["--torch", "--leak-mb", "8", "--steps", "10", "--sleep", "0.3"],
    )
    stderr = drive.result.log_path(0).read_text()
    assert "DefaultCPUAllocator: can't allocate memory" in stderr, stderr[-2000:]
    assert drive.result.exits[0].returncode == 1
    assert drive.classification.startswith("allocator error"), drive.classification
    assert report_evidence(drive)["mode_ran"] == "rlimit" and report_evidence(drive)["limit_mb"] > 0
    harness.assert_nothing_left(drive.tag)


def test_raise_mode_unhandled_ends_the_job_with_torch_oom(tmp_path: Path) -> None:
    fault = OomFault(FaultParams({"mode": "raise"}), rank=0, after_step=2)
    drive = harness.drive(fault, tmp_path, "oom_job.py", lambda ctx: ["--torch", "--steps", "8"])
    stderr = drive.result.log_path(0).read_text()
    assert "torch.OutOfMemoryError: trainguard fault drill" in stderr, stderr[-2000:]
    assert "oom_job.py" in stderr  # raised inside the job's own loop: its traceback shows it
    assert drive.result.outcome == "failed"
    assert drive.classification == "torch.OutOfMemoryError raised (not handled by the job)"
    assert max(p.step for p in drive.result.points) in (2, 3)
    harness.assert_nothing_left(drive.tag)


def test_raise_mode_handled_by_the_job(tmp_path: Path) -> None:
    fault = OomFault(FaultParams({"mode": "raise"}), rank=0, after_step=2)
    drive = harness.drive(fault, tmp_path, "oom_job.py",
                          lambda ctx: ["--torch", "--catch", "--steps", "6"])
    assert drive.result.ok, drive.result.reason
    assert "caught OutOfMemoryError" in drive.result.log_path(0).read_text()
    assert drive.classification.startswith("handled by the job"), drive.classification
    # one batch skipped, the rest ran
    assert len({p.step for p in drive.result.points}) == 5
    harness.assert_nothing_left(drive.tag)


def test_without_root_auto_falls_back_to_rlimit_and_cgroup_mode_says_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    ctx = FaultContext(work_dir=tmp_path, checkpoint_dir=tmp_path / "ckpt", world_size=1)
    fault = OomFault()
    fault.setup(ctx)
    try:
        assert fault.mode_ran == "rlimit" and fault.cgroups is None
        assert "need root" in fault.evidence().fallback
        assert json.loads(fault.launch_env(ctx)["TRAINGUARD_FAULT_HOOK"])["mode"] == "rlimit"
    finally:
        fault.teardown()
    with pytest.raises(FaultUnavailable, match="need root"):
        OomFault(FaultParams({"mode": "cgroup"})).setup(ctx)


def test_gpu_mode_is_unavailable_without_a_gpu(tmp_path: Path) -> None:
    if Path("/dev/nvidia0").exists():
        pytest.skip("this machine has a GPU")
    fault = OomFault(FaultParams({"mode": "gpu"}))
    with pytest.raises(FaultUnavailable, match="needs an NVIDIA GPU"):
        fault.setup(FaultContext(work_dir=tmp_path, checkpoint_dir=tmp_path, world_size=1))
    fault.teardown()


def test_validate_names_the_bad_parameters() -> None:
    problems = dict(OomFault.validate(FaultParams({"mode": "swap", "headroom_mb": -1, "size": 3})))
    assert set(problems) == {"mode", "headroom_mb", "size"}
    assert "cgroup" in problems["mode"] and "positive" in problems["headroom_mb"]
    assert OomFault.validate(FaultParams({"mode": "raise", "headroom_mb": 16})) == []


# -- the cgroup facts the fault relies on ------------------------------------------------------

_HOLDER = (
    "import sys, time\n"
    "hold = b'x' * (40 << 20)\n"
    "print('ready', flush=True)\n"
    "time.sleep(30)\n"
)


@needs_cgroups
def test_v1_refuses_a_limit_below_usage_and_charges_follow_exec(tmp_path: Path) -> None:
    cgroups = MemoryCgroups(2)
    cgroups.create()
    procs: list[subprocess.Popen[str]] = []
    try:
        # joined before exec: the 40 MB are charged to rank0's cgroup
        inside = subprocess.Popen([sys.executable, "-c", _HOLDER], stdout=subprocess.PIPE,
                                  text=True, preexec_fn=lambda: cgroups.join(0))
        # joined after allocating: the charges stay where they were made
        late = subprocess.Popen([sys.executable, "-c", _HOLDER], stdout=subprocess.PIPE, text=True)
        procs += [inside, late]
        for proc in procs:
            assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        (cgroups.path(1) / "cgroup.procs").write_text(str(late.pid))
        time.sleep(0.1)
        usage0 = cgroups.counters(0).usage_bytes or 0
        usage1 = cgroups.counters(1).usage_bytes or 0
        assert usage0 > 40 << 20
        assert usage1 < 8 << 20, f"moved process charged {usage1 >> 20} MB to its new cgroup"
        if cgroups.version == 1:
            with pytest.raises(OSError) as info:
                cgroups._set_limit(0, str(usage0 // 2))
            assert info.value.errno == errno.EBUSY
        limit = cgroups.set_limit_above_usage(0, 16 << 20)
        assert cgroups.counters(0).limit_bytes == pytest.approx(limit, abs=1 << 16)
        assert inside.poll() is None  # a limit above usage kills nothing
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
        problems = cgroups.teardown()
    assert problems == [] and not cgroups.parent.exists()


@needs_cgroups
def test_teardown_moves_stragglers_out(tmp_path: Path) -> None:
    cgroups = MemoryCgroups(1)
    cgroups.create()
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"],
                            preexec_fn=lambda: cgroups.join(0))
    try:
        time.sleep(0.2)
        assert cgroups.pids(0) == [proc.pid]
        assert cgroups.teardown() == []
        assert not cgroups.parent.exists()
        assert proc.poll() is None  # moved out, not killed
        own = Path(f"/proc/{proc.pid}/cgroup").read_text()
        assert "trainguard-" not in own
    finally:
        proc.kill()
        proc.wait()
    assert os.getpid() not in cgroups.pids(0)
