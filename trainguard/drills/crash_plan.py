"""The cost of ``checks.crash_points`` before it runs (``trainguard validate``, issue 49): the
boundaries of the save a crash_points run here recorded last (its report, next to the job file),
the launches they take, and the time from the seconds per launch that run measured.

Without a recorded save the boundaries are unknown: the plan says the worst case (every explored
boundary run, no outcome inferred).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainguard._internal.readers import OWN_FILE_LIMITS, Unreadable, read_json

__all__ = ["RecordedSave", "crash_plan_words", "recorded_save"]

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
                                _number(item.get("duration_s")), str(ev.get("mode", "")))
    return None


def _time(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.1f} min"


def crash_plan_words(max_boundaries: int, mode: str, infer: bool, state_dir: Path) -> str:
    """The plan's line on crash_points: boundaries expected, launches, time."""
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
        per = last.duration_s / last.runs
        words += f", about {_time(per * launches)} at the {per:.1f} s a launch took there"
    return words + f" (at most {worst} launches)"
