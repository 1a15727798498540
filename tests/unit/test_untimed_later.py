"""A check's untimed rest (a ``Later``) runs after the session's timed checks, beside the other
checks' rests, each nested under its own check run in the tracking store.

Two checks registered for the test (``tail_a``, ``tail_b``) each launch a first run, then a
"rest" run. In a session (``run_in_order``) the rest is a ``Later``; from ``run_check`` alone
(the pytest items) it runs at once.
"""

from __future__ import annotations

import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers import TOY, runs_by_kind
from trainguard.config.registry import register, unregister
from trainguard.session import check as run_check_file

pytestmark = pytest.mark.timeout(240)

TAILS_MODULE = '''
import threading

from pydantic import Field

from trainguard.config import CheckSpec
from trainguard.config.registry import Check, Later, Run
from trainguard.report import CheckResult

EVENTS = []
#: both rests wait here for each other: run one after the other, the first times out
BOTH = threading.Barrier(2, timeout=60)


class TailCheck(CheckSpec):
    steps: int = Field(3, ge=1)


def _runner_for(name):
    def run(ctx):
        first = ctx.run("first", label=f"{name}-first")
        EVENTS.append(f"{name}-first")

        def rest(together):
            if together:
                BOTH.wait()
            again = ctx.run("rest", label=f"{name}-rest")
            EVENTS.append(f"{name}-rest")
            ok = first.ok and again.ok
            return CheckResult(name, "passed" if ok else "failed", f"{name}: both runs ended")

        if ctx.state.untimed_later:
            return Later(lambda: rest(True))
        return rest(False)

    return run


def _runs(spec, ctx):
    return [Run("first"), Run("rest")], "two runs"


TAIL_A = Check("tail_a", TailCheck, run=_runner_for("tail_a"), runs=_runs)
TAIL_B = Check("tail_b", TailCheck, run=_runner_for("tail_b"), runs=_runs)
'''


@pytest.fixture
def tails(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[object]:
    """The two checks registered (before the drills), tracking on in a store of the test's own;
    the module's event list is returned."""
    import importlib

    (tmp_path / "tg_tail_checks.py").write_text(TAILS_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("TRAINGUARD_TRACKING", "on")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")
    lines = ["tg_tail_checks:TAIL_A", "tg_tail_checks:TAIL_B"]
    for line in lines:
        register(line, before="drills")
    module = importlib.import_module("tg_tail_checks")
    module.EVENTS.clear()
    module.BOTH.reset()
    try:
        yield module
    finally:
        for line in lines:
            unregister(line)


def _job(where: Path) -> Path:
    where.mkdir(parents=True, exist_ok=True)
    path = where / "trainguard.yaml"
    path.write_text(textwrap.dedent(f"""\
        job:
          name: tails-job
          command: "python {TOY} --steps {{steps}} --seed {{seed}} --ckpt-dir {{checkpoint_dir}}"
          world_size: 1
          metrics:
            loss: 'step (?P<step>\\d+) loss (?P<value>\\S+)'
          timeout: 60
          stall_timeout: 20
        checks:
          tail_a: {{steps: 3}}
          tail_b: {{steps: 4}}
        """))
    return path


def test_the_rests_run_after_the_timed_parts_beside_each_other_each_tracked_under_its_check(
        tails: object, tmp_path: Path) -> None:
    path = _job(tmp_path / "job")
    report = run_check_file(str(path))
    events = tails.EVENTS  # type: ignore[attr-defined]
    # both first runs before either rest: the rests waited for the session's other checks
    assert events[:2] == ["tail_a-first", "tail_b-first"], events
    # both rests ended: they met at the barrier, so they ran at the same time
    assert sorted(events[2:]) == ["tail_a-rest", "tail_b-rest"], events
    assert [(c.name, c.status) for c in report.checks] == [("tail_a", "passed"), ("tail_b", "passed")]

    runs = runs_by_kind(report.tracking_uri)
    checks = {r.info.run_name: r for r in runs["check"]}
    assert {name: r.info.status for name, r in checks.items()} == {"tail_a": "FINISHED", "tail_b": "FINISHED"}
    launches = {r.info.run_name: r for r in runs["launch"]}
    for name in ("tail_a", "tail_b"):
        for label in (f"{name}-first", f"{name}-rest"):
            parent = launches[label].data.tags["mlflow.parentRunId"]
            assert parent == checks[name].info.run_id, f"{label} is not nested under {name}"


def test_a_check_run_alone_runs_its_rest_at_once(tails: object, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """From ``run_check`` (the pytest items, ``--only`` one check) no rest is left for later:
    the barrier, which needs two, is never waited on."""
    from trainguard.config import load_config
    from trainguard.session import open_session, run_check, session_settings

    monkeypatch.setenv("TRAINGUARD_TRACKING", "off")
    job_file = load_config(_job(tmp_path / "alone"))
    with open_session(job_file, session_settings(), command="check") as session:
        result = run_check(session.runner, "tail_a", job_file.checks.tail_a)  # type: ignore[attr-defined]
    assert result.status == "passed"
    assert tails.EVENTS == ["tail_a-first", "tail_a-rest"]  # type: ignore[attr-defined]
