"""The reports, plans and gate reports of a fixed set of checks and drills equal the golden ones
written before a change of structure (``tests/golden/golden.py``), field by field, times and
paths aside: the report JSON schema, the validate plan and every verdict stay as they were."""

from __future__ import annotations

import json

import pytest

from tests.golden.golden import CASES, differences, golden_path, normalize, run_case


@pytest.mark.parametrize("name", [
    pytest.param(name, marks=[pytest.mark.slow] if case.slow else []) for name, case in CASES.items()
])
def test_the_outputs_equal_the_golden_ones(name: str) -> None:
    golden = normalize(json.loads(golden_path(name).read_text(encoding="utf-8")))
    now = json.loads(json.dumps(run_case(CASES[name], timeout=300)))  # the golden file's JSON types
    found = differences(golden, now)
    assert found == [], "\n".join(found[:40])


def test_the_comparison_sees_a_changed_verdict_a_new_field_and_a_gone_one() -> None:
    """The yardstick can fail: a status, a key and an evidence value that differ are each named;
    a duration and a path are not."""
    golden = normalize({"checks": [{"name": "smoke", "status": "passed", "duration_s": 1.0,
                                    "evidence": {"steps": 5, "run_dir": "/tmp/a"}}]})
    same = normalize({"checks": [{"name": "smoke", "status": "passed", "duration_s": 7.5,
                                  "evidence": {"steps": 5, "run_dir": "/tmp/b"}}]})
    assert differences(golden, same) == []
    changed = normalize({"checks": [{"name": "smoke", "status": "failed", "duration_s": 1.0,
                                     "evidence": {"steps": 6, "extra": 1}}]})
    found = differences(golden, changed)
    assert "$.checks[0].status: 'passed' -> 'failed'" in found
    assert "$.checks[0].evidence.steps: 5 -> 6" in found
    assert "$.checks[0].evidence.extra: new" in found and "$.checks[0].evidence.run_dir: gone" in found


def test_a_run_directorys_same_second_suffix_is_volatile_but_its_label_is_not() -> None:
    """Two runs of one label created in the same second get ``-1`` on the second's name
    (launch/rundir.py), as timing decides: the golden toy once failed on it in CI. The label
    itself still counts."""
    first = normalize({"copy": "/t/.trainguard/runs/20261129-063000-toy-reference/kept/after-step-3/checkpoints"})
    second = normalize({"copy": "/t/.trainguard/runs/20261129-063001-toy-reference-1/kept/after-step-3/checkpoints"})
    assert differences(first, second) == [] and normalize(second) == second
    other = normalize({"copy": "/t/.trainguard/runs/20261129-063000-toy-killed-after-step-4/kept/after-step-3/checkpoints"})
    assert differences(first, other) != []
