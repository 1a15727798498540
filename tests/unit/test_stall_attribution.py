"""The attribution of a stall on recorded inputs: each case in tests/data/stalls/ is what trainguard
gathered when a real 3-rank torch DDP job on gloo (tests/data/jobs/stall_train.py) stalled with one
fault planted on rank 0 (each rank's state and CPU, its py-spy stack, its agent's answer with its
Flight Recorder trimmed to the last entries), saved by ``tests/benchmarks/stall_matrix.py --capture``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from trainguard.launch.stall_attribution import (
    Collective,
    RankAnswer,
    RankSignals,
    attribute,
    parse_flight_recorder,
    parse_py_spy,
    signals_from,
)

ROOT = Path(__file__).resolve().parents[2]
CASES = ROOT / "tests" / "data" / "stalls"


def load(name: str, drop: int | None = None) -> tuple[dict[str, Any], list[RankSignals]]:
    case = json.loads((CASES / f"{name}.json").read_text().replace("{ROOT}", str(ROOT)))
    activity = [a for a in case["activity"] if a["rank"] != drop]
    answers = {int(r): RankAnswer.from_dict(a) for r, a in case["answers"].items() if int(r) != drop}
    return case, signals_from(activity, answers, case["stacks"], {})


@pytest.mark.parametrize("name", sorted(p.stem for p in CASES.glob("*.json")))
def test_each_recorded_stall_names_the_rank_it_was_planted_on(name: str) -> None:
    case, signals = load(name)
    found = attribute(signals)
    assert found.culprits == (case["culprit"],), found.summary
    others = [f for f in found.ranks if f.rank != case["culprit"]]
    assert others and all(f.in_collective for f in others), found.summary
    assert all(f.doing in found.summary for f in others if f.waits_in is None)


WHAT = {
    "stop": "is stopped (SIGSTOP)",
    "sleep": "is not in a collective: in `stall_before_step` of stall_train.py",
    "busy": "is not in a collective: in `stall_before_step` of stall_train.py",
    "gil": "holds the GIL in a C call",
    "loader": "in `__next__` of its DataLoader, waiting on worker 0",
    "skip": "called one all_reduce fewer",
    "other": "called another collective: broadcast",
}


@pytest.mark.parametrize("fault", sorted(WHAT))
def test_the_culprit_is_described_by_what_it_was_doing(fault: str) -> None:
    _, signals = load(f"{fault}-r0-w3")
    found = attribute(signals)
    assert WHAT[fault] in found.summary
    if fault in ("sleep", "stop", "gil"):  # the job's own line, quoted from its source file
        assert {"sleep": "time.sleep(3600)", "stop": "os.kill(", "gil": "sum(range("}[fault] in found.summary
    if fault == "gil":  # no answer: named from its stack and its silence
        culprit = found.ranks[0]
        assert 0 not in found.answered and "did not answer" in " ".join(culprit.evidence)
    if fault not in ("skip", "other"):
        assert found.mismatch is None
        assert "ranks 1, 2 wait in all_reduce #8 of the default group" in found.summary


@pytest.mark.parametrize(("fault", "kind"), [("skip", "fewer"), ("other", "different")])
@pytest.mark.parametrize("drop", [None, 2])
def test_a_collective_mismatch_is_named_with_both_sequences(fault: str, kind: str, drop: int | None) -> None:
    # drop=2: two ranks only, one call each at the place they differ: no majority to go by, the
    # order both kept before (which call follows which) says which rank broke it
    _, signals = load(f"{fault}-r0-w3", drop=drop)
    found = attribute(signals)
    assert found.mismatch is not None and found.mismatch.kind == kind
    assert found.culprits == (0,)
    sequences = dict(found.mismatch.sequences)
    assert sequences[0][-1].endswith("(waiting)") and sequences[1][-1].endswith("(waiting)")
    assert sequences[0][-1] != sequences[1][-1]
    assert "Sequences: rank 0:" in found.summary and "; rank 1:" in found.summary


def calls(*ops: tuple[str, bool]) -> tuple[Collective, ...]:
    return tuple(Collective("the default group", i, op, "[[1]]", done, i) for i, (op, done) in enumerate(ops, 1))


def test_no_culprit_when_every_rank_waits_in_the_same_collective() -> None:
    same = calls(("all_reduce", True), ("all_reduce", False))
    found = attribute([RankSignals(r, state="sleeping", answered=True, calls=same) for r in range(3)])
    assert found.culprits == () and found.mismatch is None
    assert found.summary.startswith("no culprit: no rank is stopped and every rank waits in a collective")


def test_no_culprit_when_no_rank_waits_in_a_collective() -> None:
    # every rank slow alike (a long step, a loaded machine): a stall no rank is to blame for
    done = calls(("all_reduce", True), ("all_reduce", True))
    found = attribute([RankSignals(r, state="sleeping", answered=True, calls=done) for r in range(2)])
    assert found.culprits == ()
    assert "no rank waits in a collective" in found.summary


def test_a_silent_rank_without_a_stack_is_named_when_its_peers_wait() -> None:
    waiting = calls(("all_reduce", True), ("all_reduce", False))
    signals = [RankSignals(0, state="sleeping", answered=True, calls=waiting),
               RankSignals(1, state="running", answered=False)]
    found = attribute(signals)
    assert found.culprits == (1,)
    assert "rank 1 did not answer and left no stack" in found.summary


PY_SPY = """Process 41: python train.py
Python v3.11.7 (/usr/bin/python3.11)

