"""The disk_full fault on real rank processes: a job that overwrites its checkpoint in place
ends with a corrupt latest checkpoint, a job that writes temp + fsync + rename keeps the previous
one intact -- in hook mode and through the FUSE layer (both deterministic).

Every test proves its teardown: no mount, no process left (``/proc/mounts`` is read).
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.helpers import load_fault_harness, report_evidence
from trainguard._internal.signals import restore_default_signals
from trainguard.config.fault_params import FaultParams
from trainguard.faults import disk_full
from trainguard.faults.base import FaultContext, FaultUnavailable
from trainguard.faults.disk_full import DiskFullFault
from trainguard.faults.fusefs import FuseLayer, fuse_unavailable

harness = load_fault_harness()
_NO_FUSE = fuse_unavailable()
fuse_only = pytest.mark.skipif(_NO_FUSE is not None, reason=f"no FUSE layer here: {_NO_FUSE}")


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
    fault = DiskFullFault(FaultParams({"mode": "hook"}), rank=0, after_step=2)
    drive = harness.drive(fault, tmp_path, "ckpt_job.py", _args("inplace"))
    assert drive.result.outcome == "failed"
    assert latest_step(drive.ctx.checkpoint_dir) == "corrupt (0 bytes, no header)"
    assert drive.classification.startswith("ENOSPC: OSError errno 28"), drive.classification
    assert report_evidence(drive)["mode_ran"] == "hook" and report_evidence(drive)["enospc_writes"] >= 1
    assert max(p.step for p in drive.result.points) == 2
    harness.assert_nothing_left(drive.tag)


def test_hook_mode_atomic_writer_keeps_the_previous_checkpoint(tmp_path: Path) -> None:
    fault = DiskFullFault(FaultParams({"mode": "hook"}), rank=0, after_step=2)
    drive = harness.drive(fault, tmp_path, "ckpt_job.py", _args("atomic"))
    assert drive.result.outcome == "failed"  # it still cannot go on: it says so and exits
    assert latest_step(drive.ctx.checkpoint_dir) == 2
    assert drive.classification.startswith("ENOSPC: OSError errno 28"), drive.classification
    harness.assert_nothing_left(drive.tag)


def test_hook_mode_clean_run_without_the_fault_is_untouched(tmp_path: Path) -> None:
    """The hook armed but never triggered changes nothing (the fault is not injected)."""
    fault = DiskFullFault(FaultParams({"mode": "hook"}), rank=0, after_step=99)
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
    fault = DiskFullFault(FaultParams({"mode": "hook"}), rank=0, after_step=2)
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


# -- fuse mode: the kernel answers the job's own writes ------------------------------------------


def _read_latest(f: DiskFullFault, ctx: FaultContext, result: object) -> dict[str, object]:
    return {"latest": latest_step(ctx.checkpoint_dir)}  # through the layer, before the unmount


@fuse_only
@pytest.mark.parametrize("writer", ["inplace", "atomic"])
def test_fuse_mode_in_place_vs_atomic(tmp_path: Path, writer: str) -> None:
    fault = DiskFullFault(FaultParams({"mode": "fuse"}), rank=0, after_step=2)

    def during(f: DiskFullFault, ctx: FaultContext) -> dict[str, object]:
        return {"mounted": f.layer is not None and bool(harness.our_mounts())}

    drive = harness.drive(fault, tmp_path, "ckpt_job.py", _args(writer, "--size-kb", "512"),
                          during=during, after=_read_latest)
    assert drive.during["mounted"] and report_evidence(drive)["mode_ran"] == "fuse"
    assert drive.result.outcome == "failed"
    assert drive.classification.startswith("ENOSPC: OSError errno 28"), drive.classification
    assert report_evidence(drive)["enospc_calls"] >= 1
    if writer == "atomic":
        assert drive.during["latest"] == 2
    else:
        assert str(drive.during["latest"]).startswith("corrupt"), drive.during
    harness.assert_nothing_left(drive.tag)


@fuse_only
def test_fuse_layer_fails_every_write_however_much_space_is_freed(tmp_path: Path) -> None:
    """What a racing filler of a small disk could not promise: after the trigger no write
    succeeds, whatever the job freed first (rename over a file, delete, truncate)."""
    layer = FuseLayer(tmp_path / "back", tmp_path / "mnt", policy="disk_full", state_dir=tmp_path)
    layer.mount()
    try:
        mnt = layer.point
        (mnt / "old.bin").write_bytes(b"a" * (1 << 20))
        (mnt / "new.bin").write_bytes(b"b" * (1 << 20))
        layer.arm()

        def refused(action: Callable[[], object]) -> int:
            with pytest.raises(OSError) as info:
                action()
            return info.value.errno

        os.replace(mnt / "new.bin", mnt / "old.bin")  # frees 1 MB
        assert refused(lambda: (mnt / "x.bin").write_bytes(b"x" * 4096)) == errno.ENOSPC
        os.unlink(mnt / "old.bin")  # frees the rest
        assert refused(lambda: (mnt / "y.bin").write_bytes(b"y")) == errno.ENOSPC
        assert refused(lambda: os.mkdir(mnt / "checkpoint-10")) == errno.ENOSPC
        with open(mnt / "z.bin", "wb") as handle:  # creating an empty file still works (ext4)
            assert refused(lambda: os.write(handle.fileno(), b"z")) == errno.ENOSPC
        assert refused(lambda: os.truncate(mnt / "z.bin", 100)) == errno.ENOSPC
        assert os.statvfs(mnt).f_bavail == 0
        layer.disarm()
        (mnt / "after.bin").write_bytes(b"ok")  # a cleared fault is a working disk again
        events = layer.read_events()
        assert {e["op"] for e in events} == {"write", "mkdir", "truncate_grow"}
    finally:
        assert layer.unmount() is None
    assert not harness.our_mounts() and not (tmp_path / "mnt").exists()
    assert sorted(p.name for p in (tmp_path / "back").iterdir()) == ["after.bin", "x.bin", "y.bin", "z.bin"]


@fuse_only
def test_auto_mode_mounts_the_layer_and_teardown_is_idempotent(tmp_path: Path) -> None:
    fault = DiskFullFault(rank=0, after_step=1)
    ctx = FaultContext(work_dir=tmp_path / "w", checkpoint_dir=tmp_path / "ckpt", world_size=1)
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "step-0.ckpt").write_bytes(b"kept")
    fault.setup(ctx)
    try:
        assert fault.mode_ran == "fuse" and fault.layer is not None
        assert ctx.checkpoint_dir == fault.layer.point and harness.our_mounts()
        assert (ctx.checkpoint_dir / "step-0.ckpt").read_bytes() == b"kept"
        assert fault.launch_env(ctx) == {}
    finally:
        fault.teardown()
    fault.teardown()
    assert not harness.our_mounts()
    assert (tmp_path / "ckpt" / "step-0.ckpt").read_bytes() == b"kept"  # the data stays


@fuse_only
def test_tmpfs_mode_runs_the_fuse_layer_and_says_so(tmp_path: Path) -> None:
    fault = DiskFullFault(FaultParams({"mode": "tmpfs", "size_mb": 4}), rank=0, after_step=1)
    ctx = FaultContext(work_dir=tmp_path / "w", checkpoint_dir=tmp_path / "ckpt", world_size=1)
    fault.setup(ctx)
    try:
        assert fault.mode_ran == "fuse" and "replaced by fuse" in fault.evidence().note
    finally:
        fault.teardown()
    assert not harness.our_mounts()


_INTERRUPTED = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from trainguard.config.fault_params import FaultParams
    from trainguard.faults.base import FaultContext
    from trainguard.faults.disk_full import DiskFullFault
    work = Path(sys.argv[1])
    fault = DiskFullFault(FaultParams({"mode": "fuse"}))
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
        sys.exit(3)  # no teardown: the atexit safety net unmounts (or, SIGKILLed, the daemon)
    """
)


