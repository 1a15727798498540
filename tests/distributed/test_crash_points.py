"""checks.crash_points on a tiny job whose only point is how it writes its checkpoint
(tests/data/jobs/save_writer.py, a save every 5 steps of 0.1 s): each boundary of the first save
after step 7 crashed and resumed. ``gap_s: 0.3``: a busy machine may stall a writer between two
of its writes, never for the half second between two saves.

The default run holds the clean writer (temp file, fsync, rename, directory fsync: every
boundary safe), the one written in place (unsafe at its first operation, the fix named) and the
one that renames without any fsync in power-loss mode (it loses even the checkpoint before the
save); the clean writer in power-loss mode and the other writers in kill mode are ``slow``."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from tests.helpers import report_evidence
from trainguard.drills.crash_points import choose_boundaries
from trainguard.drills.crash_records import Boundary, BoundaryOutcome
from trainguard.faults.fusefs import fuse_unavailable, journal
from trainguard.report import CheckResult
from trainguard.session import check

WRITER = Path(__file__).resolve().parents[1] / "data" / "jobs" / "save_writer.py"
_NO_FUSE = fuse_unavailable()
needs_fuse = pytest.mark.skipif(_NO_FUSE is not None, reason=f"no FUSE layer here: {_NO_FUSE}")

JOB = """\
job:
  name: writer-{writer}
  command: "python {script} --steps {{steps}} --seed {{seed}} --ckpt-dir {{checkpoint_dir}} --writer {writer} --sleep 0.1{extra}"
  resume_args: "--resume"
  world_size: {world}
  metrics:
    loss: 'step (?P<step>\\d+) loss (?P<value>\\S+)'
  timeout: 60
  stall_timeout: 20
checks:
  crash_points: {{steps: {steps}, after_step: {after}, mode: {mode}, gap_s: 0.3, max_boundaries: {limit}, infer: {infer}, state_copies_mib: {copies}, lanes: {lanes}}}
"""


def writer_job(tmp_path: Path, writer: str, mode: str = "kill", *, limit: int = 16, extra: str = "",
               world: int = 1, after: int = 7, steps: int = 20, infer: bool = True, copies: int = 256,
               lanes: int | None = None) -> Path:
    """The job file of save_writer.py with ``--writer writer`` and its crash_points check."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / "trainguard.yaml"
    path.write_text(JOB.format(writer=writer, script=WRITER, mode=mode, limit=limit, extra=extra, world=world,
                               after=after, steps=steps, infer=str(infer).lower(), copies=copies,
                               lanes="null" if lanes is None else lanes))
    return path


def _crash_points(tmp_path: Path, writer: str, mode: str = "kill", *, limit: int = 16, extra: str = "",
                  world: int = 1, after: int = 7, steps: int = 20, infer: bool = True, copies: int = 256,
                  lanes: int | None = None) -> CheckResult:
    path = writer_job(tmp_path, writer, mode, limit=limit, extra=extra, world=world, after=after, steps=steps,
                      infer=infer, copies=copies, lanes=lanes)
    report = check(path, only=["crash_points"], report_json=str(path.parent / "report.json"))
    (result,) = report.checks
    # the report on disk says what the result says
    saved = json.loads((path.parent / "report.json").read_text())["checks"][0]
    assert saved["status"] == result.status
    return result


@needs_fuse
@pytest.mark.timeout(240)
def test_a_writer_that_renames_a_synced_temp_file_is_safe_at_every_boundary(tmp_path: Path) -> None:
    result = _crash_points(tmp_path, "atomic")
    assert result.status == "passed", result.summary
    ev = report_evidence(result)
    assert ev["boundaries_found"] == ev["boundaries_explored"] == 7, ev["by_op"]
    assert ev["by_op"] == {"create": 1, "write": 3, "fsync": 1, "rename": 1, "fsyncdir": 1}
    # before the rename the restart resumes from the checkpoint before the save, after it from the
    # save's own (the save at step 10, or at 15 when the line of step 7 was read late)
    resumed = [o["resumed_from_step"] for o in ev["outcomes"]]
    assert resumed[0] in (5, 10) and resumed == [resumed[0]] * 5 + [resumed[0] + 5] * 2, ev["outcomes"]
    # the save of step 10 (or 15) began after the line of step 9 (or an earlier one read late)
    assert resumed[0] <= ev["save_after_step"] < resumed[-1], ev["save_after_step"]
    # 2 restarts, each on the state the recording run left right after its boundary (no crash
    # run): the create and the rename. The create's restart opened ckpt.json and made the temp
    # file anew (O_TRUNC): it observed nothing of the temp file but its name, so the writes and
    # the fsync, which leave another temp file only, take its outcome (crash_seen); the directory's
    # fsync leaves what the rename left (kill mode). The restart that finds what a resume reads ran
    # on the state the save left: it is the rename's, so the recording and 2 restarts in all
    assert (ev["runs"], ev["inferred"], ev["inferred_observed"]) == (1 + 2, 5, 4), ev["outcomes"]
    inferred = {o["op"]: o["inferred_from"] for o in ev["outcomes"] if "inferred_from" in o}
    assert inferred["fsync"].startswith("the restart after the crash rank 0: after create #") and (
        "observed nothing this state holds otherwise" in inferred["fsync"]), inferred["fsync"]
    assert inferred["fsyncdir"].startswith("the same state as the crash rank 0: after rename")
    assert ("explored in 3 runs, 5 boundaries inferred (no run of their own, 4 of them from what a restart "
            "observed)") in result.summary
    assert ev["start"].endswith("; 0 crash runs started there; 2 boundaries restarted on the state the "
                                "recording run left right after them (no crash run)"), ev["start"]
    # the table for people: a row per boundary, under the verdict
    table = Path(ev["table"]).read_text().splitlines()
    assert table[2].startswith("PASSED: 7 of 7 boundaries") and len(table) == 6 + 7
    assert table[-1].startswith("| rank 0: after fsyncdir #") and "of / | safe |" in table[-1], table[-1]


