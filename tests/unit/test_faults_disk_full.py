"""The disk_full fault on real rank processes: a job that overwrites its checkpoint in place
ends with a corrupt latest checkpoint, a job that writes temp + fsync + rename keeps the previous
one intact -- in hook mode (deterministic) and on a real, size-limited tmpfs kept full.

Every test proves its teardown: no mount, no process left (``/proc/mounts`` is read).
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.helpers import load_fault_harness
from trainguard.faults import FaultContext, FaultUnavailable
from trainguard.faults.disk_full import DiskFullFault, Filler, is_mounted, mount_tmpfs, unmount

harness = load_fault_harness()
root_only = pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")


def latest_step(ckpt_dir: Path) -> int | str:
    """The step of the bytes-format latest checkpoint, or why it is not usable."""
    path = ckpt_dir / "latest.ckpt"
    if not path.exists():
        return "missing"
    raw = path.read_bytes()
    header, _, data = raw.partition(b"\n")
    try:
        meta = json.loads(header)
    except ValueError:
        return f"corrupt ({len(raw)} bytes, no header)"
    if len(data) != meta["size"] or hashlib.sha256(data).hexdigest() != meta["sha256"]:
        return f"corrupt (step {meta['step']}: {len(data)} of {meta['size']} bytes)"
    return int(meta["step"])


def _args(writer: str, *extra: str) -> object:
    return lambda ctx: ["--ckpt-dir", str(ctx.checkpoint_dir), "--writer", writer, *extra]


# -- hook mode: deterministic ----------------------------------------------------------------


def test_hook_mode_in_place_overwrite_leaves_a_corrupt_checkpoint(tmp_path: Path) -> None:
    fault = DiskFullFault({"mode": "hook"}, rank=0, after_step=2)
    drive = harness.drive(fault, tmp_path, "ckpt_job.py", _args("inplace"))
    assert drive.result.outcome == "failed"
    assert latest_step(drive.ctx.checkpoint_dir) == "corrupt (0 bytes, no header)"
    assert drive.classification.startswith("ENOSPC: OSError errno 28"), drive.classification
    assert drive.evidence["mode_ran"] == "hook" and drive.evidence["enospc_writes"] >= 1
    assert max(p.step for p in drive.result.points) == 2
    harness.assert_nothing_left(drive.tag)


def test_hook_mode_atomic_writer_keeps_the_previous_checkpoint(tmp_path: Path) -> None:
    fault = DiskFullFault({"mode": "hook"}, rank=0, after_step=2)
    drive = harness.drive(fault, tmp_path, "ckpt_job.py", _args("atomic"))
    assert drive.result.outcome == "failed"  # it still cannot go on: it says so and exits
    assert latest_step(drive.ctx.checkpoint_dir) == 2
    assert drive.classification.startswith("ENOSPC: OSError errno 28"), drive.classification
    harness.assert_nothing_left(drive.tag)


def test_hook_mode_clean_run_without_the_fault_is_untouched(tmp_path: Path) -> None:
    """The hook armed but never triggered changes nothing (the fault is not injected)."""
    fault = DiskFullFault({"mode": "hook"}, rank=0, after_step=99)
    drive = harness.drive(fault, tmp_path, "ckpt_job.py", _args("inplace", "--steps", "3"))
    assert drive.result.ok, drive.result.reason
    assert latest_step(drive.ctx.checkpoint_dir) == 3
    assert drive.classification.startswith("handled by the job")


def _torch_load_step(path: Path) -> int | str:
    import torch

    try:
        return int(torch.load(path, weights_only=True)["step"])
    except Exception as exc:
        return f"unloadable ({type(exc).__name__}: {str(exc)[:80]})"


def _torch_drive(tmp_path: Path, writer: str) -> int | str:
    """torch.save to a path writes through C++: the hook makes it raise torch's RuntimeError."""
    fault = DiskFullFault({"mode": "hook"}, rank=0, after_step=2)
    drive = harness.drive(fault, tmp_path, "ckpt_job.py",
                          _args(writer, "--format", "torch", "--sleep", "0.4"))
    stderr = drive.result.log_path(0).read_text()
    assert "RuntimeError" in stderr and "No space left on device" in stderr, stderr[-1500:]
    assert drive.classification.startswith("ENOSPC: torch.save raised RuntimeError")
    harness.assert_nothing_left(drive.tag)
    return _torch_load_step(drive.ctx.checkpoint_dir / "latest.ckpt")


def test_hook_mode_torch_save_in_place_leaves_an_unloadable_checkpoint(tmp_path: Path) -> None:
    assert str(_torch_drive(tmp_path, "inplace")).startswith("unloadable")


@pytest.mark.slow
def test_hook_mode_torch_save_atomic_keeps_the_previous_checkpoint(tmp_path: Path) -> None:
    assert _torch_drive(tmp_path, "atomic") == 2


# -- tmpfs mode: a real full filesystem --------------------------------------------------------


