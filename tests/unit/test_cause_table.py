"""tests/benchmarks/cause_table.py without running a job: the cause it reads off a check's report
and the rows it finds in the tests' own tables."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.benchmarks.cause_table import Row, all_rows, first_cause, main, named


def _row(expected: str) -> Row:
    return Row("resume", "job", "defect", expected, lambda t: t, "resume")


def test_the_first_cause_is_the_diagnosis_then_a_reshard_pairs_then_the_likely_cause() -> None:
    diagnosed = {"evidence": {"diagnosis": [
        {"key": "rng", "cause": "RNG states not saved", "evidence": ["ckpt.pt holds no RNG state"]},
        {"key": "data_position", "cause": "data position", "evidence": []}],
        "likely_causes": ["something else"]}}
    assert first_cause(diagnosed) == ("rng", "RNG states not saved", ["ckpt.pt holds no RNG state"])
    paired = {"evidence": {"pairs": {"2->3": {"diagnosis": [{"key": "uneven", "cause": "uneven shares",
                                                                "evidence": ["42 samples vs 40"]}]}}}}
    assert first_cause(paired) == ("uneven", "uneven shares", ["42 samples vs 40"])
    assert first_cause({"evidence": {"likely_causes": ["no handler for the notice", "x"]}}) == (
        "", "no handler for the notice", [])
    unsafe = {"evidence": {"first_unsafe": {"op": "truncate", "path": "/ckpt.json", "outcome": "crashed on load"},
                           "fix": "rename it over the old one"}}
    assert first_cause(unsafe) == ("", "unsafe at truncate /ckpt.json: crashed on load", ["rename it over the old one"])
    assert first_cause({"summary": "the checkpoint's layout changed. More."}) == ("", "the checkpoint's layout changed", [])


def test_the_planted_cause_is_named_by_its_key_or_by_its_words() -> None:
    assert named(_row("scheduler"), "scheduler", "LR scheduler state", [])
    assert not named(_row("scheduler"), "rng", "RNG states not saved or not restored", ["lr differs"])
    assert named(_row("data_position"), "data_position", "data position", [])
    assert named(_row("data position"), "data_position", "data position", [])
    # words: in a keyed cause's text only; in an unkeyed cause's text or evidence
    assert named(_row("rng"), "rng_per_rank", "RNG states saved per rank", [])
    assert named(_row("in place"), "", "a checkpoint overwritten in place", [])
    assert named(_row("rename it over"), "", "unsafe at truncate", ["rename it over the old one"])
    assert not named(_row("in place"), "", "the error is caught and swallowed", [])


def test_every_row_has_a_unique_id_and_the_new_plants_are_rows(capsys: pytest.CaptureFixture[str]) -> None:
    ids = [r.id for r in all_rows()]
    assert len(ids) == len(set(ids))
    assert "sched_train.py/resume/scheduler_not_saved" in ids and "sched_train.py/resume/rng_not_restored" in ids
    assert main(["--list", "--only", "sched_train"]) == 0
    assert capsys.readouterr().out.split() == ["sched_train.py/resume/scheduler_not_saved",
                                               "sched_train.py/resume/rng_not_restored"]


def test_a_row_that_errors_is_a_row_saying_so(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The compat row's build needs git and a repository; a hard timeout of 1 s ends it first."""
    out = tmp_path / "table.md"
    assert main(["--only", "inexact_resume.py", "--timeout", "1", "--out", str(out)]) == 0
    (row,) = [line for line in out.read_text().splitlines() if line.startswith("| compat")]
    assert "ERROR: timed out after 1 s" in row, row
