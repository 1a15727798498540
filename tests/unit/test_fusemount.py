"""FuseMount and FuseFault: the one life of a FUSE layer its owners share (mounted or why not,
a signal during the mount still reaching the unmount, the unmount's problem kept, teardown
unmounting after a failed clear). The daemon is replaced: these run without FUSE; the real
mount is tested in test_faults_disk_full.py, test_storage_faults.py and test_fuse_journal.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from trainguard.faults.base import FaultContext
from trainguard.faults.fusefs import FuseLayer
from trainguard.faults.fusemount import FuseFault, FuseMount


class _Daemon:
    """What FuseLayer.mount / unmount would do, recorded: ``fail`` raised by the mount,
    ``problem`` returned by each unmount."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, *, fail: BaseException | None = None,
                 problem: str | None = None) -> None:
        self.mounted: list[Path] = []
        self.unmounted: list[Path] = []

        def mount(layer: FuseLayer) -> None:
            self.mounted.append(layer.point)
            if fail is not None:
                raise fail

        def unmount(layer: FuseLayer) -> str | None:
            self.unmounted.append(layer.point)
            return problem

        monkeypatch.setattr(FuseLayer, "mount", mount)
        monkeypatch.setattr(FuseLayer, "unmount", unmount)


def test_an_unavailable_fuse_is_the_answer_and_nothing_is_tried(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    daemon = _Daemon(monkeypatch)
    fuse = FuseMount()
    why = fuse.mount(tmp_path / "b", tmp_path / "m", policy="rules", state_dir=tmp_path, unavailable="no /dev/fuse")
    assert why == "no /dev/fuse" and fuse.layer is None and daemon.mounted == []
    assert fuse.unmount() is None and daemon.unmounted == []


def test_a_mount_that_fails_says_why_and_leaves_no_layer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    daemon = _Daemon(monkeypatch, fail=RuntimeError("the FUSE daemon did not mount m: boom"))
    fuse = FuseMount()
    why = fuse.mount(tmp_path / "b", tmp_path / "m", policy="disk_full", state_dir=tmp_path)
    assert why == "the FUSE daemon did not mount m: boom" and fuse.layer is None
    assert daemon.mounted == [tmp_path / "m"]
    assert fuse.unmount() is None and daemon.unmounted == [] and fuse.problems == []


def test_a_signal_during_the_mount_still_reaches_the_unmount(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    daemon = _Daemon(monkeypatch, fail=KeyboardInterrupt(), problem="m is still mounted after umount -l")
    owner: list[str] = ["the fault's own problem"]
    fuse = FuseMount(owner)
    with pytest.raises(KeyboardInterrupt):
        fuse.mount(tmp_path / "b", tmp_path / "m", policy="rules", state_dir=tmp_path)
    assert fuse.layer is not None  # the teardown knows of it
    assert fuse.unmount() == "m is still mounted after umount -l"
    assert daemon.unmounted == [tmp_path / "m"]
    assert owner == ["the fault's own problem", "m is still mounted after umount -l"]  # the owner's list, in order


class _Fault(FuseFault):
    kind = "test_fuse"

    def __init__(self, *, clear_fails: bool = False) -> None:
        super().__init__()
        self.clear_fails, self.cleared = clear_fails, 0

    def clear(self) -> None:
        self.cleared += 1
        if self.clear_fails:
            raise OSError("clear failed")


def _ctx(tmp_path: Path) -> FaultContext:
    return FaultContext(work_dir=tmp_path / "w", checkpoint_dir=tmp_path / "c", world_size=1)


def test_a_fuse_fault_points_the_job_at_the_layer_and_teardown_unmounts_after_clear(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    daemon = _Daemon(monkeypatch, problem="w/f is still mounted after umount -l")
    fault, ctx = _Fault(clear_fails=True), _ctx(tmp_path)
    assert fault.mount_over_checkpoints(ctx, "f", policy="rules", unavailable=None) is None
    assert fault.layer is not None and fault.layer.backing == tmp_path / "c"
    assert ctx.checkpoint_dir == tmp_path / "w" / "f" == fault.layer.point
    with pytest.raises(OSError, match="clear failed"):
        fault.teardown()
    assert fault.cleared == 1 and daemon.unmounted == [tmp_path / "w" / "f"]
    assert fault.problems == ["w/f is still mounted after umount -l"]
    assert fault.layer is not None  # its events stay readable for the evidence


@pytest.mark.parametrize("fail", [None, RuntimeError("no mount after 15 s")])
def test_a_fuse_fault_that_cannot_mount_leaves_the_checkpoint_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                   fail: Any) -> None:
    _Daemon(monkeypatch, fail=fail)
    fault, ctx = _Fault(), _ctx(tmp_path)
    unavailable = "mounting the FUSE layer needs root" if fail is None else None
    why = fault.mount_over_checkpoints(ctx, "f", policy="rules", unavailable=unavailable)
    assert why == (unavailable or "no mount after 15 s")
    assert ctx.checkpoint_dir == tmp_path / "c" and fault.layer is None
    fault.teardown()
    assert fault.cleared == 1 and fault.problems == []
