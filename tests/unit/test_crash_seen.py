"""Outcomes inferred from what a restart observed (trainguard.drills.crash_seen): the states a
crash after each boundary leaves, compared on what a restart read, stat'ed, looked up and listed;
and what the FUSE daemon writes down of a restart's calls (trainguard.faults.fuseseen)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from trainguard.drills.crash_infer import explore_inferred
from trainguard.drills.crash_records import Boundary, BoundaryOutcome, CrashRow
from trainguard.drills.crash_seen import Observed, agree, crash_views, observe, read_observed
from trainguard.faults.fusefs import FuseLayer, journal


def _op(path: str, op: str, ordinal: int, to: str | None = None) -> dict[str, Any]:
    return {"event": "op", "op": op, "path": path, "rank": 0, "ordinal": ordinal, "t": 0.0, **({"to": to} if to else {})}


def _digits_like() -> list[dict[str, Any]]:
    """A save of step 5 then one of step 10: a temp file named with the writer's pid, created,
    written, renamed over the checkpoint, the directory synced."""
    ops = []
    for n, step in ((1, 5), (2, 10)):
        tmp = f"/.ckpt_{step:06d}.pt.{{pid}}.tmp"
        ops += [_op(tmp, "create", 1), _op(tmp, "write", 1), _op(tmp, "fsync", 1),
                _op(tmp, "rename", 1, f"/ckpt_{step:06d}.pt"), _op("/", "fsyncdir", n)]
    return ops


def _views() -> list[Any]:
    events = _digits_like()
    where = {(0, e["path"], e["op"], e["ordinal"]): i - 5 for i, e in enumerate(events) if i >= 5}
    return crash_views(journal(events), 5, where)


def _seen(*items: tuple[str, str], pids: tuple[int, ...] = ()) -> Observed:
    return Observed(frozenset(items), frozenset(pids))


# the restart of digits: it lists the directory, deletes the stale temp files (a lookup, no
# attribute), reads the newest checkpoint
_RESTART = (("stat", "/"), ("list", "/"), ("name", "/.ckpt_000010.pt.6800.tmp"), ("read", "/ckpt_000005.pt"),
            ("stat", "/ckpt_000005.pt"), ("name", "/ckpt_000010.pt"))


def test_a_restart_that_only_deletes_the_temp_file_sees_the_same_after_its_create_and_its_write() -> None:
    create, write, fsync, rename, _ = _views()
    seen = _seen(*_RESTART, pids=(6800,))
    assert agree(create, write, seen) and agree(create, fsync, seen)
    # after the rename the checkpoint it looks up is there, and the folder holds other names
    assert not agree(create, rename, seen)


def test_what_a_restart_read_stat_ed_or_listed_differs_where_the_crash_left_something_else() -> None:
    create, write, _, rename, fsyncdir = _views()
    # the temp file's bytes read, or its attributes returned (its size): create and write differ
    assert not agree(create, write, _seen(*_RESTART, ("read", "/.ckpt_000010.pt.6800.tmp"), pids=(6800,)))
    assert not agree(create, write, _seen(*_RESTART, ("stat", "/.ckpt_000010.pt.6800.tmp"), pids=(6800,)))
    # renamed away by the restart: all it held goes where it is read later
    assert not agree(create, write, _seen(("tree", "/.ckpt_000010.pt.6800.tmp"), pids=(6800,)))
    # a folder listed: its entries changed with the rename; the directory's fsync changes nothing
    assert not agree(write, rename, _seen(("list", "/")))
    assert agree(rename, fsyncdir, _seen(("list", "/"), ("read", "/ckpt_000010.pt")))
    # something that depends on everything (statfs)
    assert not agree(create, create, _seen(("all", "/")))


def test_names_are_the_journal_s_with_the_pids_of_the_run_that_left_the_state() -> None:
    create, write, *_ = _views()
    read_tmp = ("read", "/.ckpt_000010.pt.6800.tmp")
    assert not agree(create, write, _seen(read_tmp, pids=(6800,)))
    # the restart's own temp file (another pid) is in neither state
    assert agree(create, write, _seen(("read", "/.ckpt_000010.pt.7100.tmp"), pids=(6800,)))


def _row(b: Boundary, step: int) -> CrashRow:
    return BoundaryOutcome(b.words(), b.op, b.path, b.rank, b.ordinal, step, "safe", "")


def test_the_exploration_runs_only_boundaries_whose_state_a_run_s_restart_saw_otherwise() -> None:
    """A create, three writes, a rename: with what the create's restart observed agreeing with the
    writes' states, the writes are inferred from it (no bisection run); the rename is run."""
    chosen = [Boundary(0, "/c.tmp", "create", 1), *(Boundary(0, "/c.tmp", "write", n) for n in (1, 2, 3)),
              Boundary(0, "/c.tmp", "rename", 1, "/c")]
    states = ["create", "w1", "w2", "w3", "rename"]
    ran: list[int] = []

    def run(i: int) -> CrashRow:
        ran.append(i)
        return _row(chosen[i], 10 if i == 4 else 5)

    done = explore_inferred(chosen, states, run, lambda i, j: j == 0 and i < 4)
    assert ran == [0, 4] and sorted(done.observed) == [1, 2, 3]
    assert all(r.resumed_from_step == 5 for i, r in done.rows.items() if i < 4)
    assert "observed nothing this state holds otherwise" in str(done.rows[3].inferred_from)
    # without it: the ends of the writes are run and bisected
    ran.clear()
    explore_inferred(chosen, states, run)
    assert ran == [0, 3, 4]
    # a restart that saw the difference: each write run where the bisection asks
    ran.clear()
    done = explore_inferred(chosen, states, run, lambda i, j: False)
    assert ran == [0, 3, 4] and not done.observed


