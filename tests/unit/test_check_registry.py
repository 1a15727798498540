"""The check registry: a check is one module plus one registration line (docs/architecture.md,
"Adding a check"). A dummy check written in a temp module, registered and nothing else, is
validated, planned, run, reported, gated and collected like the built-in ones."""

from __future__ import annotations

import dataclasses
import json
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers import TOY
from trainguard.config import GatePolicy, load_config
from trainguard.config.records import load_report
from trainguard.config.registry import (
    CheckNotInstalled,
    check_for,
    check_names,
    register,
    registered,
    unregister,
)
from trainguard.config.settings import Settings
from trainguard.errors import ConfigError
from trainguard.session import check as run_check_file
from trainguard.session.plan import make_plan

#: the whole of the dummy check: its spec, what it needs from the job, its runs, how it runs
DUMMY_MODULE = '''
import dataclasses
from dataclasses import dataclass

from pydantic import Field

from trainguard.config import CheckSpec
from trainguard.config.registry import Check, Run
from trainguard.evidence import Evidence, NoEvidence
from trainguard.report import CheckResult


@dataclass
class DummyEvidence(Evidence):
    steps_seen: int
    worst_loss: float


class DummyCheck(CheckSpec):
    """checks.dummy: the loss of one short run stays under a ceiling."""

    steps: int = Field(4, ge=1)
    ceiling: float = Field(gt=0)


def run_dummy(ctx):
    spec = ctx.spec
    result = ctx.run("dummy run", label="dummy")
    losses = [p.value for p in result.points if p.name == "loss"]
    worst = max(losses, default=float("inf"))
    status = "passed" if result.ok and worst <= spec.ceiling else "failed"
    return CheckResult("dummy", status, f"worst loss {worst:.3f} (ceiling {spec.ceiling})",
                       DummyEvidence(len(losses), worst))


def requires(spec, facts):
    if "loss" in facts.job_file.job.metrics:
        return []
    return [("job.metrics", "checks.dummy reads the loss metric. Fix: add a loss regex")]


DUMMY = Check("dummy", DummyCheck, run=run_dummy, requires=requires, lane=True,
              runs=lambda spec, ctx: ([Run("dummy run")], f"the loss stays under {spec.ceiling}"),
              evidence=(DummyEvidence,))


def run_sneaky(ctx):
    """Declares one run of its steps, launches one of twice as many: not what validate prints."""
    if ctx.spec.ask == "label":
        ctx.run("a run it never declared", label="sneaky")
    ctx.pool.run(dataclasses.replace(ctx.request, steps=2 * ctx.request.steps), label="sneaky")
    return CheckResult("sneaky", "passed", "launched what it liked", NoEvidence())


class SneakyCheck(CheckSpec):
    steps: int = Field(3, ge=1)
    ask: str = "request"


SNEAKY = Check("sneaky", SneakyCheck, run=run_sneaky, lane=True,
               runs=lambda spec, ctx: ([Run("sneaky run")], "one run"))
'''


