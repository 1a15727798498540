"""The records of crash_points, the numerics drill, the chaos soak, the Slurm drill and Ray
Train's recovery leave the process as the objects their dicts used to be, key for key and in the same order, and a written report loads
back to the same records (issue 43: evidence typed to the reader)."""

from __future__ import annotations

import json
from pathlib import Path

from trainguard.checks.equivalence_records import TrajectoryEvidence
from trainguard.config.records import load_report
from trainguard.drills.crash_records import BoundaryNotReached, BoundaryOutcome, CrashPointsEvidence
from trainguard.drills.evidence import (
    AttemptEvidence,
    DrillReport,
    ExitOfRank,
    FirstNonfinite,
    ForecastInputs,
    NonfiniteEvidence,
    NonfiniteOnRank,
    NumericsEvidence,
    PutInto,
    RayRecoverEvidence,
    RayRestart,
    RestartCosts,
    Resume,
    SlurmAttemptSpan,
    SlurmDrillEvidence,
    SlurmInjection,
    SlurmStepNotReached,
    SoakEvidence,
    SoakFaultOutcome,
    SoakForecast,
    SoakMeasured,
    SoakReport,
    SoakRuns,
    StepRate,
    StepsLost,
)
from trainguard.drills.nonfinite import numerics_evidence
from trainguard.evidence import Evidence
from trainguard.faults.soak import SoakEvent
from trainguard.launch import MetricPoint
from trainguard.report import CheckResult, Report


def _through_a_report(tmp_path: Path, name: str, record: Evidence) -> tuple[Evidence, dict]:
    """``record`` written in a report file and loaded back; and its object as the file holds it."""
    path = Report(job="toy", checks=[CheckResult(name, "failed", "x", record)]).write(tmp_path / "report.json")
    loaded = load_report(path).checks[0].evidence
    return loaded, json.loads(path.read_text())["checks"][0]["evidence"]


def test_crash_points_rows_keep_their_keys_in_the_order_they_were_written(tmp_path: Path) -> None:
    """A boundary not reached says its outcome before where it resumed from; a crashed one
    after (and its power-mode and per-rank keys only when there are some)."""
    missed = BoundaryNotReached("rank 0: after write #1 of /c.tmp", "write", "/c.tmp", 0, 1, "not reached", None,
                                "the crash run never made that operation (ok)")
    torn = BoundaryOutcome("rank 1: after rename of /c.tmp -> /c", "rename", "/c.tmp", 1, 1, 5, "torn",
                           "the ranks resumed from different steps", undone=2, ranks_resumed_from={"0": 5, "1": 10})
    control = BoundaryOutcome("rank 0: a kill before the save's first operation", "create", "/c.tmp", 0, 1, 10,
                              "safe", "resumed from step 10 and matched")
    record = CrashPointsEvidence("power", 10, save_after_step=10, boundaries_found=2, boundaries_explored=2,
                                 by_op={"write": 1, "rename": 1}, outcomes=[missed, torn], first_unsafe=torn,
                                 fix="commit a save", runs=5, work_dir="/w", control=control)
    loaded, written = _through_a_report(tmp_path, "crash_points", record)
    assert loaded == record and type(loaded.outcomes[0]) is BoundaryNotReached  # type: ignore[attr-defined]
    assert list(written["outcomes"][0]) == ["boundary", "op", "path", "rank", "ordinal", "outcome",
                                            "resumed_from_step", "detail"]
    assert list(written["outcomes"][1]) == ["boundary", "op", "path", "rank", "ordinal", "undone",
                                            "resumed_from_step", "ranks_resumed_from", "outcome", "detail"]
    assert list(written["control"]) == ["boundary", "op", "path", "rank", "ordinal", "resumed_from_step",
                                        "outcome", "detail"]


def test_the_numerics_record_is_the_object_it_was(tmp_path: Path) -> None:
    """numerics_evidence gives the object the drill always wrote (ranks as keys, the first 50
    steps, the count), and a handle_nonfinite report loads back to the same record."""
    nan = float("nan")
    points = [MetricPoint("loss", s, v, r, s + 0.1 * r) for r, s, v in
              [(0, 1, 1.0), (1, 1, 1.0), (1, 2, nan), (0, 3, float("inf")), (1, 3, nan), (1, 3, nan), (1, 5, nan)]]
    numerics = numerics_evidence(points, 2, [0, 1])
    assert numerics == NumericsEvidence(FirstNonfinite(2, 1, "loss", "nan"),
                                        {0: NonfiniteOnRank(3, "loss", [3], 1), 1: NonfiniteOnRank(2, "loss", [2, 3, 5], 3)},
                                        4, [3, 5], [0, 1], [0, 1], True)
    numerics.put_into = PutInto(1, 2, "loss", "nan", "torch.nn.functional.mse_loss")
    judged = NonfiniteEvidence(1.0, 2, 1, 2, 0.5, 1.5, 0, [], StepRate("steps/s", None, None), {}, "/ref",
                               exit_after_s=0.4, numerics=numerics)
    report = DrillReport("nan", "handle_nonfinite", 1, 2, None, 8, found=judged)
    loaded, written = _through_a_report(tmp_path, "drill:nan", report)
    assert loaded == report
    assert written["numerics"]["nonfinite_by_rank"]["1"] == {"first_step": 2, "metric": "loss", "steps": [2, 3, 5],
                                                            "count": 3}
    assert list(written["numerics"]) == ["first_nonfinite", "nonfinite_by_rank", "later_nonfinite_points",
                                         "later_nonfinite_steps", "later_nonfinite_ranks", "reached_ranks",
                                         "reached_every_rank", "put_into"]