@needs_fuse
@pytest.mark.timeout(240)
def test_a_checkpoint_written_in_place_is_unsafe_from_its_first_operation(tmp_path: Path) -> None:
    result = _crash_points(tmp_path, "inplace")
    assert result.status == "failed", result.summary
    first = report_evidence(result)["first_unsafe"]
    assert (first["op"], first["path"], first["outcome"]) == ("truncate", "/ckpt.json", "crashed on load"), first
    assert "JSONDecodeError" in first["detail"]
    assert "rename it over the old one" in report_evidence(result)["fix"]


@needs_fuse
@pytest.mark.timeout(240)
@pytest.mark.parametrize("writer", [pytest.param("folder-marker", marks=pytest.mark.slow), "folder-newest"])
def test_a_folder_filled_by_a_save_is_bisected_and_its_first_unsafe_boundary_found(tmp_path: Path, writer: str) -> None:
    """A save into a folder of its own (as DCP's): its mkdir and the files made and written in it
    are one segment (crash_infer.folder_segments). With a marker written last the restart deletes
    the unfinished folder, which it lists, so no restart's observations infer the others: the two
    ends of the filling are run and the boundaries between take their outcome. Without a marker
    the restart loads the newest folder: unsafe from the mkdir on, safe once both parts are
    complete; the change is found by runs on both sides of it."""
    result = _crash_points(tmp_path, writer)
    ev = report_evidence(result)
    outcomes = [(o["op"], o["outcome"], "inferred_from" in o) for o in ev["outcomes"]]
    between = [o for o in ev["outcomes"] if "whose restarts did the same" in o.get("inferred_from", "")]
    if writer == "folder-marker":
        assert result.status == "passed", result.summary
        # mkdir, two parts (create, 2 writes, fsync each), the marker (create, write, fsync), fsyncdir
        assert ev["boundaries_found"] == 13, ev["by_op"]
        assert len(between) >= 5 and ev["runs"] <= 6, (ev["runs"], outcomes)
        return
    assert result.status == "failed", result.summary
    # the save of step 10 (or of 15, when the line of step 7 was read late)
    first = ev["first_unsafe"]
    assert (first["op"], first["outcome"]) == ("mkdir", "crashed on load") and first["path"] in ("/step_0010", "/step_0015")
    saved = int(first["path"].rsplit("_", 1)[1])
    assert f"build {first['path']} under a temporary name" in ev["fix"]
    # the last part's last write completes the folder: from there the restart resumes from it.
    # Where the outcome changes, the boundary before was run, and the one after was run or leaves
    # the state of one that was (the directory's fsync, in kill mode): never taken from a bisection
    changes = [i for i in range(1, len(outcomes)) if outcomes[i][1] != outcomes[i - 1][1]]
    assert len(changes) == 1 and not outcomes[changes[0] - 1][2], outcomes
    change = ev["outcomes"][changes[0]]
    assert (change["op"], change["resumed_from_step"]) == ("write", saved), ev["outcomes"]
    assert change.get("inferred_from", "the same state as").startswith("the same state as"), change
    assert len(between) >= 3 and ev["runs"] < 10, (ev["runs"], outcomes)


