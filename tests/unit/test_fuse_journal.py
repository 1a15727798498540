"""The FUSE daemon's journal (trainguard.faults.fusejournal) through a real mount: every
operation of a writer recorded as a boundary, and a crash right after one of them."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from trainguard.faults.fusefs import FuseLayer
from trainguard.faults.fusejournal import boundary_path

# a save as careful writers make it: a temp file, written, fsynced, renamed, the directory fsynced
WRITER = """
import os, sys, time
d = sys.argv[1]
time.sleep(float(sys.argv[2]))
tmp = os.path.join(d, "ckpt.pt.tmp")
with open(tmp, "wb", buffering=0) as f:
    f.write(b"a" * 100)
    f.write(b"b" * 100)
    os.fsync(f.fileno())
os.replace(tmp, os.path.join(d, "ckpt.pt"))
fd = os.open(d, os.O_RDONLY)
os.fsync(fd)
os.close(fd)
print("saved", flush=True)
"""


def _writer(layer: FuseLayer, delay: float) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-c", WRITER, str(layer.point), str(delay)],
                            stdout=subprocess.PIPE, text=True, start_new_session=True)


def _ops(layer: FuseLayer) -> list[tuple[int, str, str, int]]:
    return [(e["rank"], e["path"], e["op"], e["ordinal"]) for e in layer.read_events() if e["event"] == "op"]


def test_temp_names_are_named_alike_in_every_run() -> None:
    assert boundary_path("/ckpt/tmpa1b2_c3d.pt") == "/ckpt/tmp*.pt"
    assert boundary_path("/checkpoint-10/.tmpXEW5C3") == "/checkpoint-10/.tmp*"  # safetensors (Rust)
    assert boundary_path("/ckpt/tmpfile_backup.pt") == "/ckpt/tmpfile_backup.pt"  # a name, not random
    assert boundary_path("/step_000010/.COMPLETE.tmp") == "/step_000010/.COMPLETE.tmp"
    assert boundary_path("/x-0f8fad5b-d9cb-469f-a165-70867728950e.bin") == "/x-*.bin"
    # the writer's pid (digits' ..ckpt_000010.pt.sha256.6800.tmp), and only a whole number
    assert boundary_path("/.ckpt_000010.pt.6800.tmp", 6800) == "/.ckpt_000010.pt.{pid}.tmp"
    assert boundary_path("/ckpt_068001.pt", 6800) == "/ckpt_068001.pt"


@pytest.mark.timeout(60)
def test_a_save_is_recorded_boundary_by_boundary_and_crashed_right_after_one(layer: FuseLayer) -> None:
    child = _writer(layer, 1.0)
    layer.arm({"record": {"ranks": {str(child.pid): 0}}})
    out, _ = child.communicate(timeout=30)
    assert child.returncode == 0 and "saved" in out
    ops = _ops(layer)
    assert ops == [
        (0, "/ckpt.pt.tmp", "create", 1), (0, "/ckpt.pt.tmp", "write", 1), (0, "/ckpt.pt.tmp", "write", 2),
        (0, "/ckpt.pt.tmp", "fsync", 1), (0, "/ckpt.pt.tmp", "rename", 1), (0, "/", "fsyncdir", 1),
    ], ops
    rename = next(e for e in layer.read_events() if e.get("op") == "rename")
    assert rename["to"] == "/ckpt.pt"
    # crash right after the first write: the second never reaches the disk, no rename happens
    layer.disarm()
    (layer.backing / "ckpt.pt").unlink()
    layer.events.unlink()
    child = _writer(layer, 1.0)
    layer.arm({"crash": {"ranks": {str(child.pid): 0}, "at": {"rank": 0, "path": "/ckpt.pt.tmp", "op": "write",
                                                              "ordinal": 1},
                         "kill": [os.getpgid(child.pid)]}})
    child.wait(timeout=30)
    assert child.returncode == -signal.SIGKILL
    crashed = [e for e in layer.read_events() if e["event"] == "crashed"]
    assert len(crashed) == 1 and crashed[0]["op"] == "write"
    assert (layer.backing / "ckpt.pt.tmp").read_bytes() == b"a" * 100
    assert not (layer.backing / "ckpt.pt").exists()
    # after the crash nothing changes the disk until the rules change
    with pytest.raises(OSError, match="Input/output error"):
        (layer.point / "later.txt").write_text("x")
    layer.disarm()
    (layer.point / "later.txt").write_text("x")
    assert (layer.backing / "later.txt").read_text() == "x"


@pytest.mark.timeout(60)
def test_a_crash_before_a_boundary_strikes_instead_of_it(layer: FuseLayer) -> None:
    """``"before": true``: the operation is never done (a crash just before a save began)."""
    (layer.backing / "ckpt.pt").write_bytes(b"old")
    child = _writer(layer, 1.0)
    layer.arm({"crash": {"ranks": {str(child.pid): 0}, "before": True, "kill": [os.getpgid(child.pid)],
                         "at": {"rank": 0, "path": "/ckpt.pt.tmp", "op": "create", "ordinal": 1}}})
    child.wait(timeout=30)
    assert child.returncode == -signal.SIGKILL
    crashed = [e for e in layer.read_events() if e["event"] == "crashed"]
    assert len(crashed) == 1 and crashed[0]["op"] == "create" and crashed[0]["before"], crashed
    assert _ops(layer) == []
    assert not (layer.backing / "ckpt.pt.tmp").exists()
    assert (layer.backing / "ckpt.pt").read_bytes() == b"old"


# a restart as the crash_points check sees it: the checkpoint read, a log appended to, a file
# rewritten (no read), the checkpoint read again
READER = """
import os, sys
d = sys.argv[1]
for _ in range(2):
    with open(os.path.join(d, "ckpt.pt"), "rb") as f:
        f.read()
