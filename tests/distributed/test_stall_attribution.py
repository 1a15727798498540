"""A stall planted on one rank of a real 2-rank torch DDP job on gloo (tests/data/jobs/stall_train.py):
trainguard's watchdog calls the run hung after the stall limit, and its attribution names the rank
that stalled (its answer to the watchdog and its stack), the rank waiting in the all-reduce, and
takes under a second after the detection. The matrix of every fault kind, culprit rank and world
size is tests/benchmarks/stall_matrix.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.benchmarks.stall_matrix import run_cell
from trainguard.launch.stall_attribution import ANSWER_WINDOW_S

pytest.importorskip("torch")


def test_a_rank_sleeping_before_the_all_reduce_is_named(tmp_path: Path) -> None:
    cell, found = run_cell("sleep", 1, 2, tmp_path, stall=3.0, steps=6)
    assert cell.outcome == "hung"
    assert found["culprits"] == [1], found["summary"]
    by_rank = {f["rank"]: f for f in found["ranks"]}
    assert by_rank[1]["in_collective"] is False
    assert "stall_before_step" in by_rank[1]["doing"], by_rank[1]
    assert by_rank[0]["in_collective"] is True
    assert "all_reduce" in by_rank[0]["doing"], by_rank[0]
    assert set(found["answered"]) == {0, 1}  # both agents answered: no wait for a silent rank
    assert found["took_s"] < ANSWER_WINDOW_S + 0.2  # loose: a busy machine slows the reading