@needs_fuse
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_restart_that_reads_nothing_on_the_last_boundary_explored_is_made_again_on_the_saves_end(
        tmp_path: Path) -> None:
    """The recording's restart runs on the state the last boundary explored left (its restart
    stands for that boundary's); the first save, its file not renamed into place yet there,
    gives a restart nothing to read, so it is made again on the state the save's last operation
    left, where it reads the checkpoint (crash_points._record's fallback)."""
    # 0.3 s a step: the save of step 5 begins a second after the line of step 2, whatever the load
    result = _crash_points(tmp_path, "atomic", limit=2, after=2, steps=8, extra=" --sleep 0.3")
    assert result.status == "passed", result.summary
    ev = report_evidence(result)
    assert ev["reads"] == ["/ckpt.json"] and ev["boundaries_explored"] == 2, ev
    # the recording, its restart on the fsync's state (nothing read), its restart on the
    # directory's fsync's (the checkpoint read), and the boundaries' own restarts
    assert ev["runs"] >= 4 and [o["op"] for o in ev["outcomes"]] == ["create", "fsync"], ev["outcomes"]
    assert all(o["outcome"] == "safe" and o["resumed_from_step"] == 0 for o in ev["outcomes"]), ev["outcomes"]


@needs_fuse
@pytest.mark.slow  # issue 42 paid for its crash_points cases with it: a no-false-alarm case, 14 s
@pytest.mark.timeout(240)
def test_a_resume_that_is_never_exact_is_not_called_a_torn_checkpoint(tmp_path: Path) -> None:
    """The careful writer with a resume that never matches the uninterrupted run: every restart
    diverges, and so does the control (a kill just before the save began): no boundary is called
    torn, and the check says it cannot judge instead of passing."""
    result = _crash_points(tmp_path, "atomic", limit=2, extra=" --inexact-resume")
    assert result.status == "error", result.summary
    ev = report_evidence(result)
    assert [o["outcome"] for o in ev["outcomes"]] == ["loaded", "loaded"], ev["outcomes"]
    assert ev["control"]["outcome"] == "torn" and ev["control"]["resumed_from_step"] == ev["outcomes"][0]["resumed_from_step"]
    assert ev["first_unsafe"] is None and "resume is not exact" in result.summary
    # the recording and its restart, a restart on the state it left after the create (no crash
    # run), the control and its restart; the fsync takes the create's outcome: that restart made the
    # temp file anew and observed nothing else of it (crash_seen)
    assert ev["runs"] == 2 + 1 + 2 and ev["inferred_observed"] == 1, ev["outcomes"]
    assert ev["start"].endswith("1 boundaries restarted on the state the recording run left right after them "
                                "(no crash run)"), ev["start"]


@needs_fuse
@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize(("writer", "status", "first_op"), [("rename", "passed", None),
                                                              ("unlink-first", "failed", "unlink")])
def test_other_writers_in_kill_mode(tmp_path: Path, writer: str, status: str, first_op: str | None) -> None:
    result = _crash_points(tmp_path, writer)
    assert result.status == status, result.summary
    if first_op is not None:
        assert report_evidence(result)["first_unsafe"]["op"] == first_op
        assert report_evidence(result)["first_unsafe"]["outcome"] == "began again"


@needs_fuse
@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize(("writer", "mode"), [("unlink-first", "kill"), ("rename", "kill"), ("atomic", "power"),
                                              ("sharded-newest", "kill"), ("sharded-marker", "kill"),
                                              ("inplace", "kill"), ("folder-marker", "kill"),
                                              ("folder-newest", "kill")])
def test_inferred_outcomes_are_the_ones_every_boundary_run_finds(tmp_path: Path, writer: str, mode: str) -> None:
    """The same check with ``infer: false`` and no state copies (every boundary crashed in a run of
    its own, then restarted) and as it is: the same verdict, the same first unsafe boundary and the
    same outcome at every boundary, in fewer runs."""
    world = 2 if writer.startswith("sharded") else 1
    every = _crash_points(tmp_path / "every", writer, mode, extra="", world=world, infer=False, copies=0)
    inferred = _crash_points(tmp_path / "inferred", writer, mode, world=world)
    old, new = report_evidence(every), report_evidence(inferred)
    assert inferred.status == every.status, (inferred.summary, every.summary)
    assert (new["first_unsafe"] or {}).get("boundary") == (old["first_unsafe"] or {}).get("boundary")
    # sorted: two ranks' operations interleave differently from one recording to the next
    assert sorted((o["boundary"], o["outcome"], o["resumed_from_step"]) for o in new["outcomes"]) == sorted(
        (o["boundary"], o["outcome"], o["resumed_from_step"]) for o in old["outcomes"])
    # fewer runs: boundaries inferred, and each one run restarted on its recorded state (the
    # in-place writer leaves a new state at every boundary: nothing inferred)
    assert old["inferred"] == 0 and new["runs"] < old["runs"], (new["runs"], old["runs"])
    assert "restarted on the state the recording run left" in new["start"] or mode == "power", new["start"]


def _in_save(words: str) -> str:
    """A boundary's words without its ordinal (``after write #4 of``: ``after write of``)."""
    return re.sub(r" #\d+", "", words)


