"""trainguard.drills.crash_saves: which burst writes what a restart reads, and what a crash in the
last save left against the uninterrupted run's final checkpoint (real files, no FUSE)."""

from __future__ import annotations

import os
from pathlib import Path

from trainguard._internal.readers import ReadLimits, active_limits, use_limits
from trainguard.drills.crash_saves import feeds_restart, save_files, shape, unlike_reference


def test_a_write_feeds_a_restart_when_it_writes_what_the_restart_reads_numbers_aside() -> None:
    reads = {shape("/iter_0000020/model.json"), shape("/latest_checkpointed_iteration.txt"), "/ckpt.json"}
    assert feeds_restart("mkdir", "/iter_0000010", None, reads, set())
    assert feeds_restart("create", "/iter_0000010/model.json", None, reads, set())
    assert feeds_restart("truncate", "/latest_checkpointed_iteration.txt", None, reads, set())
    assert feeds_restart("rename", "/ckpt.json.tmp", "/ckpt.json", reads, set())
    assert not feeds_restart("write", "/ckpt.json.tmp", None, reads, set())  # not yet: its rename does
    assert not feeds_restart("fsync", "/ckpt.json", None, reads, set())
    assert not feeds_restart("write", "/train.log", None, reads | {"/train.log"}, {"/train.log"})


def test_the_files_a_save_left_are_its_final_names_without_logs_or_temp_names() -> None:
    ops = [("create", "/ckpt.json.{pid}.tmp", None), ("write", "/ckpt.json.{pid}.tmp", None),
           ("rename", "/ckpt.json.{pid}.tmp", "/ckpt.json"), ("mkdir", "/iter_0000010", None),
           ("create", "/iter_0000010/model.json", None), ("truncate", "/tracker.txt", None),
           ("write", "/tracker.txt", None), ("write", "/train.log", None), ("fsyncdir", "/", None)]
    assert save_files(ops, {"/train.log"}) == ["/ckpt.json", "/iter_0000010", "/iter_0000010/model.json",
                                               "/tracker.txt"]


def test_what_a_crash_left_is_compared_file_by_file_with_the_final_checkpoint(tmp_path: Path) -> None:
    crash, done = tmp_path / "crash", tmp_path / "done"
    for root in (crash, done):
        (root / "iter_0000020").mkdir(parents=True)
        (root / "iter_0000020" / "model.json").write_text('{"w": 1}')
        (root / "step.txt").write_text("20")
    assert unlike_reference(crash, done, ["/step.txt", "/iter_0000020", "/gone.tmp"]) == ([], 2)
    (crash / "step.txt").write_text("15")
    (done / "iter_0000020" / "extra.json").write_text("{}")
    differences, compared = unlike_reference(crash, done, ["/step.txt", "/iter_0000020"])
    assert differences == ["/step.txt differs from the uninterrupted run's",
                           "the crash left no /iter_0000020/extra.json"] and compared == 2
    assert unlike_reference(crash, done, ["/weights.json"]) == ([], 0)  # in neither: nothing compared
    (done / "weights.json").write_text("{}")
    assert unlike_reference(crash, done, ["/weights.json"]) == (["the crash left no /weights.json"], 0)


def test_a_file_not_compared_is_never_equal(tmp_path: Path) -> None:
    crash, done = tmp_path / "crash", tmp_path / "done"
    for root in (crash, done):
        root.mkdir()
        (root / "ckpt.json").write_bytes(b"x" * 2048)
    os.mkfifo(crash / "pipe")
    os.mkfifo(done / "pipe")
    before = active_limits()
    use_limits(ReadLimits(max_bytes=1024))
    try:
        differences, _ = unlike_reference(crash, done, ["/ckpt.json", "/pipe"])
    finally:
        use_limits(before)
    assert len(differences) == 2 and all("not compared" in d for d in differences), differences
    assert "over the limit" in differences[0] and "FIFO" in differences[1]


def test_a_checkpoint_whose_bytes_differ_only_in_a_path_is_compared_value_by_value(tmp_path: Path) -> None:
    import torch

    crash, done = tmp_path / "crash", tmp_path / "done"
    for root in (crash, done):
        root.mkdir()
        torch.save({"w": torch.arange(4.0), "dirpath": str(root)}, root / "last.ckpt")
    assert (crash / "last.ckpt").read_bytes() != (done / "last.ckpt").read_bytes()
    assert unlike_reference(crash, done, ["/last.ckpt"]) == ([], 1)
    torch.save({"w": torch.arange(4.0) + 1, "dirpath": str(crash)}, crash / "last.ckpt")
    differences, _ = unlike_reference(crash, done, ["/last.ckpt"])
    assert len(differences) == 1 and differences[0].startswith("/last.ckpt differs from the uninterrupted run's ("), differences
