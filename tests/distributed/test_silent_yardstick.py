"""The silent-bug yardstick (issue 45, tests/benchmarks/silent_table.py) as slow tests: each
planted defect of examples/digits, sched_train.py and patched nanoGPT is caught by the invariants
check within 2 optimizer steps of the first step it affects (a missing ``set_epoch``: at the next
epoch; all 17 are since the agent's ``params``/``model`` lines, ``carried``, ``eval_in_step``, the
``eval`` line and ``clip``), or, where a row says the record its invariant needs, is said not
caught with that record named; each clean twin (the rank-dependent dropout seed of digits among
them) has no finding; the sdc drills on DDP pass. One real launch each (about 10 s; nanoGPT's 30 s)."""

from __future__ import annotations

import pytest

from tests.benchmarks.silent_table import Row, planted_rows, run_row, verdict

ROWS = planted_rows()


@pytest.mark.slow
@pytest.mark.parametrize("row", ROWS, ids=[r.id for r in ROWS])
def test_each_defect_is_caught_in_time_or_names_the_record_it_needs(row: Row) -> None:
    result = run_row(row, keep=False)
    if result["outcome"] == "skipped":
        pytest.skip(result["why"])
    said = verdict(row, result)
    assert said.startswith(("ok", "not caught (expected")), (said, result["summary"], result["findings"][:3])