def _rows_in_save(ev: dict[str, Any]) -> list[tuple[Any, ...]]:
    """Each row's boundary, outcome, step resumed from (counted from the first row's) and where it
    was inferred from, as they stand within the save."""
    base = next((o["resumed_from_step"] for o in ev["outcomes"] if o["resumed_from_step"] is not None), 0)
    return [(_in_save(o["boundary"]), o["outcome"], None if o["resumed_from_step"] is None else o["resumed_from_step"] - base,
             _in_save(o.get("inferred_from", ""))) for o in ev["outcomes"]]


@needs_fuse
@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize(("writer", "mode", "infer"), [("unlink-first", "kill", False), ("atomic", "power", True)])
def test_boundaries_side_by_side_find_what_one_after_the_other_finds(tmp_path: Path, writer: str, mode: str,
                                                                    infer: bool) -> None:
    """Crash runs and restarts (no state copies) of the boundaries that do not depend on each
    other made two at a time, each lane in a FUSE layer of its own, and one after the other
    (``lanes: 1``): the same verdict, first unsafe boundary, outcome at every boundary and runs.
    In kill mode with ``infer`` a boundary waits for the runs before it (what their restarts
    observed may decide it: crash_seen), so every boundary is run there (``infer: false``)."""
    alone = _crash_points(tmp_path / "alone", writer, mode, copies=0, lanes=1, infer=infer)
    beside = _crash_points(tmp_path / "beside", writer, mode, copies=0, lanes=2, infer=infer)
    old, new = report_evidence(alone), report_evidence(beside)
    assert (old["lanes"], new["lanes"]) == (1, 2)
    assert beside.status == alone.status, (beside.summary, alone.summary)
    # each check records its own save: the one at step 10, or at 15 when the line of step 7 was
    # read late, so ordinals and steps are compared as they stand within the save
    assert _in_save((new["first_unsafe"] or {}).get("boundary", "")) == _in_save((old["first_unsafe"] or {}).get("boundary", ""))
    assert _rows_in_save(new) == _rows_in_save(old)
    assert new["runs"] == old["runs"], (new["runs"], old["runs"])
    # every lane's layer unmounted: the check's work directory holds lane-1, not mounted
    work = Path(new["work_dir"])
    assert (work / "lane-1").is_dir() and str(work / "lane-1" / "mnt") not in Path("/proc/mounts").read_text()


def test_above_the_limit_every_other_operation_first_then_writes_spread_over_each_file() -> None:
    found = [Boundary(0, "/a.tmp", "create", 1)]
    found += [Boundary(0, "/a.tmp", "write", i) for i in range(1, 21)]
    found += [Boundary(0, "/a.tmp", "fsync", 1), Boundary(0, "/a.tmp", "rename", 1, "/a")]
    assert choose_boundaries(found, 100) == found
    chosen = choose_boundaries(found, 8)
    assert len(chosen) == 8 and chosen == sorted(chosen, key=found.index)
    assert {b.op for b in chosen} == {"create", "write", "fsync", "rename"}
    writes = [b.ordinal for b in chosen if b.op == "write"]
    assert writes[0] == 1 and 20 in writes and len(writes) == 5
    assert len(choose_boundaries(found, 2)) == 2


@needs_fuse
@pytest.mark.timeout(240)
def test_a_writer_without_fsync_loses_its_checkpoints_to_a_power_loss(tmp_path: Path) -> None:
    """Safe from a process crash (the slow test below), not from a power loss: nothing it wrote
    was ever durable, the checkpoint before the save included."""
    result = _crash_points(tmp_path, "rename", "power", limit=3)
    assert result.status == "failed", result.summary
    first = report_evidence(result)["first_unsafe"]
    assert first["outcome"] == "began again" and first["undone"] > 0, first
    assert "fsync /ckpt.json.tmp before renaming it" in report_evidence(result)["fix"]
    assert report_evidence(result)["start"].startswith("step 1: in power-loss mode")
    assert "fsync the directory after renaming into /ckpt.json" in report_evidence(result)["fix"]


@needs_fuse
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_careful_writer_survives_a_power_loss_at_every_boundary(tmp_path: Path) -> None:
    result = _crash_points(tmp_path, "atomic", "power")
    assert result.status == "passed", result.summary
    resumed = [o["resumed_from_step"] for o in report_evidence(result)["outcomes"]]
    # until the directory's fsync a power loss forgets the rename: only the last resumes the save's
    assert resumed[:-1] == [resumed[0]] * 6 and resumed[-1] == resumed[0] + 5, report_evidence(result)["outcomes"]


def _op(path: str, op: str, ordinal: int, t0: float, t: float | None = None) -> dict:
    return {"event": "op", "op": op, "path": path, "rank": 0, "ordinal": ordinal, "t0": t0, "t": t if t is not None else t0}


