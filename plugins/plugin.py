"""The pytest entry point of trainguard (``pytest11``): options, markers, hooks, summary.

Hooks only: the work is done by the library (``trainguard.*``) and the session object in
:mod:`trainguard.plugins.session`. Nothing here imports torch; tests that use a marker needing it
(``seeded``) import it when they run.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
from pathlib import Path
from typing import Any

import pytest
from trainguard.plugins.collect import CHECK_RESULT_PROPERTY, collect_job_file
from trainguard.plugins.ddp import CHILD_ENV, ChildRecorder, parent_call, request_parent_fixtures
from trainguard.plugins.markers import MARKERS, validate_marker
from trainguard.plugins.session import (
    SEED_EXPLICIT_PROPERTY,
    SEED_PROPERTY,
    SESSION_KEY,
    SeededFailure,
    TrainguardSession,
    get_session,
)

from trainguard.config.settings import OPTIONS, get_option, resolve
from trainguard.errors import ConfigError, UsageError

_DETERMINISTIC_KEY = pytest.StashKey[Any]()


def pytest_addoption(parser: pytest.Parser) -> None:
    """Register every setting as a ``--trainguard-*`` flag and a ``trainguard_*`` ini key."""
    group = parser.getgroup("trainguard", "trainguard (training-code checks)")
    for opt in OPTIONS:
        help_text = f"{opt.help} [env {opt.env}; ini {opt.ini}; default {opt.default!r}]"
        group.addoption(opt.flag, dest=opt.ini, default=None, metavar=opt.metavar, help=help_text)
        parser.addini(opt.ini, help=opt.help, default=None)


def pytest_configure(config: pytest.Config) -> None:
    """Resolve settings (CLI > env > ini > default), register markers, create the session."""
    from trainguard._internal.logsafe import safe_logger_registry

    safe_logger_registry()  # our threads add loggers while pytest's logging plugin walks them
    for spec in MARKERS.values():
        config.addinivalue_line("markers", spec.line)
    cli = {opt.name: config.getoption(opt.ini) for opt in OPTIONS}
    ini = {opt.name: config.getini(opt.ini) for opt in OPTIONS}
    try:
        settings = resolve(cli=cli, ini=ini, environ=os.environ)
    except ConfigError as exc:
        raise pytest.UsageError(f"trainguard: {exc}") from None
    if settings.report_json is not None and not hasattr(config, "workerinput"):
        from trainguard._internal.atomic import unwritable_reason

        reason = unwritable_reason(settings.report_json)
        if reason is not None:  # said before any test spends its time, not after all of them
            source = settings.sources["report_json"]  # name it as the user wrote it
            raise pytest.UsageError(
                f"trainguard: {get_option('report_json').spelling(source)}: cannot write the report "
                f"to {settings.report_json} (from the {source}): {reason}. Name a file in a "
                "writable directory")
    config.stash[SESSION_KEY] = TrainguardSession(settings=settings)
    config.pluginmanager.register(_SessionRecorder(config), "trainguard-recorder")
    if os.environ.get(CHILD_ENV):
        config.pluginmanager.register(ChildRecorder(), "trainguard-ddp-child")


class _SessionRecorder:
    """Hooks that need the config but receive none (registered per session, xdist-style)."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        """Record check verdicts and failed seeded tests with their reproduction command. Under
        xdist this runs on the controller too: user_properties travel with the report."""
        props = dict(report.user_properties)
        if report.when == "call" or (report.when == "setup" and report.skipped):
            raw = props.get(CHECK_RESULT_PROPERTY)
            if raw is not None:
                from trainguard.config.records import result_of

                result = result_of(json.loads(str(raw)))
                get_session(self.config).check_results.append((report.nodeid, result))
        if not report.failed or report.when == "teardown":
            return
        if SEED_PROPERTY not in props:
            return
        seed = int(str(props[SEED_PROPERTY]))
        get_session(self.config).seeded_failures.append(
            SeededFailure(report.nodeid, seed, _reproduce(report.nodeid, seed, props))
        )


def _reproduce(nodeid: str, seed: int, props: dict[str, Any]) -> str:
    command = f"pytest {shlex.quote(nodeid)}"
    if not props.get(SEED_EXPLICIT_PROPERTY):
        command += f" --trainguard-seed={seed}"
    return command


@pytest.hookimpl(tryfirst=True)  # before -m deselects by marker
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests that use ``tg_canary`` carry the ``canary`` marker (``pytest -m canary``); ``ddp``
    tests request the fixtures their launch uses."""
    for item in items:
        if "tg_canary" in getattr(item, "fixturenames", ()):
            item.add_marker("canary")
        request_parent_fixtures(item)


