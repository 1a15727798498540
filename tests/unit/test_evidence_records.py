"""Every registered check's evidence records survive the trip out of the process and back: the
report's JSON object read back (``Evidence.from_dict``, by the records the registry names) is
written again byte for byte, and a loaded report holds each check's record, not a dict."""

from __future__ import annotations

import json
import types
from dataclasses import fields
from enum import Enum
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from trainguard.checks.equivalence_records import DeterminismEvidence, Tolerance
from trainguard.checks.smoke import SmokeEvidence
from trainguard.config.fault_params import FaultParams
from trainguard.config.faults import FAULTS, fault_class
from trainguard.config.records import load_report, record_types
from trainguard.config.registry import registered
from trainguard.drills.evidence import DrillEvidence, DrillReport, StepRate
from trainguard.errors import ConfigError
from trainguard.evidence import UNSET, Evidence, Recorded
from trainguard.faults.base import FaultEvidence
from trainguard.faults.kill_during_save import KillDuringSaveFault
from trainguard.faults.preempt import PreemptEvidence, PreemptFault, SignalSent
from trainguard.report import CheckResult, Report, read_evidence

#: JSON scalars, for fields typed Any (keys of another layer, a fault's own record)
_SCALARS = st.none() | st.booleans() | st.integers(-10, 10) | st.text(max_size=4)


def _strategy(hint: Any) -> st.SearchStrategy[Any]:
    """Values of ``hint`` as a record holds them (a record: built field by field)."""
    origin, args = get_origin(hint), get_args(hint)
    if hint is Any or hint is object:
        return _SCALARS
    if origin is Union or origin is types.UnionType:
        return st.one_of(*(_strategy(a) for a in args))
    if origin is Literal:
        return st.sampled_from(args)
    if isinstance(hint, type) and issubclass(hint, Evidence):
        return _records(hint)
    if origin in (list, tuple):
        return st.lists(_strategy(args[0] if args else Any), max_size=2)
    if origin is dict:
        keys = st.integers(0, 9) if args and args[0] is int else st.text("abc", max_size=3)
        return st.dictionaries(keys, _strategy(args[1] if args else Any), max_size=2)
    if hint is type(None):
        return st.none()
    if hint is float:
        return st.floats(allow_nan=False, allow_infinity=False) | st.integers(-5, 5)
    if isinstance(hint, type) and issubclass(hint, Enum):
        return st.sampled_from(list(hint))
    return st.from_type(hint)


def _records(cls: type[Evidence]) -> st.SearchStrategy[Evidence]:
    hints = get_type_hints(cls)
    named = {f.name for f in fields(cls)}
    values: dict[str, st.SearchStrategy[Any]] = {}
    for f in fields(cls):
        if f.metadata.get("merged") and get_origin(hints[f.name]) is dict:
            # another layer's keys: never one of the record's own names
            values[f.name] = st.dictionaries(st.text("xyz", min_size=1, max_size=3).filter(lambda k: k not in named),
                                             _SCALARS, max_size=2)
        else:
            values[f.name] = _strategy(hints[f.name])
    return st.builds(cls, **values)


def _record_types() -> list[tuple[str, type[Evidence]]]:
    return [(check.name, kind) for check in registered() for kind in check.evidence]


def test_every_registered_check_names_its_evidence_records() -> None:
    assert all(check.evidence for check in registered()), [c.name for c in registered() if not c.evidence]


@pytest.mark.parametrize(("check", "kind"), _record_types(), ids=lambda v: getattr(v, "__name__", v))
def test_each_record_round_trips_through_its_json(check: str, kind: type[Evidence]) -> None:
    @settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(_records(kind))
    def round_trip(record: Evidence) -> None:
        text = json.dumps(record.to_dict())
        again = read_evidence(json.loads(text), record_types(check))
        assert json.dumps(again.to_dict()) == text

    round_trip()


def test_a_loaded_report_holds_each_checks_record(tmp_path: Path) -> None:
    smoke = SmokeEvidence(5, "ok", ["rank 0: exit 0"], {"total_s": 1.5}, 5, [], "runs/1")
    determinism = DeterminismEvidence(1, 5, Tolerance(0.0, 0.0), [], ["a", "b"], likely_causes=["an RNG"])
    report = Report(job="toy", checks=[CheckResult("smoke", "passed", "ok", smoke),
                                       CheckResult("determinism", "failed", "differs", determinism),
                                       CheckResult("nosuch", "passed", "a newer version's", Recorded({"k": [1]}))])
    path = report.write(tmp_path / "report.json")
    loaded = load_report(path)
    assert [type(c.evidence) for c in loaded.checks] == [SmokeEvidence, DeterminismEvidence, Recorded]
    assert loaded.checks[0].evidence == smoke and loaded.checks[1].evidence == determinism
    assert loaded.to_json() == report.to_json()
    assert determinism.samples is UNSET and "samples" not in json.loads(path.read_text())["checks"][1]["evidence"]