def _registered(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, check: str) -> Iterator[str]:
    """The dummy module on the path and the registration line of its ``check``, taken out
    afterwards."""
    (tmp_path / "tg_dummy_check.py").write_text(DUMMY_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("TRAINGUARD_TRACKING", "off")
    line = f"tg_dummy_check:{check}"
    register(line, before="drills")
    try:
        yield line
    finally:
        unregister(line)


@pytest.fixture
def dummy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """The dummy module on the path and its one registration line, taken out afterwards."""
    yield from _registered(tmp_path, monkeypatch, "DUMMY")


@pytest.fixture
def sneaky(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """The check that launches what it did not declare, registered."""
    yield from _registered(tmp_path, monkeypatch, "SNEAKY")


def _job(where: Path, checks: str, metric: str = "loss") -> Path:
    where.mkdir(parents=True, exist_ok=True)
    path = where / "trainguard.yaml"
    path.write_text(textwrap.dedent(f"""\
        job:
          name: dummy-job
          command: "python {TOY} --steps {{steps}} --seed {{seed}} --ckpt-dir {{checkpoint_dir}}"
          world_size: 1
          metrics:
            {metric}: 'step (?P<step>\\d+) loss (?P<value>\\S+)'
          timeout: 60
          stall_timeout: 20
        checks:
        """) + textwrap.indent(checks, "  "))
    return path


def test_the_built_in_checks_are_registered_in_run_order() -> None:
    assert check_names() == ["smoke", "canary", "determinism", "resume", "compat", "parallel", "invariants",
                             "reshard", "profile", "crash_points"]
    assert check_names(many=True)[-1] == "drills"
    assert check_for("drill:anything") is check_for("drills")
    assert [c.name for c in registered() if c.lane] == ["smoke", "canary", "determinism", "resume", "parallel",
                                                         "invariants"]
    assert [c.name for c in registered() if not c.gate_default] == ["compat", "invariants", "reshard", "crash_points"]


def test_a_dummy_check_is_validated_through_the_registry_alone(dummy: str, tmp_path: Path) -> None:
    job_file = load_config(_job(tmp_path / "ok", "dummy: {ceiling: 5.0}\n"))
    assert [n for n, _ in job_file.enabled_checks()] == ["dummy"]
    assert job_file.checks.dummy.steps == 4 and job_file.checks.dummy.ceiling == 5.0
    with pytest.raises(ConfigError) as typo:
        load_config(_job(tmp_path / "typo", "dummy: {ceiling: 5.0, ceilng: 1}\n"))
    assert "checks.dummy" in str(typo.value) and "did you mean 'ceiling'" in str(typo.value)
    with pytest.raises(ConfigError) as missing:
        load_config(_job(tmp_path / "missing", "dummy: {}\n"))
    assert "checks.dummy.ceiling" in str(missing.value)
    with pytest.raises(ConfigError) as needs:
        load_config(_job(tmp_path / "needs", "dummy: {ceiling: 5.0}\n", metric="acc"))
    assert "checks.dummy reads the loss metric" in str(needs.value)
    assert "dummy" in GatePolicy.model_validate({}).require
    GatePolicy.model_validate({"require": ["dummy"]})


def test_a_dummy_check_is_planned_run_and_reported(dummy: str, tmp_path: Path) -> None:
    path = _job(tmp_path / "run", "smoke: {steps: 3}\ndummy: {ceiling: 5.0, steps: 6}\n")
    plan = make_plan(path, Settings())
    planned = next(c for c in plan.checks if c.name == "dummy")
    assert [(r.label, r.steps, r.world_size) for r in planned.runs] == [("dummy run", 6, 1)]
    assert planned.note == "the loss stays under 5.0"
    report = run_check_file(str(path), report_json=str(tmp_path / "report.json"))
    result = next(c for c in report.checks if c.name == "dummy")
    assert result.status == "passed", result.summary
    assert result.evidence.steps_seen == 6  # type: ignore[attr-defined]
    saved = json.loads((tmp_path / "report.json").read_text())
    assert saved["checks"][1]["evidence"] == {"steps_seen": 6, "worst_loss": result.evidence.worst_loss}  # type: ignore[attr-defined]
    loaded = load_report(tmp_path / "report.json").checks[1].evidence  # rebuilt as the check's record
    assert type(loaded).__name__ == "DummyEvidence" and loaded == result.evidence
    assert [c["name"] for c in saved["checks"]] == ["smoke", "dummy"]


def test_a_dummy_check_fails_when_its_rule_is_broken(dummy: str, tmp_path: Path) -> None:
    """The dummy's verdict is its own: a ceiling under every loss fails."""
    path = _job(tmp_path / "low", "dummy: {ceiling: 0.0001, steps: 3}\n")
    report = run_check_file(str(path), report_json=str(tmp_path / "report.json"))
    assert report.checks[0].status == "failed" and "ceiling 0.0001" in report.checks[0].summary


def test_an_unregistered_check_is_an_unknown_key_again(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as unknown:
        load_config(_job(tmp_path / "gone", "dummy: {ceiling: 5.0}\n"))
    assert "unknown key 'dummy'" in str(unknown.value) and "smoke" in str(unknown.value)


def test_a_registration_line_that_cannot_be_imported_is_said_in_words() -> None:
    before = check_names(many=True)
    with pytest.raises(CheckNotInstalled, match=r"cannot be imported: .*remove its registration line"):
        register("tg_no_such_check_module:CHECK")
    with pytest.raises(CheckNotInstalled, match="not a trainguard Check"):
        register("trainguard.config.registry:CHECKS")
    with pytest.raises(CheckNotInstalled, match="no check is registered as 'smok'"):
        register("trainguard.checks.smoke:SMOKE", before="smok")
    assert check_names(many=True) == before


@pytest.mark.parametrize("ask", ["request", "label"])
def test_a_check_that_launches_a_run_it_did_not_declare_is_refused(sneaky: str, tmp_path: Path, ask: str) -> None:
    """What ``trainguard validate`` prints is what runs: a launch of a request the check did not
    declare (or a run asked for by a label it did not declare) raises before anything starts."""
    from trainguard.run.pool import UndeclaredRun
    from trainguard.run.runner import JobRunner
    from trainguard.session import run_check

    job_file = load_config(_job(tmp_path / "job", f"sneaky: {{ask: {ask}}}\n"))
    runner = JobRunner(job_file)
    with pytest.raises(UndeclaredRun) as refused:
        run_check(runner, "sneaky", job_file.checks.sneaky)
    runner.close()
    said = str(refused.value)
    assert "the sneaky check" in said and "did not declare" in said and "sneaky run" in said, said
    assert "trainguard validate" in said
    assert runner.launches == []  # refused before anything started


def test_a_lane_run_for_a_check_is_admitted_against_that_checks_declared_runs(sneaky: str, tmp_path: Path) -> None:
    """A run started ahead in the lane is the check's it names: one of a request that check did
    not declare is refused before it starts, whichever check runs in the foreground."""
    from trainguard.run.pool import SessionState, UndeclaredRun
    from trainguard.run.runner import JobRunner
    from trainguard.run.scheduling import AheadRun

    job_file = load_config(_job(tmp_path / "job", "sneaky: {}\n"))
    spec = job_file.checks.sneaky
    runner = JobRunner(job_file)
    with runner.pool.session(SessionState(checks=(("sneaky", spec),))):
        (declared,) = runner.pool.declared("sneaky", spec)
        other = dataclasses.replace(declared.request, steps=declared.request.steps + 1)
        with pytest.raises(UndeclaredRun, match="the sneaky check launched 'ahead'"):
            runner.run(other, label="ahead", ahead=AheadRun("sneaky", other, "ahead"))
    runner.close()
    assert runner.launches == []
