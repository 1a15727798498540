"""The daemon's copies of the checkpoint directory after each operation
(trainguard.faults.fusestates, issue 49): each is the directory as that operation left it, an
unchanged file is a hard link to the copy before's, and none is made past the cap."""

from __future__ import annotations

import os
from pathlib import Path

from trainguard.drills.crash_records import Boundary
from trainguard.drills.crash_restore import restore, states_of
from trainguard.faults.fusefs import journal
from trainguard.faults.fusestates import StateCopies


def test_each_copy_is_the_directory_as_the_operation_left_it(tmp_path: Path) -> None:
    backing, folder = tmp_path / "backing", tmp_path / "states"
    backing.mkdir()
    (backing / "ckpt.json").write_text("old")
    copies = StateCopies(str(backing), str(folder), 1 << 20)
    (backing / "ckpt.json.tmp").write_text("new")
    assert copies.copy(("/ckpt.json.tmp",))[0] == 0  # type: ignore[index]
    os.replace(backing / "ckpt.json.tmp", backing / "ckpt.json")
    assert copies.copy(("/ckpt.json.tmp", "/ckpt.json"))[0] == 1  # type: ignore[index]
    (backing / "log.txt").write_text("a line")
    assert copies.copy(("/log.txt",))[0] == 2  # type: ignore[index]
    assert sorted(p.name for p in (folder / "0").iterdir()) == ["ckpt.json", "ckpt.json.tmp"]
    assert (folder / "0" / "ckpt.json").read_text() == "old" and (folder / "0" / "ckpt.json.tmp").read_text() == "new"
    assert [p.name for p in (folder / "1").iterdir()] == ["ckpt.json"] and (folder / "1" / "ckpt.json").read_text() == "new"
    # the checkpoint did not change since copy 1: the same file, not another copy of it
    assert (folder / "2" / "ckpt.json").stat().st_ino == (folder / "1" / "ckpt.json").stat().st_ino
    # put back for a restart, then written by it: the copy stays as it was
    restore(folder / "1", backing)
    (backing / "ckpt.json").write_text("written by the restart")
    assert (folder / "1" / "ckpt.json").read_text() == "new" and not (backing / "log.txt").exists()


def test_no_copy_past_the_cap_and_a_boundary_without_one_is_crashed(tmp_path: Path) -> None:
    backing, folder = tmp_path / "backing", tmp_path / "states"
    backing.mkdir()
    copies = StateCopies(str(backing), str(folder), 10_000)
    (backing / "a.pt").write_bytes(b"x" * 6_000)
    assert copies.copy(("/a.pt",)) is not None
    (backing / "a.pt").write_bytes(b"y" * 6_000)  # 12 000 bytes copied in all: over the cap
    assert copies.copy(("/a.pt",)) is None and copies.copy(("/a.pt",)) is None
    assert sorted(p.name for p in folder.iterdir()) == ["0"]
    events = journal([{"event": "op", "op": "write", "path": "/a.pt", "rank": 0, "ordinal": 1, "state": 0},
                      {"event": "op", "op": "write", "path": "/a.pt", "rank": 0, "ordinal": 2}])
    first, second = Boundary(0, "/a.pt", "write", 1), Boundary(0, "/a.pt", "write", 2)
    assert states_of(events, [first, second], folder) == {first: folder / "0"}


def test_a_fifo_in_the_directory_stops_the_copies_without_blocking(tmp_path: Path) -> None:
    """A file that is not a regular file (a FIFO a job made) is never read: copying it would wait
    for a writer forever. The copies stop there, and boundaries are crashed as without them."""
    backing, folder = tmp_path / "backing", tmp_path / "states"
    backing.mkdir()
    copies = StateCopies(str(backing), str(folder), 1 << 20)
    (backing / "a.pt").write_bytes(b"x")
    assert copies.copy(("/a.pt",)) is not None
    os.mkfifo(backing / "pipe")
    assert copies.copy(("/a.pt",)) is None and copies.full
    assert sorted(p.name for p in folder.iterdir()) == ["0"]


def test_a_file_written_in_many_writes_costs_its_size_once_and_each_copy_is_put_back_whole(tmp_path: Path) -> None:
    """Two shards written in turns, 50 writes of 1 KiB each (DCP's, the FSDP2 example's): each
    copy after a write keeps the bytes written and a reference to the copy before, so the copies
    hold the shards' size once (before: every copy copied the shard written so far, 263 MB after
    536 of the FSDP2 save's 673 operations). Each copy put back is the directory as that write
    left it; a shard the operation did not write holds what the copy before held, even when
    another rank's write to it is under way (it belongs to the copies after its own)."""
    backing, folder = tmp_path / "backing", tmp_path / "states"
    backing.mkdir()
    (backing / "old.pt").write_bytes(b"o" * 4096)
    copies = StateCopies(str(backing), str(folder), 1 << 20)
    for name in ("a.pt", "b.pt"):
        (backing / name).write_bytes(b"")
        copies.copy((f"/{name}",))
    expected: list[dict[str, bytes]] = []
    for n in range(100):
        name = "a.pt" if n % 2 == 0 else "b.pt"
        with open(backing / name, "r+b") as f:
            offset = (n // 2) * 1024
            f.seek(offset)
            f.write(bytes([n]) * 1024)
        if n == 50:  # b's next write lands before a's copy is made: that copy leaves it out
            with open(backing / "b.pt", "ab") as f:
                f.write(b"!" * 1024)
        copies.copy((f"/{name}",), (offset, 1024))
        if n == 50:
            with open(backing / "b.pt", "r+b") as f:
                f.truncate(25 * 1024)
        expected.append({p.name: p.read_bytes() for p in backing.iterdir()})
    # 100 KiB written, 4 KiB copied at the start: not the 5 MB the whole files copied each time take
    assert copies.bytes < 120 * 1024, copies.bytes
    for n in (0, 1, 49, 50, 51, 99):
        restored = tmp_path / f"restored-{n}"
        restored.mkdir()
        restore(folder / str(n + 2), restored)
        assert {p.name: p.read_bytes() for p in restored.iterdir()} == expected[n], n