def test_evidence_that_is_not_its_record_names_the_file_and_the_key(tmp_path: Path) -> None:
    data = json.loads(Report(job="toy", checks=[CheckResult("smoke", "passed", "ok", SmokeEvidence(
        5, "ok", [], {}, 5, [], "runs/1"))]).to_json())
    data["checks"][0]["evidence"]["metric_steps_seen"] = "five"
    path = tmp_path / "report.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ConfigError) as caught:
        load_report(path)
    assert caught.value.path == str(path) and caught.value.key == "checks[0].evidence.metric_steps_seen"
    assert "expected int, got str" in str(caught.value)


def test_a_record_has_no_string_keys_to_read() -> None:
    """Readers read attributes: a record is no mapping (mypy rejects ``result.evidence["x"]``),
    and only its report form (``to_dict()``, where it leaves the process) has keys."""
    record = SmokeEvidence(5, "ok", [], {}, 5, [], "runs/1")
    for kind in {kind for _, kind in _record_types()} | {Evidence, Recorded} | set(_fault_records()):
        assert not any(hasattr(kind, name) for name in ("__getitem__", "get", "keys", "items")), kind
    with pytest.raises(TypeError):
        record["steps"]  # type: ignore[index]
    assert record.to_dict()["steps"] == 5


def _fault_records() -> list[type[Evidence]]:
    """Each registered fault's record: the type its ``evidence()`` returns."""
    found = []
    for kind in FAULTS:
        record = get_type_hints(fault_class(kind).evidence)["return"]  # type: ignore[attr-defined]
        assert isinstance(record, type) and issubclass(record, FaultEvidence), kind
        found.append(record)
    return list(dict.fromkeys(found))


@pytest.mark.parametrize("kind", _fault_records(), ids=lambda v: v.__name__)
def test_each_faults_record_round_trips_through_its_json(kind: type[Evidence]) -> None:
    """A drill report's ``fault_evidence`` (the record's ``to_dict()``) reads back as the
    fault's record and is written again byte for byte."""
    @settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(_records(kind))
    def round_trip(record: Evidence) -> None:
        text = json.dumps(record.to_dict())
        again = kind.from_dict(json.loads(text))
        assert json.dumps(again.to_dict()) == text

    round_trip()


def test_a_faults_evidence_keeps_the_reports_keys_in_order_and_reads_back_from_a_drill_report(tmp_path: Path) -> None:
    """What a fault did leaves the process as the keys the report always held (the strike
    first, absent keys left out), and comes back as the same record from a loaded report."""
    fault = PreemptFault(FaultParams({"grace": 5}), rank=1, after_step=3)
    fault.sent = [SignalSent("SIGTERM", 0.0, [0, 1]), SignalSent("SIGKILL", 5.01, [1])]
    fault.exits, fault.killed_at_grace = {1: 5.2, 0: 0.4}, [1]
    written = fault.evidence().to_dict()
    assert list(written) == ["fault", "rank", "after_step", "injected_at_s", "cleared_at_s", "style", "grace_s",
                             "signals_sent", "rank_exit_after_notice_s", "killed_at_grace"]
    assert written["signals_sent"][1] == {"signal": "SIGKILL", "at_s": 5.01, "ranks": [1]}
    found = DrillEvidence(1.0, 3, 1, 3, None, None, 0, [], StepRate("steps/s", 1.0, None), written, "runs/ref")
    report = DrillReport("preempt", "recover", 1, 3, None, 20, found=found)
    path = Report(job="toy", checks=[CheckResult("drill:pre", "passed", "ok", report)]).write(tmp_path / "r.json")
    loaded = load_report(path).checks[0].evidence
    assert isinstance(loaded, DrillReport) and isinstance(loaded.found, DrillEvidence)
    assert json.dumps(loaded.to_dict()) == json.dumps(report.to_dict())  # the same JSON, byte for byte
    again = PreemptEvidence.from_dict(loaded.found.fault_evidence)
    assert again == fault.evidence() and again.rank_exit_after_notice_s == {0: 0.4, 1: 5.2}
    kill = KillDuringSaveFault(FaultParams({"wait": 30}))
    assert list(kill.evidence().to_dict()) == ["fault", "rank", "after_step", "injected_at_s", "cleared_at_s",
                                               "mechanism", "held_write", "killed", "kill_to_exit_s",
                                               "waited_for_write_s", "no_write", "latest_complete_at_kill"]
