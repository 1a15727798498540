"""tests/benchmarks/silent_table.py without running a job: the verdict it gives each row from the
invariants check's findings (issue 45's bar: within 2 optimizer steps; a data defect at its epoch;
a twin with no finding; a defect whose record is not written yet: not caught, said so)."""

from __future__ import annotations

from typing import Any

from tests.benchmarks.silent_table import Row, clean_rows, planted_rows, verdict


def _ran(*findings: dict[str, Any], status: str = "failed") -> dict[str, Any]:
    return {"outcome": "ran", "status": status, "summary": "", "findings": list(findings)}


def _finding(step: int | None = None, epoch: int | None = None) -> dict[str, Any]:
    return {"invariant": "replicas", "step": step, "epoch": epoch, "name": "0.weight", "ranks": [0, 1]}


def test_a_defect_is_ok_only_within_2_steps_of_the_first_step_it_affects() -> None:
    row = Row("ddp_bypassed", "job", "replicas", lambda t: t, "5")
    assert verdict(row, _ran(_finding(5))).startswith("ok")
    assert verdict(row, _ran(_finding(7))).startswith("ok")
    assert verdict(row, _ran(_finding(8))) == "OUTSIDE 2 STEPS (3)"
    assert verdict(row, _ran(_finding(4))) == "OUTSIDE 2 STEPS (-1)"  # before the defect: not its finding
    assert verdict(row, _ran(status="passed")) == "NOT CAUGHT: passed"
    epoch = Row("set_epoch_never", "job", "data", lambda t: t, "epoch 1")
    assert verdict(epoch, _ran(_finding(epoch=1))).startswith("ok")
    assert verdict(epoch, _ran(_finding(epoch=2))) == "LATE: epoch 2"


def test_a_twin_passes_with_no_finding_and_an_unrecorded_invariant_says_what_it_needs() -> None:
    twin = Row("clean twin", "job", "none", lambda t: t)
    assert verdict(twin, _ran(status="passed")).startswith("ok")
    assert verdict(twin, _ran(status="skipped")).startswith("ok")
    assert verdict(twin, _ran(_finding(3))).startswith("FALSE FINDING (1)")
    record = "plan 6: a `loader` line (the sampler and its epoch)"
    needs = Row("set_epoch_never", "job", "data", lambda t: t, "epoch 1", record)
    assert verdict(needs, _ran(status="passed")) == f"not caught (expected: needs {record})"


def test_the_yardstick_holds_12_defects_with_twins_6_example_plants_and_2_patched_public_scripts() -> None:
    rows = planted_rows()
    assert len({r.id for r in rows}) == len(rows)
    defects = [r for r in rows if not r.clean and not r.only.startswith("drill:")]
    assert len(defects) >= 12 and len([r for r in rows if r.clean]) >= 3
    assert len([r for r in defects if r.job.startswith("examples/")]) >= 6
    assert len([r for r in defects if r.job.startswith("nanoGPT") and "patched" in r.defect]) >= 2
    assert [r.id for r in clean_rows(2)][:2] == ["examples/digits/clean run 1", "examples/digits/clean run 2"]
