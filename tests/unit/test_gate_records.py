"""The gate report's parts are records the gate reads by attribute (issue 43: no
``Sizing.to_dict`` -> dict -> ``Sizing.from_dict`` inside one process): what ``trainguard
submit`` reads back of a written report is what the gate held, and the cost's launch records
come back from the report's ``cost`` as the records they were."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from tests.unit.test_goodput import _sizing
from trainguard.config import GatePolicy
from trainguard.gate.policy import Capabilities, Decision
from trainguard.gate.provenance import provenance_for
from trainguard.gate.run import (
    GateReport,
    NotSubmitted,
    SubmittableReport,
    read_gate_report,
    write_gate_report,
)
from trainguard.queue.base import Submission
from trainguard.report import CheckResult, Report
from trainguard.run.runner import LaunchRecord
from trainguard.session.cost import LaunchCost, Projection, measured_cost, records_from_report

JOB = Path(__file__).resolve().parents[1] / "data" / "jobs" / "toy.trainguard.yaml"
LAUNCHES = [LaunchRecord("reference", 1, 10.00049, 4.0, 60), LaunchRecord("parallel", 2, 8.0, None, 0)]


def _gate(**changes: object) -> GateReport:
    fields: dict[str, object] = {
        "job": "toy", "job_file": str(JOB), "decision": Decision("promote"),
        "report": Report(job="toy", checks=[CheckResult("smoke", "passed", "ok")]),
        "provenance": provenance_for(JOB), "capabilities": Capabilities(gpus=2, root=False, ray=False),
        "policy": GatePolicy.model_validate({}), "sizing": _sizing(), "mlflow_session_run_id": "run-1",
        "cost": measured_cost(LAUNCHES, 5.0)}
    return GateReport(**{**fields, **changes})  # type: ignore[arg-type]


def test_what_submit_reads_back_is_what_the_gate_held(tmp_path: Path) -> None:
    gate = _gate()
    read = read_gate_report(write_gate_report(gate, tmp_path)["json"])
    assert read == SubmittableReport.of(gate)
    assert read.sizing == gate.sizing and read.provenance == gate.provenance and read.gpus == 2
    blocked = _gate(decision=Decision("block", ["smoke failed"]), sizing=None, mlflow_session_run_id=None)
    read = read_gate_report(write_gate_report(blocked, tmp_path / "blocked")["json"])
    assert read == SubmittableReport.of(blocked) and read.reasons == ["smoke failed"] and read.sizing is None


def test_the_cost_is_written_as_its_report_object_and_its_launches_read_back(tmp_path: Path) -> None:
    cost = measured_cost(LAUNCHES, 5.0)
    assert cost.records == [LaunchCost("reference", 1, 10.0, 4.0, 60), LaunchCost("parallel", 2, 8.0, None, 0)]
    assert isinstance(cost.projection, Projection) and cost.projection.step_seconds == {"1": 0.1}
    path = Path(write_gate_report(_gate(cost=cost), tmp_path)["json"])
    written = json.loads(path.read_text())["cost"]
    assert list(written) == ["launches", "measured", "rank_seconds", "startup_s_per_launch", "startup_share",
                             "projection", "note", "records", "reads"]
    assert written["reads"] == {}  # no check read another's run here
    assert written["records"][0] == {"label": "reference", "world_size": 1, "seconds": 10.0, "first_step_s": 4.0,
                                     "steps": 60}
    assert written["rank_seconds"] == 26.0 and written["startup_share"] == round(4.0 / 26.0, 3)
    assert records_from_report(path) == [LaunchCost(None, r.world_size, r.seconds, r.first_step_s, r.steps)
                                         for r in cost.records]
    assert cost.reported().line() in path.with_suffix(".md").read_text()
    # the gate's default invariants check launches nothing: its seconds reading a run are on the line
    read = dataclasses.replace(cost, reads={"invariants": 0.42})
    assert "(15% of the rank-seconds); invariants 0.4 s reading a run another check made (no launch); on the" \
        in read.line(), read.line()
    assert read.to_dict()["reads"] == {"invariants": 0.4}


def test_the_submission_is_written_as_the_queue_and_the_gate_always_wrote_it(tmp_path: Path) -> None:
    """A queue's Submission is its fields (its note only when there is one); a submission the gate
    did not make is its status and why."""
    queued = Submission("slurm", "pending", "submitted", job_id="42", links={"record": "/r.json"},
                        evidence={"state": "PENDING"})
    assert list(queued.to_dict()) == ["backend", "status", "message", "job_id", "links", "script", "evidence",
                                      "submitted_at"]
    queued.note = "an embedded head"
    assert list(queued.to_dict())[-1] == "note"
    written = json.loads(Path(write_gate_report(_gate(submission=queued), tmp_path)["json"]).read_text())
    assert written["submission"] == queued.to_dict()
    blocked = _gate(submission=NotSubmitted("not_submitted", "blocked: nothing was submitted"))
    written = json.loads(Path(write_gate_report(blocked, tmp_path / "b")["json"]).read_text())
    assert written["submission"] == {"status": "not_submitted", "message": "blocked: nothing was submitted"}