Thread 41 (active+gil): "MainThread"
    busy (train.py:12)
    main (train.py:30)
    <module> (train.py:40)
Thread 57 (idle): "trainguard-stall"
    _wait (_trainguard_stall_agent.py:61)
"""


def test_py_spy_main_thread_and_gil() -> None:
    frames, gil = parse_py_spy(PY_SPY)
    assert [f.function for f in frames] == ["<module>", "main", "busy"] and gil
    assert parse_py_spy("(py-spy not installed)") == ((), False)


def test_flight_recorder_pending_from_group_status() -> None:
    fr = {"pg_status": {"0": {"last_completed_collective": "4"}},
          "entries": [{"collective_seq_id": s, "pg_id": 0, "process_group": ["0", "default_pg"],
                       "profiling_name": "gloo:all_reduce", "input_sizes": [[36]], "retired": False,
                       "time_created_ns": s} for s in (4, 5)]}
    found = parse_flight_recorder(fr)
    assert [(c.seq, c.completed, c.group, c.op) for c in found] == [
        (4, True, "the default group", "all_reduce"), (5, False, "the default group", "all_reduce")]


def test_a_hang_drill_attempt_carries_the_attribution(tmp_path: Path) -> None:
    from trainguard.drills.judges import attempt_evidence
    from trainguard.faults.hang import HangFault
    from trainguard.launch import RunResult

    _, signals = load("stop-r0-w3")
    found = attribute(signals).to_dict()
    result = RunResult("hung", [], tmp_path, 3, 0, [], [], 2.0, 0.5, reason="no new metric line for 2.1 s (limit 2 s)",
                       evidence={"attribution": found})
    fault = HangFault(rank=0, after_step=2)
    entry = attempt_evidence(result, fault)
    assert entry.culprits == [0]
    assert entry.attribution == found["summary"]
    assert entry.classified.endswith(found["summary"])  # the drill's summary line says it too
    assert "rank 0 is stopped (SIGSTOP)" in fault.classify(result)


def test_a_rank_that_did_not_answer_idle_in_backward_waits_in_ddp_s_all_reduce() -> None:
    # the sleep case with rank 1's answer lost: its stack (idle in backward) says it waits
    case = json.loads((CASES / "sleep-r0-w3.json").read_text().replace("{ROOT}", str(ROOT)))
    answers = {int(r): RankAnswer.from_dict(a) for r, a in case["answers"].items() if r != "1"}
    found = attribute(signals_from(case["activity"], answers, case["stacks"], {}))
    assert found.culprits == (0,), found.summary
    assert found.ranks[1].in_collective and "_engine_run_backward" in found.ranks[1].doing


def test_each_rank_s_last_step_is_cited() -> None:
    case = json.loads((CASES / "sleep-r0-w3.json").read_text().replace("{ROOT}", str(ROOT)))
    answers = {int(r): RankAnswer.from_dict(a) for r, a in case["answers"].items()}
    found = attribute(signals_from(case["activity"], answers, case["stacks"], {0: 2, 1: 2, 2: 2}))
    assert all("its last step line: step 2" in f.evidence for f in found.ranks)
    assert found.ranks[0].last_step == 2