with open(os.path.join(d, "train.log"), "a") as f:
    f.write("resumed\\n")
with open(os.path.join(d, "train.log"), "a") as f:
    f.write("again\\n")
with open(os.path.join(d, "notes.txt"), "w") as f:
    f.write("x")
with open(os.path.join(d, "notes.txt"), "r+") as f:
    f.read()
"""


@pytest.mark.timeout(60)
def test_the_files_a_restart_opens_to_read_or_to_append_are_written_down_once(layer: FuseLayer) -> None:
    (layer.backing / "ckpt.pt").write_bytes(b"state")
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1.0)\n" + READER, str(layer.point)],
                             start_new_session=True)
    layer.arm({"record": {"ranks": {str(child.pid): 0}}})
    assert child.wait(timeout=30) == 0
    opened = sorted((e["path"], e["mode"], e["rank"]) for e in layer.read_events() if e["event"] == "opened")
    assert opened == [("/ckpt.pt", "read", 0), ("/notes.txt", "read", 0), ("/train.log", "append", 0)], opened


@pytest.mark.timeout(30)
def test_operations_of_other_processes_are_not_boundaries(layer: FuseLayer) -> None:
    layer.arm({"record": {"ranks": {"999999999": 0}}})
    (layer.point / "mine.txt").write_text("not the job's")
    time.sleep(0.1)
    assert _ops(layer) == []


def test_a_power_loss_drops_what_was_not_made_durable(tmp_path: Path) -> None:
    """PowerLoss without a mount: the operations done on the backing directory as the daemon
    does them, the undo log kept before each, fsyncs making data and entries durable."""
    from trainguard.faults.fusejournal import PowerLoss

    back = tmp_path / "back"
    back.mkdir()
    (back / "ckpt.pt").write_bytes(b"old")  # durable before the save
    power = PowerLoss(str(back), str(tmp_path / "copies"))

    def op(name: str, path: str, do: Any, to: str | None = None) -> None:
        power.before(name, path, to)
        do()

    op("create", "/ckpt.pt.tmp", lambda: (back / "ckpt.pt.tmp").write_bytes(b""))
    op("write", "/ckpt.pt.tmp", lambda: (back / "ckpt.pt.tmp").write_bytes(b"new"))
    # no fsync of the file, no fsync of the directory: the rename and the data are both lost
    op("rename", "/ckpt.pt.tmp", lambda: os.replace(back / "ckpt.pt.tmp", back / "ckpt.pt"), to="/ckpt.pt")
    assert power.drop() == 3
    assert sorted(p.name for p in back.iterdir()) == ["ckpt.pt"] and (back / "ckpt.pt").read_bytes() == b"old"
    # fsynced data, renamed, the directory not fsynced: the old file comes back
    op("create", "/ckpt.pt.tmp", lambda: (back / "ckpt.pt.tmp").write_bytes(b""))
    op("write", "/ckpt.pt.tmp", lambda: (back / "ckpt.pt.tmp").write_bytes(b"new"))
    power.durable("fsync", "/ckpt.pt.tmp", os.stat(back / "ckpt.pt.tmp").st_ino)
    op("rename", "/ckpt.pt.tmp", lambda: os.replace(back / "ckpt.pt.tmp", back / "ckpt.pt"), to="/ckpt.pt")
    power.drop()
    assert (back / "ckpt.pt").read_bytes() == b"old" and not (back / "ckpt.pt.tmp").exists()
    # and once the directory is fsynced too, the new checkpoint survives
    op("create", "/ckpt.pt.tmp", lambda: (back / "ckpt.pt.tmp").write_bytes(b""))
    op("write", "/ckpt.pt.tmp", lambda: (back / "ckpt.pt.tmp").write_bytes(b"new"))
    power.durable("fsync", "/ckpt.pt.tmp", os.stat(back / "ckpt.pt.tmp").st_ino)
    op("rename", "/ckpt.pt.tmp", lambda: os.replace(back / "ckpt.pt.tmp", back / "ckpt.pt"), to="/ckpt.pt")
    power.durable("fsyncdir", "/", None)
    assert power.drop() == 0 and (back / "ckpt.pt").read_bytes() == b"new"
    # data written in place and never synced goes back to what the file held
    op("truncate", "/ckpt.pt", lambda: (back / "ckpt.pt").write_bytes(b""))
    op("write", "/ckpt.pt", lambda: (back / "ckpt.pt").write_bytes(b"torn"))
    power.drop()
    assert (back / "ckpt.pt").read_bytes() == b"new"
