"""trainguard.evidence: a check's typed evidence is the report's evidence object, key for key."""

from __future__ import annotations

import json
from dataclasses import dataclass

from trainguard.checks.smoke import SmokeCheckpoint, SmokeEvidence, SmokeResume
from trainguard.evidence import UNSET, Evidence, Unset


@dataclass
class _Inner(Evidence):
    a: int
    b: str | Unset = UNSET


@dataclass
class _Outer(Evidence):
    n: int | None
    inner: _Inner | Unset = UNSET
    many: list[_Inner] | Unset = UNSET
    tail: str | Unset = UNSET


def test_unset_keys_are_left_out_none_is_written_and_nested_records_become_dicts() -> None:
    assert _Outer(None).to_dict() == {"n": None}
    record = _Outer(3, inner=_Inner(1), many=[_Inner(2, "x")])
    assert record.to_dict() == {"n": 3, "inner": {"a": 1}, "many": [{"a": 2, "b": "x"}]}
    assert list(record.to_dict()) == ["n", "inner", "many"]  # field order
    record.tail = "t"
    assert record.to_dict()["tail"] == "t"
    assert repr(UNSET) == "UNSET"


def test_the_smoke_evidence_writes_the_keys_the_report_always_had() -> None:
    evidence = SmokeEvidence(steps=4, outcome="ok", exits=["exit code 0"], stages={"total_s": 1.0},
                             metric_steps_seen=4, checkpoint_files=["c/step4.pt"], run_dir="r")
    assert set(evidence.to_dict()) == {"steps", "outcome", "exits", "stages", "metric_steps_seen",
                                       "checkpoint_files", "run_dir"}
    evidence.checkpoint = SmokeCheckpoint("c/step4.pt", loaded=True, step=4, keys=["model", "step"])
    evidence.resume = SmokeResume(checkpoint_step=4, steps=6, first_step=5, last_step=6, outcome="ok", run_dir="r2")
    written = json.loads(json.dumps(evidence.to_dict()))
    assert written["checkpoint"] == {"file": "c/step4.pt", "loaded": True, "step": 4, "keys": ["model", "step"]}
    assert written["resume"]["first_step"] == 5 and "stderr_tail" not in written["resume"]


def test_a_merged_field_writes_its_keys_into_the_record_where_it_stands() -> None:
    from dataclasses import field

    from trainguard.evidence import MERGED

    @dataclass
    class _Run(Evidence):
        outcome: str
        started_ahead: bool | Unset = UNSET
        launcher: dict[str, object] = field(default_factory=dict, metadata=MERGED)
        tail: str | Unset = UNSET

    record = _Run("timeout", started_ahead=True, tail="t")
    assert record.to_dict() == {"outcome": "timeout", "started_ahead": True, "tail": "t"}
    record.launcher = {"memory_limit": {"rank": 1}, "started_ahead": False}
    assert record.to_dict() == {"outcome": "timeout", "started_ahead": False, "memory_limit": {"rank": 1}, "tail": "t"}
    assert list(record.to_dict()) == ["outcome", "started_ahead", "memory_limit", "tail"]


def test_a_trailing_field_is_written_after_the_fields_of_every_record_that_extends_it() -> None:
    from dataclasses import field

    from trainguard.evidence import TRAILING, known

    @dataclass
    class _Base(Evidence):
        common: int
        causes: list[str] | Unset = field(default=UNSET, metadata=TRAILING)

    @dataclass
    class _Kind(_Base):
        own: int | Unset = UNSET

    record = _Kind(1, own=2)
    assert list(record.to_dict()) == ["common", "own"]
    record.causes = ["x"]
    assert list(record.to_dict()) == ["common", "own", "causes"]
    # a field not set is no finding: falsy, and known() reads it as None
    assert not UNSET and known(_Kind(1).own) is None and known(record.own) == 2


def test_a_drills_record_per_expectation_writes_the_common_keys_then_its_own_then_the_causes() -> None:
    from trainguard.drills.evidence import (
        AttemptEvidence,
        CheckpointIntact,
        FailCleanEvidence,
        SaveUnderKill,
        StepRate,
    )

    attempt = AttemptEvidence(outcome="failed", reason="rank 1 exited 1", exits=[], last_step=8,
                              duration_s=3.0, run_dir="r", failed_rank=1, classified="exit code 1")
    record = FailCleanEvidence(
        injected_at_s=1.0, injected_after_step=8, watched_rank=1, watched_rank_step_at_injection=8,
        detected_after_s=0.5, attempt_ended_after_s=0.6, restarts=0, attempts=[attempt],
        step_rate=StepRate(unit="steps/s of rank 1", before=10.0, during=None), fault_evidence={},
        reference_run_dir="ref")
    record.exit_after_s = 0.6
    record.likely_causes = ["a checkpoint overwritten in place"]
    record.checkpoint = CheckpointIntact(intact=False, why="resume failed")
    record.save = SaveUnderKill(held_write={"path": "c/step8.pt"}, latest_complete_at_kill={"step": 4},
                                kill_to_exit_s=0.1, resumed_from_step=4)
    written = json.loads(json.dumps(record.to_dict()))
    keys = list(written)
    assert keys[:3] == ["injected_at_s", "injected_after_step", "watched_rank"]
    assert keys[-2:] == ["likely_causes", "save"] and keys.index("exit_after_s") < keys.index("checkpoint")
    assert written["attempts"][0]["failed_rank"] == 1 and "stacks" not in written["attempts"][0]
    assert written["checkpoint"] == {"intact": False, "why": "resume failed"}
    assert "killed_rank_resumed_from_step" not in written["save"]
