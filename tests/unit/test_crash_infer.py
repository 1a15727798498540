"""Which crash runs checks.crash_points can infer (trainguard.drills.crash_infer): the state a
crash after each boundary leaves, replayed from a journal, in kill and power mode; and the
exploration that runs one boundary per state and bisects a file's writes."""

from __future__ import annotations

from typing import Any

from trainguard.drills.crash_infer import (
    crash_states,
    explore_inferred,
    folder_segments,
    write_segments,
)
from trainguard.drills.crash_records import Boundary, BoundaryNotReached, BoundaryOutcome, CrashRow
from trainguard.faults.fusefs import journal


def _op(path: str, op: str, ordinal: int, rank: int = 0, to: str | None = None) -> dict[str, Any]:
    return {"event": "op", "op": op, "path": path, "rank": rank, "ordinal": ordinal, "t": 0.0,
            **({"to": to} if to else {})}


def _atomic(n: int, *, sync: bool = True) -> list[dict[str, Any]]:
    """save_writer.py's atomic writer (``sync``: its fsyncs; without: the rename writer)."""
    ops = [_op("/ckpt.json.tmp", "create", n), *(_op("/ckpt.json.tmp", "write", 3 * n - 2 + i) for i in range(3))]
    ops += [_op("/ckpt.json.tmp", "fsync", n)] if sync else []
    ops += [_op("/ckpt.json.tmp", "rename", n, to="/ckpt.json")]
    return ops + ([_op("/", "fsyncdir", n)] if sync else [])


def _boundaries(events: list[dict[str, Any]]) -> list[Boundary]:
    return [Boundary(e["rank"], e["path"], e["op"], e["ordinal"], e.get("to")) for e in events]


def _classes(states: list[Any]) -> list[int]:
    """Each state as the index of the first boundary that left it."""
    return [states.index(s) for s in states]


def test_a_crash_after_a_sync_leaves_what_the_operation_before_it_left_in_kill_mode() -> None:
    events = _atomic(1) + _atomic(2)
    save = _boundaries(events[7:])
    states = crash_states(journal(events), save, "kill", set())
    # create, 3 writes, fsync (= the last write), rename, fsyncdir (= the rename)
    assert _classes(states) == [0, 1, 2, 3, 3, 5, 5]


def test_in_power_mode_what_is_not_durable_is_dropped_before_states_are_compared() -> None:
    events = _atomic(1) + _atomic(2)
    save = _boundaries(events[7:])
    # until the directory's fsync the temp file's entry and the rename are undone: the state is
    # the save before's, whatever was written; after it, the new checkpoint
    assert _classes(crash_states(journal(events), save, "power", set())) == [0, 0, 0, 0, 0, 0, 6]
    # no fsync at all: nothing is ever durable, every crash leaves an empty directory
    events = _atomic(1, sync=False) + _atomic(2, sync=False)
    states = crash_states(journal(events), _boundaries(events[5:]), "power", set())
    assert _classes(states) == [0] * 5 and states[0] == frozenset()
    # in kill mode each of them leaves something else
    assert _classes(crash_states(journal(events), _boundaries(events[5:]), "kill", set())) == [0, 1, 2, 3, 4]


def test_a_log_written_between_two_boundaries_does_not_part_their_states() -> None:
    events = [*_atomic(1)[:4], _op("/train.log", "write", 1), *_atomic(1)[4:]]
    save = _boundaries([e for e in events if e["path"] != "/train.log"])
    assert _classes(crash_states(journal(events), save, "kill", {"/train.log"}))[3:5] == [3, 3]
    assert _classes(crash_states(journal(events), save, "kill", set()))[3:5] == [3, 4]


def _row(b: Boundary, outcome: str, resumed: int | None) -> BoundaryOutcome:
    return BoundaryOutcome(b.words(), b.op, b.path, b.rank, b.ordinal, resumed, outcome, "")  # type: ignore[arg-type]


def _explore(save: list[Boundary], truth: dict[int, tuple[str, int | None]],
             states: list[Any] | None = None, folders: bool = False) -> tuple[list[CrashRow], list[int]]:
    ran: list[int] = []

    def run(i: int) -> CrashRow:
        ran.append(i)
        if i not in truth:
            return BoundaryNotReached(save[i].words(), save[i].op, save[i].path, 0, 1, "not reached", None, "")
        return _row(save[i], *truth[i])

    done = explore_inferred(save, states if states is not None else [None] * len(save), run, folders=folders)
    return [done.rows[i] for i in range(len(save))], ran


def test_a_file_written_in_many_writes_is_bisected_and_its_change_of_outcome_found_exactly() -> None:
    save = [Boundary(0, "/big.pt", "truncate", 1)] + [Boundary(0, "/big.pt", "write", i) for i in range(1, 40)]
    assert write_segments(save) == [(0, 39)]
    # in place: a restart fails until write 25, then the file loads
    truth = {i: (("crashed on load", None) if i < 25 else ("safe", 10)) for i in range(40)}
    rows, ran = _explore(save, truth)
    assert [(r.outcome, r.resumed_from_step) for r in rows] == [truth[i] for i in range(40)]
    assert 24 in ran and 25 in ran and len(ran) <= 8, ran
    assert all(r.inferred_from for i, r in enumerate(rows) if i not in ran)
    assert "whose restarts did the same" in str(rows[1].inferred_from)
    # the same outcome at both ends: two runs
    rows, ran = _explore(save, dict.fromkeys(range(40), ("safe", 5)))
    assert ran == [0, 39] and {r.outcome for r in rows} == {"safe"}