def _save(at: float, n: int, *, fsync_s: float = 0.0) -> list[dict]:
    """One save at time ``at``: create, 3 writes, fsync (lasting ``fsync_s``), rename."""
    return [_op("/c.tmp", "create", n, at), *(_op("/c.tmp", "write", 3 * n - 2 + i, at + 0.001 * (i + 1)) for i in range(3)),
            _op("/c.tmp", "fsync", n, at + 0.004, at + 0.004 + fsync_s), _op("/c.tmp", "rename", n, at + 0.005 + fsync_s)]


def _save_ops(events: list[dict[str, Any]], *args: Any) -> Any:
    """The save explored in the journal lines ``events``."""
    from trainguard.drills import crash_points

    return crash_points._save_ops(journal(events), *args)


def test_the_save_explored_is_whole_and_saves_a_line_apart_are_apart() -> None:
    # a save every step (0.1 s apart, closer than gap_s): the step lines read between them part them
    events = _save(1.0, 1) + _save(1.1, 2) + _save(1.2, 3)
    lines = [(7, 1.05), (8, 1.15), (9, 1.25)]
    found = _save_ops(events, lines, 7, 0.25)
    assert [(b.op, b.ordinal) for b in found.boundaries] == [("create", 2), ("write", 4), ("write", 5), ("write", 6),
                                                             ("fsync", 2), ("rename", 2)] and found.checkpoint_before
    # a line read late, in the middle of a save, does not split it: the save is left to the next
    save = _save_ops(_save(1.0, 1) + _save(1.5, 2), [(7, 1.0025)], 7, 0.25).boundaries
    assert {b.ordinal for b in save if b.op == "create"} == {2} and len(save) == 6
    # a slow fsync does not split a save: the gap is from one operation's end to the next's start
    found = _save_ops(_save(2.0, 1, fsync_s=3.0), [(7, 1.0)], 7, 0.25)
    assert len(found.boundaries) == 6 and not found.checkpoint_before
    # a tiny job's saves 10 ms apart (closer than the 20 ms a late line is forgiven): the next
    # save creates (or truncates) its file again, and a line read between parts it from the last
    # (nanoGPT's tiny run found no save in 3 of 12 runs before)
    saves = [e for n in range(4) for e in _save(1.0 + 0.015 * n, n + 1)]
    found = _save_ops(saves, [(6, 1.008), (7, 1.010), (8, 1.025), (9, 1.040)], 7, 0.25)
    assert {b.ordinal for b in found.boundaries if b.op == "create"} == {2} and len(found.boundaries) == 6
    in_place = [e for n in range(3) for e in (_op("/c", "truncate", n + 1, 1.0 + 0.015 * n),
                                               _op("/c", "write", n + 1, 1.001 + 0.015 * n))]
    found = _save_ops(in_place, [(7, 1.010), (8, 1.025)], 7, 0.25)
    assert [(b.op, b.ordinal) for b in found.boundaries] == [("truncate", 2), ("write", 2)]
    # ... and a save every 5 steps of 3 ms, each into files named with its step (digits on a quiet
    # machine: the step-5, 10, 15 and 20 saves were one burst, "no save began after step 7")
    def numbered(step: int, at: float) -> list[dict]:
        return [_op(f"/.c_{step:04d}.sum", "create", 1, at), _op(f"/.c_{step:04d}.sum", "write", 1, at + 0.001),
                _op(f"/c_{step:04d}.tmp", "create", 1, at + 0.002), _op(f"/c_{step:04d}.tmp", "write", 1, at + 0.003),
                _op(f"/c_{step:04d}.tmp", "rename", 1, at + 0.004)]
    events = [e for k, step in enumerate((5, 10, 15, 20)) for e in numbered(step, 1.0 + 0.017 * k)]
    found = _save_ops(events, [(s, 0.997 + 0.0034 * (s - 4)) for s in range(5, 21)], 7, 0.25)
    assert {b.path for b in found.boundaries} == {"/.c_0010.sum", "/c_0010.tmp"} and len(found.boundaries) == 5
    # no save after the step: nothing to explore
    found = _save_ops(_save(1.0, 1), [(7, 1.5)], 7, 0.25)
    assert found.boundaries == [] and found.checkpoint_before
    # a save into a folder of its own that finishes in the background: the files written while
    # the next steps run and the marker committed at the next save belong to it; the next
    # save's own folder and the pruning of an old one do not
    events = [_op("/step_10", "mkdir", 1, 2.0), _op("/step_10/a.distcp", "create", 1, 2.01),
              _op("/step_10/a.distcp", "write", 1, 2.6), _op("/step_10/.metadata", "create", 1, 3.2),
              _op("/step_15", "mkdir", 1, 5.0), _op("/step_10/COMPLETE", "create", 1, 5.01),
              _op("/step_05/a.distcp", "unlink", 1, 5.02), _op("/step_15/a.distcp", "create", 1, 5.03)]
    save = _save_ops(events, [(7, 1.0), (11, 2.3), (12, 2.9)], 7, 0.25).boundaries
    assert [b.path for b in save] == ["/step_10", "/step_10/a.distcp", "/step_10/a.distcp", "/step_10/.metadata",
                                      "/step_10/COMPLETE"]
    # ... also when its background writes run into the next save with no gap and no line read
    # between (the async FSDP2 save explored as two or three saves, 1357 or 2034 boundaries): the
    # next save's folder begins the next save
    events = [_op("/step_10", "mkdir", 1, 2.0), *(_op("/step_10/a.distcp", "write", i, 2.0 + 0.01 * i) for i in range(1, 50)),
              _op("/step_10/COMPLETE", "create", 1, 2.5), _op("/step_15", "mkdir", 1, 2.51),
              *(_op("/step_15/a.distcp", "write", i, 2.51 + 0.01 * i) for i in range(1, 50))]
    save = _save_ops(events, [(7, 1.0)], 7, 0.25).boundaries
    assert {b.path for b in save} == {"/step_10", "/step_10/a.distcp", "/step_10/COMPLETE"} and len(save) == 51
    # ... and when the save before's background writes, begun before the line, run into it: the
    # folder it makes begins the save (the async save explored the save of step 15 instead)
    events = [_op("/step_05", "mkdir", 1, 0.1), *(_op("/step_05/a.distcp", "write", i, 0.5 + 0.01 * i) for i in range(1, 150)),
              _op("/step_05/COMPLETE", "create", 1, 2.0), *events]
    save = _save_ops(events, [(7, 1.0)], 7, 0.25).boundaries
    assert {b.path for b in save} == {"/step_10", "/step_10/a.distcp", "/step_10/COMPLETE"} and len(save) == 51
    # an old folder pruned before the new one is made is in the save (deleting a checkpoint before
    # the next is complete is what the check is for): a deletion names no folder of a save
    events = [_op("/step_05/a.distcp", "unlink", 1, 2.0), _op("/step_05", "rmdir", 1, 2.01),
              _op("/step_10", "mkdir", 1, 2.02), _op("/step_10/a.distcp", "create", 1, 2.03)]
    save = _save_ops(events, [(7, 1.0)], 7, 0.25).boundaries
    assert [b.op for b in save] == ["unlink", "rmdir", "mkdir", "create"], save
    # two ranks saving in turn: rank 0's next step line, read before rank 1 saves, parts nothing
    rank1 = [{**e, "rank": 1} for e in _save(1.3, 1)]
    save = _save_ops(_save(1.0, 1) + _save(1.2, 2) + rank1, [(7, 1.1), (10, 1.25)], 7, 0.25).boundaries
    assert [(b.rank, b.op) for b in save][5:7] == [(0, "rename"), (1, "create")] and len(save) == 12
    # after the line, an async save's marker committing an earlier folder starts no save: the
    # save explored is the next one, which makes a folder of its own
    events = [_op("/step_05", "mkdir", 1, 1.0), _op("/step_05/a.distcp", "create", 1, 1.01),
              _op("/step_05/COMPLETE", "create", 1, 2.0), _op("/step_10", "mkdir", 1, 3.0),
              _op("/step_10/a.distcp", "create", 1, 3.01)]
    save = _save_ops(events, [(7, 1.5)], 7, 0.25).boundaries
    assert [b.path for b in save] == ["/step_10", "/step_10/a.distcp"]
    # a directory made at start-up is no checkpoint before the save
    found = _save_ops([_op("/ckpts", "mkdir", 1, 0.5), *_save(2.0, 1)], [(7, 1.0)], 7, 0.25)
    assert len(found.boundaries) == 6 and not found.checkpoint_before




