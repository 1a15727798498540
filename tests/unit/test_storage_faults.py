"""``storage`` and ``kill_during_save`` drills: their parameters in the job file, the default
expectation per kind, how the newest checkpoint is found, and the FUSE layer's rules (EIO per
operation and per path, latency, a held write released by the kill) on a real mount where this
machine allows one (issue 14, items 2-3; docs/faults-memory-and-disk.md)."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from trainguard.config import parse_config
from trainguard.config.fault_params import FaultParams
from trainguard.errors import ConfigError
from trainguard.evidence import known
from trainguard.faults.fusefs import FuseLayer
from trainguard.faults.storage import newest_checkpoint_files

HEAD = r"""
job:
  name: toy
  command: "python toy_train.py --steps {steps} --ckpt-dir {checkpoint_dir}"
  resume_args: "--resume"
  world_size: 2
  metrics: {loss: 'step (?P<step>\d+) loss (?P<value>\S+)'}
checks:
  drills:
"""


def load(*entries: str) -> Any:
    return parse_config(HEAD + "".join(f"    - {e}\n" for e in entries), path="/jobs/t.trainguard.yaml")


def problem(entry: str) -> str:
    with pytest.raises(ConfigError) as info:
        load(entry)
    return str(info.value)


def test_the_default_expectation_follows_the_kind() -> None:
    jf = load("{name: w, fault: storage, params: {kind: eio_write}}",
              "{name: c, fault: storage, params: {kind: corrupt}, expect: recover}",
              "{name: s, fault: storage, duration: 2, params: {kind: slow, latency_ms: 50, op: fsync}}",
              "{name: k, fault: kill_during_save}")
    assert [d.expectation for d in jf.checks.drills] == ["fail_clean", "recover", "continue", "recover"]


@pytest.mark.parametrize(
    ("entry", "expected"),
    [
        ("{name: a, fault: storage}", "checks.drills[0].params.kind: expected one of eio_write, eio_read, fsync, slow, corrupt, got 'None'"),
        ("{name: a, fault: storage, params: {kind: eoi_write}}", "params.kind: expected one of eio_write"),
        ("{name: a, fault: storage, params: {kind: eio_write, latency_ms: 5}}", "params.latency_ms: applies to `kind: slow` only"),
        ("{name: a, fault: storage, duration: 1, params: {kind: slow}}", "params.latency_ms: expected the milliseconds added"),
        ("{name: a, fault: storage, duration: 1, params: {kind: slow, latency_ms: .inf}}", "params.latency_ms: expected the milliseconds"),
        ("{name: a, fault: storage, duration: 1, params: {kind: slow, latency_ms: 5, op: read}}", "params.op: expected write or fsync, got 'read'"),
        ("{name: a, fault: storage, params: {kind: corrupt, offset: -1}}", "params.offset: expected the byte offset"),
        ("{name: a, fault: storage, params: {kind: eio_read, offset: 3}}", "params.offset: applies to `kind: corrupt` only"),
        ("{name: a, fault: storage, params: {kind: slow, latency_ms: 5}}", "`expect: continue` compares the step rate"),
        ("{name: a, fault: storage, expect: fail_clean, params: {kind: slow, latency_ms: 5}}",
         "a storage drill of `params.kind: slow` is judged by continue, not fail_clean; set `expect: continue`"),
        ("{name: a, fault: storage, expect: continue, duration: 1, params: {kind: corrupt}}",
         "judged by fail_clean or recover, not continue"),
        ("{name: a, fault: kill_during_save, params: {wait: 0}}", "params.wait: expected the seconds to wait"),
        ("{name: a, fault: kill_during_save, params: {wait: 1" + "0" * 400 + "}}", "params.wait: expected the seconds"),
        ("{name: a, fault: storage, duration: 1, params: {kind: slow, latency_ms: 1" + "0" * 400 + "}}",
         "params.latency_ms: expected the milliseconds"),
        ("{name: a, fault: kill_during_save, params: {signal: SIGTERM}}", "params.signal: unknown parameter for fault 'kill_during_save'"),
    ],
)
def test_each_bad_storage_drill_names_the_key_and_the_fix(entry: str, expected: str) -> None:
    assert expected in problem(entry)


def test_the_newest_checkpoint_is_found_by_step_then_by_write(tmp_path: Path) -> None:
    for name in ("rank0-step000005.json", "rank1-step000005.json", "rank0-step000010.json",
                 "rank1-step000010.json", ".rank0-step000015.json.tmp"):
        (tmp_path / name).write_text("x" * (20 if "rank1-step000010" in name else 10))
    found, step, files = newest_checkpoint_files(tmp_path, rank=0)
    assert step == 10 and found is not None and found.name.endswith("step000010.json")
    assert [p.name for p in files] == ["rank1-step000010.json", "rank0-step000010.json"]  # largest first
    assert newest_checkpoint_files(tmp_path / "none") == (None, None, [])


@pytest.mark.timeout(60)
def test_the_rules_fail_delay_and_hold_calls_through_a_real_mount(layer: FuseLayer) -> None:
    mnt = layer.point
    (mnt / "old.json").write_text("old")
    layer.arm({"errno": {"write": errno.EIO}})
    with pytest.raises(OSError) as info:
        (mnt / "new.json").write_text("new")
    assert info.value.errno == errno.EIO
    layer.arm({"errno": {"read": errno.EIO}, "paths": ["/old.json"]})
    (mnt / "other.json").write_text("other")  # writes pass; reads of other files too
    assert (mnt / "other.json").read_text() == "other"
    with pytest.raises(OSError, match="Input/output error"):
        (mnt / "old.json").read_text()
    layer.arm({"errno": {"fsync": errno.EIO}})
    fd = os.open(mnt / "f.json", os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        os.write(fd, b"f")
        with pytest.raises(OSError, match="Input/output error"):
            os.fsync(fd)
    finally:
        os.close(fd)
    layer.arm({"latency_ms": {"write": 100}})
    started = time.monotonic()
    (mnt / "slow.json").write_text("slow")
    assert time.monotonic() - started >= 0.1
    delayed = [e for e in layer.read_events() if e["event"] == "delayed"]
    assert delayed and delayed[-1]["added_s"] == 0.1 and delayed[-1]["path"] == "/slow.json"
    layer.disarm()
    assert (mnt / "old.json").read_text() == "old"
    with pytest.raises(ValueError, match="unknown FUSE operation"):
        layer.arm({"errno": {"wirte": 5}})
    # a write held inside the daemon: the writer dies of SIGKILL once the daemon answers
    child = subprocess.Popen([sys.executable, "-c", f"open({str(mnt / 'held.json')!r}, 'w').write('x' * 4096)"])
    try:
        layer.arm({"hold": {"op": "write", "pid": child.pid, "max_s": 20}})
        deadline = time.monotonic() + 15
        while not any(e["event"] == "held" for e in layer.read_events()) and time.monotonic() < deadline:
            time.sleep(0.01)
        (held,) = [e for e in layer.read_events() if e["event"] == "held"]
        assert held["path"] == "/held.json" and held["pid"] == child.pid
        os.kill(child.pid, signal.SIGKILL)
        time.sleep(0.2)
        assert child.poll() is None  # blocked in the FUSE request the daemon holds
        layer.disarm()
        assert child.wait(timeout=10) == -signal.SIGKILL
    finally:
        if child.poll() is None:
            child.kill()
            layer.disarm()
            child.wait(timeout=10)
    assert (layer.backing / "held.json").stat().st_size == 0  # the held data never reached the disk


@pytest.mark.parametrize(("kind", "params"), [("storage", {"kind": "eio_write"}), ("kill_during_save", {})])
def test_without_fuse_the_drill_is_skipped_with_the_reason(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                           kind: str, params: dict[str, Any]) -> None:
    from trainguard.config.faults import fault_class
    from trainguard.faults.base import FaultContext, FaultUnavailable

    cls = fault_class(kind)
    module = __import__(cls.__module__, fromlist=["fuse_unavailable"])
    monkeypatch.setattr(module, "fuse_unavailable", lambda: "mounting the FUSE layer needs root")
    fault = cls(FaultParams(params))
    ctx = FaultContext(work_dir=tmp_path / "w", checkpoint_dir=tmp_path / "c", world_size=1)
    with pytest.raises(FaultUnavailable, match=r"mounting the FUSE layer needs root; .*FUSE layer"):
        fault.setup(ctx)
    assert ctx.checkpoint_dir == tmp_path / "c"  # untouched: nothing mounted
    fault.teardown()


def test_corrupt_needs_no_fuse_and_flips_one_bit_of_the_newest_checkpoint(tmp_path: Path) -> None:
    from trainguard.faults.base import FaultContext
    from trainguard.faults.storage import StorageFault

    ckpt = tmp_path / "c"
    ckpt.mkdir()
    (ckpt / "ckpt_000005.json").write_text("0123456789")
    (ckpt / "ckpt_000010.json").write_text("abcdefghij")
    fault = StorageFault(FaultParams({"kind": "corrupt"}))
    fault.setup(FaultContext(work_dir=tmp_path / "w", checkpoint_dir=ckpt, world_size=1))
    fault.strike_latest()
    assert fault.target is not None and fault.target.step == 10 and fault.target.offset == 5
    assert (ckpt / "ckpt_000010.json").read_text() == "abcdegghij"  # f (0x66) -> g (0x67)
    assert (ckpt / "ckpt_000005.json").read_text() == "0123456789"
    assert fault.evidence().mechanism.startswith("direct")


def test_corrupt_never_writes_through_a_link_out_of_the_checkpoint(tmp_path: Path) -> None:
    from trainguard.faults.base import FaultContext
    from trainguard.faults.storage import StorageFault

    outside = tmp_path / "outside.bin"
    outside.write_bytes(b"keep me as I am" * 100)
    ckpt = tmp_path / "c" / "checkpoint-10"
    ckpt.mkdir(parents=True)
    (ckpt / "trainer_state.json").write_text('{"global_step": 10}')
    (ckpt / "model.bin").symlink_to(outside)  # the largest file, but a link out
    (ckpt / "optimizer.pt").write_bytes(b"0123456789")
    fault = StorageFault(FaultParams({"kind": "corrupt"}))
    fault.setup(FaultContext(work_dir=tmp_path / "w", checkpoint_dir=tmp_path / "c", world_size=1))
    fault.strike_latest()
    assert outside.read_bytes() == b"keep me as I am" * 100
    assert fault.target is None or not str(known(fault.target.file) or "").endswith("model.bin")


# what a job saves under ``kind: fsync``: the planted in-place writer of toy_train.py (and a log it
# appends to), a writer that lets the failing fsync go, one that renames without an fsync first
SAVES = {
    "in place": "open(d + '/rank0-step000010.json', 'w').write('{}')\nopen(d + '/train.log', 'a').write('x')",
    "swallowed": ("f = open(d + '/.ckpt.tmp', 'w'); f.write('{}'); f.flush()\ntry:\n    os.fsync(f.fileno())\n"
                  "except OSError:\n    pass\nf.close(); os.replace(d + '/.ckpt.tmp', d + '/ckpt.json')"),
    "renamed": "open(d + '/.ckpt.tmp', 'w').write('{}')\nos.replace(d + '/.ckpt.tmp', d + '/ckpt.json')",
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("save", "named_first"), [
    ("in place", "the checkpoint is written in place and never fsynced (no temp file + fsync + rename): under the "
                 "fault rank 0 wrote /rank0-step000010.json straight to its final name and called no fsync"),
    ("swallowed", "the error is caught and swallowed: 1 fsync call(s) under the checkpoint directory failed with "
                  "EIO (/.ckpt.tmp first)"),
    ("renamed", "the checkpoint is renamed into place with no fsync first: under the fault rank 0 wrote /.ckpt.tmp "
                "and renamed it to /ckpt.json without an fsync"),
])
def test_a_job_that_completes_under_failing_fsyncs_is_told_what_it_did_instead(
        tmp_path: Path, save: str, named_first: str) -> None:
    """The fsync drill's planted writer never fsyncs: no call fails, the job completes, and the
    cause comes from what the layer saw it write (not "the error is caught and swallowed",
    which only a failed fsync the job went on from shows)."""
    from trainguard.faults.base import FaultContext
    from trainguard.faults.fusefs import fuse_unavailable
    from trainguard.faults.storage import StorageFault
    from trainguard.launch import RunResult

    if fuse_unavailable() is not None:
        pytest.skip(f"no FUSE layer on this machine: {fuse_unavailable()}")
    fault = StorageFault(FaultParams({"kind": "fsync"}))
    ctx = FaultContext(work_dir=tmp_path / "w", checkpoint_dir=tmp_path / "c", world_size=1)
    fault.setup(ctx)
    try:
        fault.arm_on_the_run()
        subprocess.run([sys.executable, "-c", f"import os\nd = {str(ctx.checkpoint_dir)!r}\n{SAVES[save]}"],
                       check=True, timeout=30, env={**os.environ, "RANK": "0"})
        completed = RunResult(outcome="ok", argv=[], run_dir=tmp_path, world_size=1, port=0, exits=[],
                              points=[], duration_s=1.0, first_metric_s=None)
        causes = fault.likely_causes(completed)
        failed = RunResult(**{**completed.__dict__, "outcome": "failed"})
        assert fault.likely_causes(failed) == []  # a job that failed on the fault: the judge's own causes
    finally:
        fault.teardown()
    assert causes and causes[0].startswith(named_first), causes
    assert len(causes) == 1 and "train.log" not in causes[0]  # what it appends to is a log
    assert "record" not in known(fault.evidence().rules)