@fuse_only
@pytest.mark.parametrize("how", ["finally", "atexit", "sigkill"])
def test_ctrl_c_exit_and_kill_unmount(tmp_path: Path, how: str) -> None:
    """Ctrl-C runs the teardown, a plain exit the atexit net; a SIGKILLed trainguard leaves no
    mount either: the daemon sees its parent gone and leaves."""
    proc = subprocess.Popen([sys.executable, "-c", _INTERRUPTED, str(tmp_path), how],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            preexec_fn=restore_default_signals)  # Ctrl-C's own state
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "mounted"
        assert harness.our_mounts()
        if how == "finally":
            proc.send_signal(signal.SIGINT)
        elif how == "sigkill":
            proc.kill()
        else:
            assert proc.stdin is not None
            proc.stdin.write("exit\n")
            proc.stdin.flush()
        assert proc.wait(timeout=30) != 0
    finally:
        proc.kill()
        proc.wait()
    deadline = time.monotonic() + 10
    while harness.our_mounts() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not harness.our_mounts()
    assert not harness.processes_with(f"{tmp_path}/w")


def test_non_root_falls_back_to_hook_mode(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What a non-root user gets (the euid trainguard checks before trying to mount)."""
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    disk_full._fuse_unavailable.cache_clear()
    fault = DiskFullFault()
    ctx = FaultContext(work_dir=tmp_path / "w", checkpoint_dir=tmp_path / "c", world_size=1)
    try:
        fault.setup(ctx)
        assert fault.mode_ran == "hook" and "needs root" in (fault.fallback or "")
        assert ctx.checkpoint_dir == tmp_path / "c"
        assert sorted(fault.launch_env(ctx)) == ["PYTHONPATH", "TRAINGUARD_FAULT_HOOK"]
        assert fault.evidence().fallback.startswith("fuse mode unavailable")
        with pytest.raises(FaultUnavailable, match="root"):
            DiskFullFault(FaultParams({"mode": "fuse"})).setup(ctx)
    finally:
        fault.teardown()
        disk_full._fuse_unavailable.cache_clear()
    assert not harness.our_mounts()


def test_validate_names_the_bad_parameters() -> None:
    problems = dict(DiskFullFault.validate(FaultParams({"mode": "nfs", "size_mb": 0.5, "rank": 1})))
    assert set(problems) == {"mode", "size_mb", "rank"}
    assert DiskFullFault.validate(FaultParams({"mode": "hook", "size_mb": 8})) == []