def test_the_daemon_writes_down_reads_lookups_attributes_and_listings(layer: FuseLayer, tmp_path: Path) -> None:
    (layer.backing / "ckpt.pt").write_bytes(b"weights")
    (layer.backing / "stale.tmp").write_bytes(b"half")
    file = observe(layer, "test")
    try:
        names = os.listdir(layer.point)
        kinds = {e.name: e.is_dir(follow_symlinks=False) for e in os.scandir(layer.point)}  # d_type: no stat
        with open(layer.point / "ckpt.pt", "rb") as f:
            f.read()
        os.stat(layer.point / "ckpt.pt")
        os.unlink(layer.point / "stale.tmp")
        assert not os.path.exists(layer.point / "missing.pt")
    finally:
        layer.disarm()
    lines = [json.loads(line) for line in file.read_text().splitlines()]
    seen = {(d["seen"], d["path"]) for d in lines}
    assert sorted(names) == ["ckpt.pt", "stale.tmp"] and kinds == {"ckpt.pt": False, "stale.tmp": False}
    assert {("list", "/"), ("read", "/ckpt.pt"), ("stat", "/ckpt.pt"), ("stat", "/missing.pt")} <= seen, seen
    # deleted without a look at it: its name only, never its attributes
    assert ("name", "/stale.tmp") in seen and ("stat", "/stale.tmp") not in seen and ("read", "/stale.tmp") not in seen
    observed = read_observed(file, set())
    assert observed is not None and not observed.everything
    # what the run made itself holds its own doing: calls on it after are not written down
    before = len(lines)
    layer.arm({"observe": str(file)})
    try:
        (layer.point / "stale.tmp").write_bytes(b"")  # the first run's deletion does not count for this one
        assert os.path.exists(layer.point / "stale.tmp")  # its own doing: this run made it
        assert not os.path.exists(layer.point / "gone.tmp")
        with open(layer.point / "own.tmp", "wb") as f:
            f.write(b"mine")
            os.fstat(f.fileno())
        os.stat(layer.point / "own.tmp")
        os.replace(layer.point / "own.tmp", layer.point / "ckpt.pt")
        with open(layer.point / "ckpt.pt", "rb") as f:
            f.read()
    finally:
        layer.disarm()
    later = {(d["seen"], d["path"]) for d in (json.loads(x) for x in file.read_text().splitlines()[before:])}
    assert ("name", "/own.tmp") in later and ("stat", "/gone.tmp") in later  # looked up before it was made
    assert ("name", "/stale.tmp") in later and ("stat", "/stale.tmp") not in later, later
    assert ("stat", "/own.tmp") not in later, later
    assert ("tree", "/ckpt.pt") in later and ("read", "/ckpt.pt") not in later, later
    # disarmed: nothing more is written
    written = len(file.read_text().splitlines())
    os.stat(layer.point / "ckpt.pt")
    assert len(file.read_text().splitlines()) == written


def test_an_observe_file_with_a_line_missing_observed_everything(tmp_path: Path) -> None:
    """Each line holds its number: one lost (a write that failed) or cut leaves nothing out."""
    file = tmp_path / "seen.jsonl"
    lines = [{"seen": "list", "path": "/", "n": 1}, {"seen": "read", "path": "/ckpt.pt", "n": 2}]
    file.write_text("".join(json.dumps(x) + "\n" for x in lines))
    observed = read_observed(file, set())
    assert observed is not None and not observed.everything and ("read", "/ckpt.pt") in observed.seen
    file.write_text(json.dumps(lines[1]) + "\n")
    assert read_observed(file, set()).everything  # type: ignore[union-attr]
    file.write_text(json.dumps(lines[0]) + "\n" + json.dumps(lines[1])[:20])
    assert read_observed(file, set()).everything  # type: ignore[union-attr]
    assert read_observed(tmp_path / "none.jsonl", set()) is None