def test_the_save_explored_writes_what_a_restart_reads_never_a_log() -> None:
    """A line appended to train.log at every step makes a burst of its own after each step line;
    the save explored is the first burst that writes a file a restart opens (ckpt.json), the log
    lines before it are no checkpoint, and a log opened to append is never the save, even when
    the restart reads it too. Saves into numbered folders match the restart's reads of the
    newest folder (numbers aside)."""
    log = [_op("/train.log", "write", i, 0.95 + 0.1 * i) for i in range(1, 12)]
    # step 6 saves, then logs, then prints its line
    save = [*_save(1.52, 1)[:-1], {**_save(1.52, 1)[-1], "to": "/ckpt.json"}]
    events = sorted(log + save, key=lambda e: e["t0"])
    lines = [(i, 0.96 + 0.1 * i) for i in range(1, 12)]
    assert [b.path for b in _save_ops(events, lines, 3, 0.25).boundaries] == ["/train.log"]  # any burst: the log's
    found = _save_ops(events, lines, 3, 0.25, {"/ckpt.json"})
    assert [(b.op, b.path) for b in found.boundaries][4:] == [("fsync", "/c.tmp"), ("rename", "/c.tmp"),
                                                              ("write", "/train.log")]
    assert not found.checkpoint_before and found.last
    # the restart opens the log too, to append: still not the save
    found = _save_ops(events, lines, 3, 0.25, {"/ckpt.json", "/train.log"}, {"/train.log"})
    assert found.boundaries[0].path == "/c.tmp"
    folder = [_op("/iter_0000010", "mkdir", 1, 1.52), _op("/iter_0000010/model.json", "create", 1, 1.521)]
    found = _save_ops(sorted(log + folder, key=lambda e: e["t0"]), lines, 3, 0.25, {"/iter_#/model.json"})
    assert [b.path for b in found.boundaries] == ["/iter_0000010", "/iter_0000010/model.json", "/train.log"]
    assert _save_ops(events, lines, 3, 0.25, {"/other.pt"}).boundaries == []