@root_only
def test_tmpfs_mode_in_place_vs_atomic(tmp_path: Path) -> None:
    drives = {}
    for writer in ("inplace", "atomic"):
        fault = DiskFullFault({"mode": "tmpfs", "size_mb": 4}, rank=0, after_step=2)

        def during(f: DiskFullFault, ctx: FaultContext) -> dict[str, object]:
            return {"mounted": f.mount_point is not None and is_mounted(f.mount_point)}

        def after(f: DiskFullFault, ctx: FaultContext, result: object) -> dict[str, object]:
            return {"latest": latest_step(ctx.checkpoint_dir)}  # before the unmount

        # a 512 KB checkpoint written in 32 KB pieces, 5 ms apart (a real one takes seconds)
        drive = harness.drive(
            fault, tmp_path / writer, "ckpt_job.py",
            _args(writer, "--size-kb", "512", "--chunk-kb", "32", "--chunk-sleep", "0.005"),
            during=during, after=after,
        )
        assert drive.during["mounted"] and drive.evidence["mode_ran"] == "tmpfs"
        assert drive.evidence["filler"]["filled_mb"] > 2
        assert drive.result.outcome == "failed"
        assert drive.classification.startswith("ENOSPC: OSError errno 28"), drive.classification
        drives[writer] = drive
        harness.assert_nothing_left(drive.tag)
    assert drives["atomic"].during["latest"] == 2
    assert str(drives["inplace"].during["latest"]).startswith("corrupt"), drives["inplace"].during
    # the filler took back what the in-place writer's truncation freed
    assert drives["inplace"].evidence["filler"]["takebacks"] >= 1


@root_only
def test_keeping_the_disk_full_is_what_exposes_an_in_place_overwrite(tmp_path: Path) -> None:
    """The fact behind the filler: a one-off fill lets an in-place overwrite of the same size
    through (its truncation frees exactly what it needs); a filler that keeps taking space back
    does not."""
    point = tmp_path / "mnt"
    mount_tmpfs(point, 2)
    try:
        ckpt = point / "ckpt.bin"
        ckpt.write_bytes(b"a" * (256 << 10))
        once = Filler(point)
        once.start()
        assert once.wait_full()
        once.stop(free=False)  # a one-off fill: the filler file stays, nobody takes space back
        with open(ckpt, "wb") as f:
            f.write(b"b" * (256 << 10))  # succeeds: the truncation freed the space
        assert ckpt.stat().st_size == 256 << 10
        once.stop()

        keeper = Filler(point)
        keeper.start()
        assert keeper.wait_full()
        with pytest.raises(OSError) as info, open(ckpt, "wb") as f:
            time.sleep(0.05)  # the truncation's space is taken back within a few ms
            f.write(b"c" * (256 << 10))
        assert info.value.errno == 28
        assert ckpt.stat().st_size < 256 << 10
        keeper.stop()
        assert keeper.takebacks >= 1 and not keeper.path.exists()
    finally:
        assert unmount(point) is None
    assert not is_mounted(point) and not point.exists()


@root_only
def test_auto_mode_mounts_as_root_and_teardown_is_idempotent(tmp_path: Path) -> None:
    fault = DiskFullFault(rank=0, after_step=1)
    ctx = FaultContext(work_dir=tmp_path / "w", checkpoint_dir=tmp_path / "ckpt", world_size=1)
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "step-0.ckpt").write_bytes(b"kept")
    fault.setup(ctx)
    try:
        assert fault.mode_ran == "tmpfs" and fault.mount_point is not None
        assert is_mounted(fault.mount_point)
        assert ctx.checkpoint_dir == fault.mount_point / "checkpoints"
        assert (ctx.checkpoint_dir / "step-0.ckpt").read_bytes() == b"kept"
        assert fault.launch_env(ctx) == {}
    finally:
        fault.teardown()
    fault.teardown()
    assert not harness.our_mounts()


_INTERRUPTED = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from trainguard.faults import FaultContext
    from trainguard.faults.disk_full import DiskFullFault
    work = Path(sys.argv[1])
    fault = DiskFullFault({"mode": "tmpfs", "size_mb": 1})
    fault.setup(FaultContext(work_dir=work, checkpoint_dir=work / "ckpt", world_size=1))
    if sys.argv[2] == "finally":
        try:
            print("mounted", flush=True)
            time.sleep(60)
        finally:
            fault.teardown()
    else:
        print("mounted", flush=True)
        sys.stdin.readline()
        sys.exit(3)  # no teardown: the atexit safety net unmounts
    """
)


@root_only
@pytest.mark.parametrize("how", ["finally", "atexit"])
def test_ctrl_c_and_exit_unmount(tmp_path: Path, how: str) -> None:
    proc = subprocess.Popen([sys.executable, "-c", _INTERRUPTED, str(tmp_path), how],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "mounted"
        assert harness.our_mounts()
        if how == "finally":
            proc.send_signal(signal.SIGINT)
        else:
            assert proc.stdin is not None
            proc.stdin.write("exit\n")
            proc.stdin.flush()
        assert proc.wait(timeout=30) != 0
    finally:
        proc.kill()
        proc.wait()
    assert not harness.our_mounts()
    assert not (tmp_path / "disk-full-tmpfs").exists()


def test_non_root_falls_back_to_hook_mode(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What a non-root user gets (the euid trainguard checks before trying to mount)."""
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    fault = DiskFullFault()
    ctx = FaultContext(work_dir=tmp_path / "w", checkpoint_dir=tmp_path / "c", world_size=1)
    fault.setup(ctx)
    try:
        assert fault.mode_ran == "hook" and "needs root" in (fault.fallback or "")
        assert ctx.checkpoint_dir == tmp_path / "c"
        assert sorted(fault.launch_env(ctx)) == ["PYTHONPATH", "TRAINGUARD_FAULT_HOOK"]
        assert fault.evidence()["fallback"].startswith("tmpfs mode unavailable")
        with pytest.raises(FaultUnavailable, match="root"):
            DiskFullFault({"mode": "tmpfs"}).setup(ctx)
    finally:
        fault.teardown()
    assert not harness.our_mounts()


def test_validate_names_the_bad_parameters() -> None:
    problems = dict(DiskFullFault.validate({"mode": "nfs", "size_mb": 0.5, "rank": 1}))
    assert set(problems) == {"mode", "size_mb", "rank"}
    assert DiskFullFault.validate({"mode": "hook", "size_mb": 8}) == []
