"""``trainguard validate``'s line on checks.crash_points (trainguard.drills.crash_plan): the
boundaries of the save recorded last here, the launches and the time they take; the worst case
when no save was recorded."""

from __future__ import annotations

import json
from pathlib import Path

from tests.distributed.test_crash_points import writer_job
from trainguard.config.settings import Settings
from trainguard.drills.crash_plan import crash_plan_words
from trainguard.session.plan import make_plan


def _report(state: Path, **evidence: object) -> None:
    state.mkdir(parents=True, exist_ok=True)
    row = {"name": "crash_points", "status": "passed", "duration_s": 40.0,
           "evidence": {"mode": "kill", "boundaries_found": 9, "boundaries_explored": 9, "inferred": 5, "runs": 10,
                        **evidence}}
    (state / "report.json").write_text(json.dumps({"checks": [{"name": "smoke", "status": "passed"}, row]}))


def test_without_a_recorded_save_the_plan_says_the_worst_case(tmp_path: Path) -> None:
    words = crash_plan_words(16, "kill", True, tmp_path / ".trainguard")
    assert "unknown until it is recorded" in words and "at most 37 launches" in words


def test_a_recorded_save_gives_the_boundaries_launches_and_time(tmp_path: Path) -> None:
    _report(tmp_path / ".trainguard")
    words = crash_plan_words(16, "kill", True, tmp_path / ".trainguard")
    assert "has 9 boundaries: 9 explored (5 of them inferred last time), 10 launches" in words, words
    assert "about 40 s at the 4.0 s a launch took there" in words
    # every boundary run: 2 per boundary; fewer explored under a lower limit
    assert "9 explored (each run), 20 launches, about 80 s" in crash_plan_words(16, "kill", False, tmp_path / ".trainguard")
    assert "4 explored (each run), 10 launches" in crash_plan_words(4, "kill", True, tmp_path / ".trainguard")
    # another mode's save is not this one's
    assert "unknown" in crash_plan_words(16, "power", True, tmp_path / ".trainguard")


def test_validate_prints_the_plan_of_crash_points(tmp_path: Path) -> None:
    job = writer_job(tmp_path, "atomic")
    _report(tmp_path / ".trainguard")
    lines = make_plan(job, Settings()).lines()
    assert any("has 9 boundaries" in line and "10 launches" in line for line in lines), lines


def test_the_time_counts_the_lanes_both_runs_had(tmp_path: Path) -> None:
    """The recording run and its restart run alone, the other launches side by side: a save whose
    10 launches took 40 s with 2 lanes took 6 waves (6.7 s each); one lane now takes 10 of them, and
    a save recorded with 1 lane takes 2 + 8 / 2 waves with 2."""
    state = tmp_path / ".trainguard"
    _report(state, lanes=2)
    assert "about 67 s at the 6.7 s a launch took there (2 lanes)" in crash_plan_words(16, "kill", True, state)
    assert "about 40 s at the 6.7 s a launch took there (2 lanes), 2 side by side" in crash_plan_words(
        16, "kill", True, state, lanes=2)
    _report(state, lanes=1)
    assert "10 launches, about 24 s at the 4.0 s a launch took there, 2 side by side" in crash_plan_words(
        16, "kill", True, state, lanes=2)


def test_validate_counts_the_lanes_the_machine_gives_the_job(tmp_path: Path) -> None:
    job = writer_job(tmp_path, "atomic", lanes=2)
    _report(tmp_path / ".trainguard")
    lines = make_plan(job, Settings()).lines()
    assert any("10 launches, about 24 s" in line and "2 side by side" in line for line in lines), lines