@needs_fuse
@pytest.mark.timeout(240)
def test_two_ranks_that_save_without_a_commit_marker_resume_from_different_steps(tmp_path: Path) -> None:
    """Each rank renames its own shard into place, rank 0 first, and a restart loads each rank's
    newest: a crash between the two renames resumes rank 0 from the save and rank 1 from the one
    before. Four boundaries are explored: the operations that are not writes, in order."""
    result = _crash_points(tmp_path, "sharded-newest", limit=4, world=2)
    assert result.status == "failed", result.summary
    ev = report_evidence(result)
    assert ev["boundaries_found"] == 10 and ev["boundaries_explored"] == 4, ev["by_op"]
    # rank 0's create, fsync and rename come first; rank 1 starts once rank 0's file is in place
    assert [(o["rank"], o["op"]) for o in ev["outcomes"][:3]] == [(0, "create"), (0, "fsync"), (0, "rename")]
    first = ev["first_unsafe"]
    assert (first["op"], first["path"], first["outcome"]) == ("rename", "/ckpt-0010.rank0.json.tmp", "torn"), first
    low, high = sorted(first["ranks_resumed_from"].values())
    assert (first["ranks_resumed_from"]["0"], first["ranks_resumed_from"]["1"]) == (high, low) and high == low + 5
    assert ev["outcomes"][0]["outcome"] == "safe"  # a crash before rank 0's rename: both from the save before
    assert "write a marker" in ev["fix"]


@needs_fuse
@pytest.mark.slow
@pytest.mark.timeout(400)
def test_two_ranks_whose_save_is_committed_by_a_marker_are_safe_at_every_boundary(tmp_path: Path) -> None:
    result = _crash_points(tmp_path, "sharded-marker", world=2)
    assert result.status == "passed", result.summary
    ev = report_evidence(result)
    assert ev["boundaries_found"] == ev["boundaries_explored"] == 15, ev["by_op"]
    assert {o["rank"] for o in ev["outcomes"]} == {0, 1}
    resumed = [o["resumed_from_step"] for o in ev["outcomes"]]
    # only the marker's rename publishes the save
    assert resumed[-2:] == [resumed[0] + 5] * 2 and resumed[:-2] == [resumed[0]] * 13, ev["outcomes"]


@needs_fuse
@pytest.mark.timeout(240)
@pytest.mark.parametrize(("writer", "status"), [pytest.param("pid", "passed", marks=pytest.mark.slow),
                                                ("timestamped", "error")])
def test_a_temp_name_that_differs_between_runs(tmp_path: Path, writer: str, status: str) -> None:
    """A writer's pid in its temp name (digits' ``.ckpt_000010.pt.6800.tmp``) names the same
    boundary in every run; a name by the time cannot be found again by a crash run (without state
    copies: with them, each boundary is restarted on the state the recording left, and the names
    of other runs never matter), and a check that reached none of its boundaries says so instead
    of passing."""
    result = _crash_points(tmp_path, writer, limit=2, copies=256 if status == "passed" else 0)
    assert result.status == status, result.summary
    outcomes = [o["outcome"] for o in report_evidence(result)["outcomes"]]
    if status == "passed":
        assert outcomes == ["safe"] * 2 and "{pid}" in report_evidence(result)["outcomes"][0]["path"]
    else:
        assert outcomes == ["not reached"] * 2 and "never reached their boundary" in result.summary


def test_the_fix_for_a_folder_written_in_place_is_to_build_it_aside() -> None:
    """The Hugging Face Trainer makes checkpoint-10/ and writes its files into it; a restart that
    takes the newest folder (get_last_checkpoint) loads the half-written one."""
    from trainguard.drills.crash_fix import fix_for as _fix

    found = [Boundary(0, "/checkpoint-10", "mkdir", 1), Boundary(0, "/checkpoint-10/config.json", "create", 1)]
    row = BoundaryOutcome(found[0].words(), "mkdir", "/checkpoint-10", 0, 1, None, "crashed on load", "")
    assert "build /checkpoint-10 under a temporary name" in _fix(found[0], row, set(), "kill", found)
    assert "build /checkpoint-10 under a temporary name" in _fix(found[1], row, set(), "kill", found)
    # a folder built as tmp-checkpoint-10/ and renamed into place: that is not the fix
    aside = [Boundary(0, "/tmp-checkpoint-10", "mkdir", 1), Boundary(0, "/tmp-checkpoint-10", "rename", 1, "/checkpoint-10")]
    assert "temporary name" not in _fix(aside[0], row, set(), "kill", aside)