def test_a_soaks_schedule_faults_and_measurements_load_back_as_records(tmp_path: Path) -> None:
    forecast = SoakForecast(61.5, 0.81, ForecastInputs({"kill_rank": 3.2}, 1.25, 2, "half an interval"), 0.025)
    measured = SoakMeasured(60.0, 50.0, "the uninterrupted run's wall-clock", 0.8333, 2, RestartCosts(3.1, 3.2, 3.5),
                            StepsLost(3, 1.5), 0.25, 5, None, forecast=forecast)
    faults = [SoakFaultOutcome(0, "kill_rank", 1, 6, 0, 6, attempt_ended="killed by SIGKILL", resumed_from_step=5,
                               lost_steps=1, fault_to_first_step_after_restart_s=3.1),
              SoakFaultOutcome(1, "kill_rank", 0, 12, None, None, error="inject() raised OSError: x")]
    found = SoakEvidence(2, TrajectoryEvidence("loss", 20, None, None, 0.0, 0.0, []), faults=faults,
                         measured=measured, drill_dir="/d", run_dir="/d/run", reference_run_dir="/r")
    runs = SoakRuns("soak", [3, 4], [SoakReport("soak", "recover", 3, 20, [SoakEvent(0, "kill_rank", 1, 6)], found=found),
                                      SoakReport("soak", "recover", 4, 20, [SoakEvent(0, "preempt", 0, 7)])])
    loaded, written = _through_a_report(tmp_path, "drill:soak", runs)
    assert loaded == runs and isinstance(loaded.runs[0].schedule[0], SoakEvent)  # type: ignore[attr-defined]
    first = written["runs"][0]
    assert first["schedule"] == [{"index": 0, "kind": "kill_rank", "rank": 1, "step": 6}]
    assert list(first["faults"][0]) == ["index", "kind", "rank", "step", "attempt", "injected_after_step",
                                        "attempt_ended", "resumed_from_step", "lost_steps",
                                        "fault_to_first_step_after_restart_s"]
    assert list(first["measured"]) == ["wall_s", "failure_free_wall_s", "failure_free_basis", "goodput", "faults",
                                       "restart_s", "lost_steps", "step_s", "checkpoint_every_steps",
                                       "checkpoint_save_s", "forecast"]
    assert list(first["measured"]["forecast"]) == ["wall_s", "goodput", "inputs", "wall_error"]


def test_a_slurm_drills_record_loads_back_as_itself_whichever_path_it_took(tmp_path: Path) -> None:
    """Judged (the final state a word), or ended before the step (Slurm's account an object):
    each loads back as the record it was written from, the keys in the order they were gathered."""
    judged = SlurmDrillEvidence("node_down", 8, 30, "42", "/l/out", fault_evidence=SlurmInjection(
        "scontrol update NodeName=n1 State=DOWN", node="n1", node_state_before_resume="IDLE", down_s=1.5),
        injected_step=8, state="COMPLETED", restarts=1,
        attempts=[SlurmAttemptSpan(0, "n1", 1, 9), SlurmAttemptSpan(1, "n1", 8, 30)], lost_steps=1,
        steps_trained_but_not_in_the_log=[], trajectory=TrajectoryEvidence("loss", 30, None, None, 0.0, 0.0, []),
        fault_to_first_step_after_restart_s=2.25)
    loaded, written = _through_a_report(tmp_path, "drill:slurm-node", judged)
    assert loaded == judged
    assert list(written) == ["fault", "after_step", "steps", "job_id", "log", "fault_evidence", "injected_step",
                             "state", "restarts", "attempts", "lost_steps", "steps_trained_but_not_in_the_log",
                             "trajectory", "fault_to_first_step_after_restart_s"]
    late = SlurmStepNotReached("requeue", 8, 30, "42", "/l/out", {"state": "COMPLETED", "source": "sacct", "restarts": 0})
    assert _through_a_report(tmp_path / "late", "drill:slurm-late", late)[0] == late
    not_injected = SlurmDrillEvidence("requeue", 8, 30, "42", "/l/out")
    assert _through_a_report(tmp_path / "none", "drill:slurm-none", not_injected)[0] == not_injected


def test_a_ray_recovers_restart_and_each_attempts_exits_load_back(tmp_path: Path) -> None:
    """Ray Train's restart (ranks as keys) and how each rank of an attempt ended are records."""
    ray = RayRestart(2, {0: 100, 1: 101}, restarts=1, workers_after={0: 200, 1: 201}, failure_noticed_after_s=0.5,
                     failure_notice="worker died", workers_up_after_s=2.0, resume=Resume(9, 8, 1), first_step_after_s=3.0,
                     unreported_steps=[8])
    attempt = AttemptEvidence("failed", "rank 1 killed", [ExitOfRank(0, None, "SIGKILL", True),
                                                          ExitOfRank(1, -9, "SIGKILL", False)], 9, 4.5, "/a")
    judged = RayRecoverEvidence(1.0, 9, 0, 9, 0.5, 1.5, 1, [attempt], StepRate("steps/s", None, None), {}, "/ref",
                                ray=ray)
    report = DrillReport("kill_rank", "recover", 1, 9, None, 20, found=judged)
    loaded, written = _through_a_report(tmp_path, "drill:ray", report)
    assert loaded == report
    assert written["ray"]["workers_at_fault"] == {"0": 100, "1": 101} and written["ray"]["resume"] == {
        "last_step_before": 9, "resumed_from_step": 8, "lost": 1}
    assert written["attempts"][0]["exits"][1] == {"rank": 1, "returncode": -9, "signal": "SIGKILL",
                                                  "killed_by_trainguard": False}