def test_boundaries_of_one_state_take_the_outcome_of_the_one_run() -> None:
    events = _atomic(1) + _atomic(2)
    save = _boundaries(events[7:])
    states = crash_states(journal(events), save, "kill", set())
    truth = {i: ("safe", 5 if i < 5 else 10) for i in range(7)}
    rows, ran = _explore(save, truth, states)
    # create and the last write (the writes between them bisected), the rename; fsync and fsyncdir inferred
    assert ran == [0, 3, 5], ran
    assert [r.resumed_from_step for r in rows] == [5] * 5 + [10] * 2
    assert rows[4].inferred_from == f"the same state as the crash {save[3].words()}"
    assert isinstance(rows[4], BoundaryOutcome) and rows[4].boundary == save[4].words() and rows[4].op == "fsync"


def test_a_boundary_not_reached_is_never_the_source_of_an_inference() -> None:
    save = [Boundary(0, "/c", "create", 1)] + [Boundary(0, "/c", "write", i) for i in range(1, 6)]
    truth = {i: ("safe", 5) for i in range(5)}  # the last write never reached
    rows, ran = _explore(save, truth)
    assert [r.outcome for r in rows] == ["safe"] * 5 + ["not reached"]
    # a write next to it is run, not taken from it
    assert 4 in ran and 5 in ran and not isinstance(rows[-1], BoundaryOutcome)


def _sharded(n: int) -> list[dict[str, Any]]:
    """A DCP-like save of two ranks into a folder of its own: the folder, each rank's shard
    (created, written twice, fsynced), the metadata's temp file, its rename; then a marker."""
    folder = f"/step_{n:02d}"
    ops = [_op(folder, "mkdir", n)]
    ops += [_op(f"{folder}/r{r}.distcp", "create", n, r) for r in (0, 1)]
    ops += [_op(f"{folder}/r{r}.distcp", "write", 2 * n + w, r) for w in (0, 1) for r in (0, 1)]
    ops += [_op(f"{folder}/r{r}.distcp", "fsync", n, r) for r in (0, 1)]
    ops += [_op(f"{folder}/.metadata.tmp", "create", n), _op(f"{folder}/.metadata.tmp", "write", 9 * n),
            _op(f"{folder}/.metadata.tmp", "rename", n, to=f"{folder}/.metadata"), _op(f"{folder}/COMPLETE", "create", n)]
    return ops


def test_a_folder_filled_by_a_save_is_one_segment_until_an_entry_in_it_is_renamed() -> None:
    events = _sharded(5) + _sharded(10)
    save = _boundaries(events[13:])
    states = crash_states(journal(events), save, "kill", set())
    # the mkdir through the metadata's last write: entries added, files written, nothing else
    assert folder_segments(save, states) == [(0, 10)]
    # an entry removed in it ends the filling: the boundary after is not in the segment
    events = _sharded(5) + _sharded(10)[:4] + [_op("/step_10/r0.distcp", "unlink", 1)] + _sharded(10)[4:]
    save = _boundaries(events[13:])
    assert folder_segments(save, crash_states(journal(events), save, "kill", set())) == [(0, 3)]
    # a change outside the folder ends it too (a file written beside it)
    events = _sharded(5) + _sharded(10)[:4] + [_op("/latest.txt", "create", 1)] + _sharded(10)[4:]
    save = _boundaries(events[13:])
    assert folder_segments(save, crash_states(journal(events), save, "kill", set())) == [(0, 3)]
    # no folder made: no segment
    save = _boundaries(_sharded(10)[1:])
    assert folder_segments(save, crash_states(journal(_sharded(10)), save, "kill", set())) == []


def test_a_folder_filling_is_bisected_and_the_first_boundary_a_restart_loads_is_found_exactly() -> None:
    events = _sharded(5) + _sharded(10)
    save = _boundaries(events[13:])
    states = crash_states(journal(events), save, "kill", set())
    # a restart that deletes the unfinished folder: every crash resumes from step 5 until the
    # marker; bisected, the mkdir and the metadata's last write run, the rename and the marker too
    safe = {i: ("safe", 5 if i < 12 else 10) for i in range(13)}
    rows, ran = _explore(save, safe, states, folders=True)
    assert [(r.outcome, r.resumed_from_step) for r in rows] == [safe[i] for i in range(13)]
    assert ran == [0, 10, 11, 12], ran
    assert "whose restarts did the same" in str(rows[5].inferred_from)
    # a restart that loads the newest folder as soon as rank 1's shard exists (a folder written in
    # place): it fails from that create on; the change is found where it is, by a run
    broken = {i: ("safe", 5) if i < 2 else ("crashed on load", None) for i in range(13)}
    rows, ran = _explore(save, broken, states, folders=True)
    assert [(r.outcome, r.resumed_from_step) for r in rows] == [broken[i] for i in range(13)]
    assert 1 in ran and 2 in ran and len(ran) < 13, ran
    # without ``folders`` (power mode) each boundary of the filling is run
    _, ran = _explore(save, safe, states)
    assert len(ran) > 4, ran