@needs_fuse
@pytest.mark.timeout(240)
def test_a_crash_in_the_last_save_resumes_with_nothing_left_to_train(tmp_path: Path) -> None:
    """The save of step 20, the last: once it is renamed into place, the restart loads it, has no
    step left and exits 0 without a line. That is safe, not a crash on load (seen on Lightning,
    whose saves of steps 10, 15 and 20 were explored as one)."""
    result = _crash_points(tmp_path, "atomic", after=17, limit=3)  # create, fsync, rename
    assert result.status == "passed", result.summary
    last = report_evidence(result)["outcomes"][-1]
    assert (last["op"], last["outcome"], last["resumed_from_step"]) == ("rename", "safe", 20), last
    assert "no step left to train" in last["detail"]


def _ended(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@needs_fuse
@pytest.mark.timeout(240)
def test_a_log_appended_at_every_step_is_not_the_save_explored(tmp_path: Path) -> None:
    """The in-place writer that also appends a line to train.log in its checkpoint directory at
    every step, and leaves a process behind that appends to bg.log there: the save explored is
    the one of ckpt.json (the file the restart opens), never a log line, and it fails at the
    truncate as it does without the log; no process of the job outlives the check."""
    pids = tmp_path / "background.pids"
    result = _crash_points(tmp_path, "inplace", limit=1, extra=f" --log --background {pids}")
    assert result.status == "failed", result.summary
    first = report_evidence(result)["first_unsafe"]
    assert (first["op"], first["path"], first["outcome"]) == ("truncate", "/ckpt.json", "crashed on load"), first
    assert "/ckpt.json" in report_evidence(result)["reads"] and "/train.log" not in report_evidence(result)["reads"]
    started = [int(line) for line in pids.read_text().split()]
    # the recording (the uninterrupted run too: none was kept) and its restart, launched on the
    # state it left after the truncate, the one boundary explored (max_boundaries: 1): its restart
    assert len(started) == 2
    deadline = time.monotonic() + 10
    while not all(_ended(pid) for pid in started) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert [pid for pid in started if not _ended(pid)] == []


@needs_fuse
@pytest.mark.timeout(300)
def test_a_restart_that_exits_0_on_a_torn_tracker_is_not_safe(tmp_path: Path) -> None:
    """Megatron's tracker, latest_checkpointed_iteration.txt, written in place after the save's
    folder: a crash after its truncation leaves it empty, and the restart prints ``ERROR: Invalid
    metadata file ... Exiting`` and exits 0 without a step. That is no resume (steps were left),
    and the next boundary, which resumes from the save, did not go back."""
    result = _crash_points(tmp_path, "megatron", limit=5, steps=15)
    assert result.status == "failed", result.summary
    ev = report_evidence(result)
    assert [(o["op"], o["path"]) for o in ev["outcomes"]] == [
        ("mkdir", "/iter_0000010"), ("create", "/iter_0000010/model.json"), ("write", "/iter_0000010/model.json"),
        ("truncate", "/latest_checkpointed_iteration.txt"), ("write", "/latest_checkpointed_iteration.txt")], ev["outcomes"]
    truncated, written = ev["outcomes"][3:]
    assert truncated["outcome"] == "trained nothing" and truncated["resumed_from_step"] is None, truncated
    assert "ERROR: Invalid metadata file" in truncated["detail"]
    assert ev["first_unsafe"] == truncated and "rename it over the old one" in ev["fix"]
    assert (written["outcome"], written["resumed_from_step"]) == ("safe", 10), written
    assert {o["outcome"] for o in ev["outcomes"][:3]} == {"safe"}


@needs_fuse
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_stale_final_weights_with_nothing_left_to_train_do_not_pass(tmp_path: Path) -> None:
    """The last save writes the step (atomically) before the weights (in place): after the step's
    rename a restart has nothing left to train and exits 0 without loading the weights, which
    are still step 15's. What the crash left is not the uninterrupted run's final checkpoint."""
    result = _crash_points(tmp_path, "tracker-first", after=17, limit=3)  # create, fsync, rename
    assert result.status == "failed", result.summary
    first = report_evidence(result)["first_unsafe"]
    assert (first["op"], first["path"], first["outcome"]) == ("rename", "/step.txt.tmp", "trained nothing"), first
    assert "/weights.json differs" in first["detail"] and first["resumed_from_step"] is None
    assert [o["outcome"] for o in report_evidence(result)["outcomes"][:2]] == ["safe", "safe"]
