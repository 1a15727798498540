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