def pytest_collect_file(file_path: Path, parent: pytest.Collector) -> pytest.Collector | None:
    """Collect ``trainguard.yaml`` / ``*.trainguard.yaml`` as one item per check (switch off
    with ``trainguard_collect_yaml = false``)."""
    return collect_job_file(file_path, parent)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """Validate trainguard markers, skip for missing GPUs, seed before any fixture runs."""
    for name in MARKERS:
        for marker in item.iter_markers(name):
            try:
                validate_marker(name, marker.args, marker.kwargs)
            except UsageError as exc:
                pytest.fail(f"{item.nodeid}: {exc}", pytrace=False)

    gpu_marker = item.get_closest_marker("gpu")
    if gpu_marker is not None:
        needed = validate_marker("gpu", gpu_marker.args, gpu_marker.kwargs).arguments["count"]
        from trainguard._internal.machine import gpu_inventory

        inventory = gpu_inventory()
        if inventory.count < needed:
            # _use_item_location: -rs shows the test's file and line (as skip markers do), not
            # this hook's
            raise pytest.skip.Exception(
                f"needs {needed} GPU(s), found {inventory.count} ({inventory.how})",
                _use_item_location=True,
            )

    seeded = item.get_closest_marker("seeded")
    if seeded is not None:
        settings = get_session(item.config).settings
        explicit = validate_marker("seeded", seeded.args, seeded.kwargs).arguments["seed"]
        seed = settings.seed if explicit is None else explicit
        item.user_properties.append((SEED_PROPERTY, seed))
        item.user_properties.append((SEED_EXPLICIT_PROPERTY, explicit is not None))
        from trainguard.unit.seeding import deterministic_mode, seed_everything

        seed_everything(seed)
        if settings.deterministic:
            context = deterministic_mode(True)
            context.__enter__()
            item.stash[_DETERMINISTIC_KEY] = context


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> bool | None:
    """``@pytest.mark.ddp``: run the test on N rank processes instead of here (inside a rank,
    :class:`~trainguard.plugins.ddp.ChildRecorder` wraps the call in a process group)."""
    if pyfuncitem.get_closest_marker("ddp") is None or os.environ.get(CHILD_ENV):
        return None
    parent_call(pyfuncitem)
    return True  # the ranks ran the test; it is not called again here


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item: pytest.Item) -> None:
    """Leave deterministic mode entered for a seeded test (restores the previous state)."""
    context = item.stash.get(_DETERMINISTIC_KEY, None)
    if context is not None:
        del item.stash[_DETERMINISTIC_KEY]
        context.__exit__(None, None, None)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> None:
    """Add the seed to a failed seeded test's report section so it shows next to the failure."""
    if call.when != "call" or call.excinfo is None:
        return
    props = dict(item.user_properties)
    if SEED_PROPERTY in props:
        seed = int(str(props[SEED_PROPERTY]))
        item.add_report_section(
            "call", "trainguard", f"seeded with {seed}; reproduce: {_reproduce(item.nodeid, seed, props)}"
        )


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    """The ``trainguard`` section: check verdicts, report paths, how to reproduce failures."""
    session = config.stash.get(SESSION_KEY, None)
    if session is None:
        return
    lines: list[str] = []
    for nodeid, result in session.check_results:
        lines.append(f"{result.status.upper():7} {result.name}: {result.summary}  [{nodeid}]")
        if result.reproduce and not result.ok:
            lines.append(f"        reproduce: {result.reproduce}")
    for failure in session.seeded_failures:
        lines.append(f"FAILED  {failure.nodeid} (seed {failure.seed}); reproduce: {failure.reproduce}")
    for path in session.report_paths:
        lines.append(f"report: {path}")
    lines += session.gate_lines
    if lines:
        terminalreporter.write_sep("=", "trainguard")
        for line in lines:
            terminalreporter.write_line(line)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Write the session report when ``--trainguard-report-json`` is set (controller only), then
    log it to the MLflow session run(s) and flush (see :mod:`trainguard.plugins.tracking`)."""
    config = session.config
    state = config.stash.get(SESSION_KEY, None)
    if state is None:
        return
    for runner in state.runners.values():  # e.g. the embedded Ray head of a ray_train job
        runner.close()
    if not hasattr(config, "workerinput"):
        from trainguard.plugins.gate import judge_gates

        if not judge_gates(config, state) and session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED  # a blocked gate fails the run
    from trainguard.report import Report

    report = Report(job="pytest-session", checks=[r for _, r in state.check_results],
                    interrupted=exitstatus == pytest.ExitCode.INTERRUPTED)  # Ctrl-C: what finished
    path = None
    if not hasattr(config, "workerinput") and state.settings.report_json is not None:
        path = report.save(state.settings.report_json)  # a failing write falls back, said
        if path is None:
            sys.stdout.write(report.to_json())  # nowhere took it: the results stay on stdout
        state.report_paths.append(f"{path or '(not written; printed above)'}"
                                  + (f" ({report.write_problem})" if report.write_problem else ""))
    from trainguard.plugins.tracking import finish_session

    finish_session(config, path, report.status)


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node: Any) -> None:
    """pytest-xdist controller: hand each worker the registry of the shared MLflow session run."""
    from trainguard.plugins.tracking import configure_node

    configure_node(node)
