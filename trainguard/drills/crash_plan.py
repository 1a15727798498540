"""The cost of ``checks.crash_points`` before it runs (``trainguard validate``, issue 49): the
boundaries of the save a crash_points run here recorded last (its report, next to the job file),
the launches they take, and the time from the seconds per launch that run measured. The recording
run and its restart are one after the other; the other launches run ``lanes`` at a time (the lanes
of :mod:`~trainguard.drills.crash_lanes`), so the time is counted in waves, with the lanes that run
had and the lanes this one will have.

Without a recorded save the boundaries are unknown: the plan says the worst case (every explored
boundary run, no outcome inferred).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainguard._internal.readers import OWN_FILE_LIMITS, Unreadable, read_json
from trainguard.config.backends import backend_for
from trainguard.drills.crash_lanes import lane_count

__all__ = ["RecordedSave", "crash_plan_words", "plan_lanes", "recorded_save"]

#: the launches around the boundaries: the recording run and its restart
FIXED_RUNS = 2
#: the control (a kill before the save, resumed), made when a restart diverges
CONTROL_RUNS = 2
#: a crash run started from the copy before the save that is made again from step 1 (once)
AGAIN_RUNS = 1


@dataclass(frozen=True)
class RecordedSave:
    """What the last crash_points report here says of its save and what exploring it took."""

    report: str
    found: int
    explored: int
    inferred: int
    runs: int
    duration_s: float | None
    mode: str
    #: the lanes that run had (boundaries side by side)
    lanes: int = 1


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) and value >= 0 else None


def recorded_save(state_dir: Path) -> RecordedSave | None:
    """The crash_points row of the newest report in ``state_dir`` that has one (check or gate), or
    None. A report is read as data, within trainguard's limits for its own files."""
    candidates = [state_dir / "report.json", state_dir / "gate" / "latest.json"]
    for path in sorted((p for p in candidates if p.is_file()), key=lambda p: -p.stat().st_mtime):
        try:
            data = read_json(path, OWN_FILE_LIMITS)
        except (OSError, Unreadable):
            continue
        if isinstance(data, dict) and "checks" not in data and isinstance(data.get("report"), dict):
            data = data["report"]
        checks = data.get("checks") if isinstance(data, dict) else None
        for item in checks if isinstance(checks, list) else []:
            ev = item.get("evidence") if isinstance(item, dict) and item.get("name") == "crash_points" else None
            if not isinstance(ev, dict) or not _number(ev.get("boundaries_found")):
                continue
            return RecordedSave(str(path), int(ev["boundaries_found"]), int(_number(ev.get("boundaries_explored")) or 0),
                                int(_number(ev.get("inferred")) or 0), int(_number(ev.get("runs")) or 0),
                                _number(item.get("duration_s")), str(ev.get("mode", "")),
                                max(1, int(_number(ev.get("lanes")) or 1)))
    return None


def _time(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.1f} min"


def plan_lanes(wanted: int | None, job_file: Any) -> int:
    """The lanes the check will run: :func:`~trainguard.drills.crash_lanes.lane_count` on the
    job's ranks and backend (the cores of this machine)."""
    return lane_count(wanted, job_file.job.world_size, backend_for(job_file.job.kind).concurrent_runs())


def _waves(launches: int, lanes: int) -> float:
    """The launches one after the other that ``launches`` take with ``lanes`` side by side: the
    recording run and its restart alone, the rest ``lanes`` at a time."""
    return min(launches, FIXED_RUNS) + max(0, launches - FIXED_RUNS) / max(1, lanes)


def crash_plan_words(max_boundaries: int, mode: str, infer: bool, state_dir: Path, lanes: int = 1) -> str:
    """The plan's line on crash_points: boundaries expected, launches, time (``lanes``: the
    boundaries this check will run side by side)."""
    worst = FIXED_RUNS + 2 * max_boundaries + CONTROL_RUNS + AGAIN_RUNS
    last = recorded_save(state_dir)
    if last is None or last.mode != mode:
        return (f"the save's boundaries are unknown until it is recorded (no crash_points report here): at most "
                f"{worst} launches ({FIXED_RUNS} to record the save, 2 per boundary explored, at most "
                f"{max_boundaries}, {CONTROL_RUNS} for a control when a restart diverges, {AGAIN_RUNS} for a crash "
                "from the copy before the save made again from step 1)"
                f"{', fewer where outcomes are inferred' if infer else ''}")
    explored = min(last.found, max_boundaries)
    if infer and explored == last.explored and last.runs:
        launches, how = last.runs, f"{last.inferred} of them inferred last time"
    else:
        launches, how = FIXED_RUNS + 2 * explored, "each run"
    words = (f"the save recorded last ({last.report}) has {last.found} boundaries: {explored} explored "
             f"({how}), {launches} launches")
    if last.duration_s is not None and last.runs:
        # the seconds of one launch there, its lanes' launches counted as the waves they ran in
        per = last.duration_s / _waves(last.runs, last.lanes)
        side = f", {lanes} side by side" if lanes > 1 else ""
        words += (f", about {_time(per * _waves(launches, lanes))} at the {per:.1f} s a launch took there"
                  f"{f' ({last.lanes} lanes)' if last.lanes > 1 else ''}{side}")
    return words + f" (at most {worst} launches)"
