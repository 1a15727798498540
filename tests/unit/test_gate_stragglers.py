"""Stragglers in the gate (issue 46): a rank named a straggler is a warning; with
``gate.max_straggler_ratio`` one over it blocks; the gate report's per-rank table.

The pace data is recorded: tests/data/pace/ holds the step clocks of two real 2-rank launches of
tests/data/jobs/pace_train.py (tests/benchmarks/pace_matrix.py, 80 steps): ``quota1.5-w2``, rank 1
under a cgroup CPU quota of its clean share / 1.5 (throttled in 98 % of the CFS periods; named at
2.27x), and ``clean-w2``, the clean run just before it (2 windows, none named).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from trainguard.config import GatePolicy, load_config
from trainguard.errors import ConfigError
from trainguard.gate.policy import Capabilities, Decision, decide
from trainguard.gate.provenance import provenance_for
from trainguard.gate.run import GateReport, judged_paces, write_gate_report
from trainguard.launch.pace import (
    PaceReport,
    RankPace,
    RunPace,
    SingleRankWork,
    judge_pace,
    read_pace,
)
from trainguard.report import CheckResult, Report
from trainguard.run.runner import LaunchRecord

PACE = Path(__file__).resolve().parents[1] / "data" / "pace"
JOB = Path(__file__).resolve().parents[1] / "data" / "jobs" / "toy.trainguard.yaml"
CAPS = Capabilities(gpus=0, root=False, ray=True)


def recorded(case: str, label: str = "drill:kill-rank1") -> RunPace:
    return RunPace(label, 2, judge_pace(read_pace(PACE / case)))


def gate_decision(*paces: RunPace, **policy: Any) -> Decision:
    report = Report(job="toy", checks=[CheckResult("smoke", "passed", "fine")])
    return decide(report, GatePolicy.model_validate({"require": ["smoke"], **policy}), CAPS, paces=paces)


def test_the_recorded_runs_are_what_they_say() -> None:
    planted, clean = recorded("quota1.5-w2").report, recorded("clean-w2").report
    assert [r.rank for r in planted.stragglers] == [1] and planted.ranks[1].ratio > 1.5
    assert clean.judged and clean.stragglers == ()


def test_a_straggler_is_a_warning_without_the_setting() -> None:
    decision = gate_decision(recorded("quota1.5-w2"))
    assert decision.promoted and decision.reasons == []
    [warning] = decision.warnings
    assert warning.startswith("rank 1 of 2 is a straggler in drill:kill-rank1: 2.")
    assert "set gate.max_straggler_ratio to block on it" in warning


def test_a_straggler_over_max_straggler_ratio_blocks_and_one_within_it_warns() -> None:
    decision = gate_decision(recorded("quota1.5-w2"), max_straggler_ratio=1.5)
    assert decision.verdict == "block"
    [reason] = decision.reasons
    assert "rank 1 of 2 is a straggler" in reason and reason.endswith("over gate.max_straggler_ratio 1.5")
    within = gate_decision(recorded("quota1.5-w2"), max_straggler_ratio=5)
    assert within.promoted and "within gate.max_straggler_ratio 5" in within.warnings[0]


def test_a_clean_run_passes_with_the_setting_and_says_it_was_compared() -> None:
    decision = gate_decision(recorded("clean-w2"), max_straggler_ratio=1.2)
    assert decision.promoted and decision.warnings == []
    assert "gate.max_straggler_ratio 1.2: no straggler over it in 1 judged multi-rank run(s)" in decision.notes


def test_the_setting_with_no_judged_run_blocks_nothing_was_compared() -> None:
    short = {r: c[:15] for r, c in read_pace(PACE / "quota1.5-w2").items()}
    unjudged = RunPace("parallel", 2, judge_pace(short))
    assert gate_decision(unjudged).promoted  # without the setting: nothing to say
    decision = gate_decision(unjudged, max_straggler_ratio=1.2)
    assert decision.verdict == "block"
    assert "no multi-rank run was judged" in decision.reasons[0]
    assert "drop gate.max_straggler_ratio" in decision.reasons[0]


def test_periodic_single_rank_work_is_a_note_never_a_straggler() -> None:
    rows = tuple(RankPace(r, 60, 0.5, 1.0, False, None) for r in (0, 1))
    saves = RunPace("canary", 2, PaceReport(rows, 0.1, 3, (SingleRankWork(0, (8, 18, 28), 1.5),)))
    decision = gate_decision(saves, max_straggler_ratio=1.2)
    assert decision.promoted and decision.warnings == []
    assert "canary: rank 0 alone busy at 3 steps (single-rank work, not a straggler)" in decision.notes


@pytest.mark.parametrize(("value", "said"), [("1.0", "expected a value > 1"), ("fast", "expected a number")])
def test_a_bad_max_straggler_ratio_names_the_file_the_key_and_the_fix(tmp_path: Path, value: str, said: str) -> None:
    job = tmp_path / "trainguard.yaml"
    job.write_text("job:\n  name: t\n  command: python x.py\n  metrics: {loss: 'loss (?P<value>\\S+)'}\n"
                   f"gate:\n  max_straggler_ratio: {value}\n")
    with pytest.raises(ConfigError) as caught:
        load_config(job)
    message = str(caught.value)
    assert str(job) in message and "gate.max_straggler_ratio" in message and said in message
    assert "Fix: a ratio above 1, e.g. `max_straggler_ratio: 1.25`" in message


def test_the_gate_report_has_the_per_rank_table_of_each_judged_launch(tmp_path: Path) -> None:
    planted = recorded("quota1.5-w2")
    launches = [LaunchRecord("drill:kill-rank1", 2, 9.0, 1.0, 80, planted.report),
                LaunchRecord("reference", 1, 5.0, 1.0, 80),
                LaunchRecord("parallel", 2, 2.0, 1.0, 15, judge_pace({r: c[:15] for r, c in read_pace(PACE / "clean-w2").items()}))]
    paces = judged_paces(launches)
    assert [p.label for p in paces] == ["drill:kill-rank1"]  # one rank, or too short to judge: no table
    gate = GateReport(job="toy", job_file=str(JOB), decision=gate_decision(*paces),
                      report=Report(job="toy", checks=[CheckResult("smoke", "passed", "fine")]),
                      provenance=provenance_for(JOB), capabilities=CAPS,
                      policy=GatePolicy.model_validate({}), paces=paces)
    paths = write_gate_report(gate, tmp_path)
    data = json.loads(Path(paths["json"]).read_text())
    [row] = data["pace"]
    assert row["run"] == "drill:kill-rank1" and row["world_size"] == 2 and row["stragglers"] == [1]
    assert [(r["rank"], r["steps"], r["straggler"]) for r in row["ranks"]] == [(0, 77, False), (1, 77, True)]
    assert data["decision"]["warnings"] == gate.decision.warnings
    markdown = Path(paths["markdown"]).read_text()
    assert "**Warnings:**\n- rank 1 of 2 is a straggler in drill:kill-rank1" in markdown
    assert "| 1 | 77 | 0.94 | 2.27 | yes, named at step 43 |" in markdown
    html = Path(paths["html"]).read_text()
    assert "<h3>Ranks of drill:kill-rank1</h3>" in html and "yes, named at step 43" in html
