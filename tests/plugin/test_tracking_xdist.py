"""MLflow tracking of a pytest session: one session run across pytest-xdist workers, with the
checks nested under it and the session's report logged to it (a real sqlite store)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import runs_by_kind

pytest.importorskip("mlflow")
pytest.importorskip("xdist")

pytestmark = pytest.mark.timeout(240)

JOBS = Path(__file__).resolve().parents[1] / "data" / "jobs"


@pytest.fixture(scope="module", autouse=True)
def _mlflow_client_loaded(mlflow_store_template: Path) -> None:
    """Import MlflowClient's whole store stack before pytester snapshots ``sys.modules``: it
    drops the modules a test imported, and a second test re-importing half of sqlalchemy fails
    with "'InternalTraversal' object is not callable". Making the empty store does that."""


def artifact_json(uri: str, run_id: str, path: str, dest: Path) -> Any:
    from mlflow import MlflowClient

    return json.loads(Path(MlflowClient(uri).download_artifacts(run_id, path, str(dest))).read_text())


@pytest.fixture
def project(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch,
            new_mlflow_store: Callable[[Path], Path]) -> pytest.Pytester:
    """The toy job as ``trainguard.yaml`` (checks smoke and determinism), tracking on, its store
    a copy of the empty one."""
    monkeypatch.setenv("TRAINGUARD_TRACKING", "on")
    for var in ("MLFLOW_TRACKING_URI", "MLFLOW_RUN_ID", "TRAINGUARD_MLFLOW_RUN_ID"):
        monkeypatch.delenv(var, raising=False)
    shutil.copy(JOBS / "toy_train.py", pytester.path / "toy_train.py")
    shutil.copy(JOBS / "toy.trainguard.yaml", pytester.path / "trainguard.yaml")
    new_mlflow_store(pytester.path / ".trainguard" / "mlflow.db")
    pytester.makeini("[pytest]\naddopts = -p no:hypothesispytest\n")
    return pytester


def test_xdist_workers_share_one_session_run_that_holds_the_verdicts(project: pytest.Pytester) -> None:
    uri = f"sqlite:///{project.path / '.trainguard' / 'mlflow.db'}"
    result = project.runpytest_subprocess("-n", "2")  # smoke and determinism, one per worker
    result.assert_outcomes(passed=2)
    runs = runs_by_kind(uri)
    (session,) = runs["session"]
    assert session.info.run_name == "pytest session"
    assert session.info.status == "FINISHED"
    assert session.data.tags["trainguard.status"] == "passed"
    assert session.data.tags["trainguard.xdist_workers"] == "2"
    checks = runs["check"]
    assert sorted(r.data.tags["trainguard.check"] for r in checks) == ["determinism", "smoke"]
    assert {r.data.tags["mlflow.parentRunId"] for r in checks} == {session.info.run_id}
    check_ids = {r.info.run_id for r in checks}
    assert runs["launch"] and all(r.data.tags["mlflow.parentRunId"] in check_ids for r in runs["launch"])
    # no --trainguard-report-json: the controller logs a summary of every worker's verdicts
    summary = artifact_json(uri, session.info.run_id, "report/pytest-summary.json", project.path / "dl")
    assert summary["status"] == "passed"
    assert sorted((c["name"], c["status"]) for c in summary["checks"]) == [
        ("determinism", "passed"), ("smoke", "passed")]
    assert not (project.path / "mlruns").exists() and not (project.path / "mlflow.db").exists()


@pytest.mark.slow
def test_the_report_json_is_logged_to_the_session_run_without_xdist_too(project: pytest.Pytester) -> None:
    uri = f"sqlite:///{project.path / '.trainguard' / 'mlflow.db'}"
    result = project.runpytest_subprocess("-p", "no:xdist", "-k", "smoke", "--trainguard-report-json=out.json")
    result.assert_outcomes(passed=1, deselected=1)
    (session,) = runs_by_kind(uri)["session"]
    assert session.info.status == "FINISHED" and session.data.tags["trainguard.status"] == "passed"
    report = artifact_json(uri, session.info.run_id, "report/out.json", project.path / "dl")
    assert [c["name"] for c in report["checks"]] == ["smoke"]


@pytest.mark.slow
def test_a_fixture_first_then_a_collected_item_both_track_into_the_session_run(
    project: pytest.Pytester,
) -> None:
    """One runner per job file, always with the session's tracker: which of the fixture or the
    collected item asks for it first must not decide whether the job's runs are tracked."""
    uri = f"sqlite:///{project.path / '.trainguard' / 'mlflow.db'}"
    project.makepyfile(test_a_canary="""
        def test_canary_first(tg_canary):
            tg_canary("trainguard.yaml", steps=8, min_loss_drop=0.0)
    """)  # collected before trainguard.yaml, so the fixture opens the job's runner
    result = project.runpytest_subprocess("-p", "no:xdist", "-k", "canary_first or smoke")
    result.assert_outcomes(passed=2, deselected=1)
    runs = runs_by_kind(uri)
    (session,) = runs["session"]
    checks = {r.data.tags["trainguard.check"]: r for r in runs["check"]}
    assert sorted(checks) == ["canary", "smoke"]
    assert {r.data.tags["mlflow.parentRunId"] for r in checks.values()} == {session.info.run_id}
    parents = {r.data.tags["mlflow.parentRunId"] for r in runs["launch"]}
    assert {checks["canary"].info.run_id, checks["smoke"].info.run_id} <= parents
