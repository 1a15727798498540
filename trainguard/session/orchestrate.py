"""Running the checks of a job file: each through :func:`run_check`, in order, with the lane.

Which checks exist and how each runs is the registry's (:mod:`trainguard.config.registry`).
``trainguard check`` and the pytest items collected from a job file both go through
:func:`run_check`, so a check behaves the same from the CLI and from pytest.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, wait
from typing import TYPE_CHECKING, Any

from trainguard.checks.context import context_for
from trainguard.config import CheckSpec, JobFile
from trainguard.config.registry import Later, check_for, check_names
from trainguard.report import CheckResult, Report, SkipReason
from trainguard.run.declared import progress_metric_of
from trainguard.run.pool import SessionState
from trainguard.run.request import share_key
from trainguard.run.runner import JobRunner
from trainguard.run.scheduling import AheadRun

if TYPE_CHECKING:  # pragma: no cover
    from trainguard.tracking import CheckRun

__all__ = [
    "available_checks",
    "check",
    "lane_plan",
    "run_check",
    "run_checks",
    "run_in_order",
]

def _lane(name: str) -> bool:
    """Whether the check ``name`` runs nothing timed (runs of later checks may start beside it;
    the profile and the drills measure speed and detection latency, so they run alone)."""
    check = check_for(name)
    return check is not None and check.lane


def available_checks() -> list[str]:
    """Names of the checks this version can run (``drills`` runs every ``drill:<name>``)."""
    return check_names(many=True)


def run_check(runner: JobRunner, name: str, spec: CheckSpec) -> CheckResult:
    """Run one check; a check this version cannot run yet is reported as skipped, with why."""
    outcome = _run_check(runner, name, spec)
    return outcome.finish() if isinstance(outcome, Later) else outcome


def _run_check(runner: JobRunner, name: str, spec: CheckSpec) -> CheckResult | Later:
    """:func:`run_check`, except that a check may leave its untimed rest for later (a
    :class:`~trainguard.config.registry.Later`, only while the session state's ``untimed_later``
    is set):
    its tracking run stays open until that finishes."""
    check = check_for(name)
    if check is None:
        return CheckResult(
            name,
            "skipped",
            f"the {name} check is configured but not available in this trainguard version "
            f"(available: {', '.join(available_checks())})",
            skip_reason=SkipReason.NOT_IN_THIS_VERSION,
        )
    from trainguard.tracking import open_check_run

    started = time.monotonic()
    pool = runner.pool
    pool.state.current_check = name
    tracked = open_check_run(runner, name, spec)
    try:
        with tracked.current(), pool.checking(name):
            ctx = context_for(pool, name, spec, runner.request_for(spec))
            if check.prepare is not None:
                check.prepare(ctx)
            try:
                outcome = check.run(ctx)
            except BaseException:
                runner.scheduling.stop_background(f"the {name} check ended with an exception")
                raise
            runner.scheduling.join_background()  # nothing a check started outlives it
            if isinstance(outcome, Later):
                later = outcome

                def finish() -> CheckResult:
                    try:
                        with tracked.current(this_thread=True), pool.checking(name):
                            return _recorded(runner, tracked, later.finish(), started)
                    except BaseException:
                        tracked.failed()
                        raise

                return Later(finish)
            return _recorded(runner, tracked, outcome, started)
    except BaseException:
        tracked.failed()
        raise


def _recorded(runner: JobRunner, tracked: CheckRun, result: CheckResult, started: float) -> CheckResult:
    result.duration_s = result.duration_s or time.monotonic() - started
    _attach_log_notes(runner, result)
    tracked.record(result)
    return result


def _finish_later(runner: JobRunner, later: Sequence[Later]) -> list[CheckResult | BaseException]:
    """Finish the checks' untimed rests beside each other (one alone in this thread), in their
    order; a rest that raised is returned as its exception. Interrupted, every run they started
    is stopped."""
    if len(later) == 1:
        return [later[0].finish()]
    futures: list[Future[CheckResult]] = []
    for each in later:
        future: Future[CheckResult] = Future()

        def work(each: Later = each, future: Future[CheckResult] = future) -> None:
            try:
                future.set_result(each.finish())
            except BaseException as exc:  # handed to the session's thread
                future.set_exception(exc)

        threading.Thread(target=work, name="trainguard-later", daemon=True).start()
        futures.append(future)
    try:
        wait(futures)
    except BaseException:  # Ctrl-C, SIGTERM: the runs stop, their threads end
        runner.scheduling.stop_background("interrupted while the checks' untimed runs finished")
        raise
    return [f.exception() or f.result() for f in futures]


def _attach_log_notes(runner: JobRunner, result: CheckResult) -> None:
    """The check's evidence says which of its runs' logs were capped, and which runs had a full
    disk under their run directory (the launcher's ``logs_truncated`` / ``run_dir_disk``)."""
    notes = runner.take_log_notes()
    capped = [note.capped for note in notes if note.capped is not None]
    full = [note.full_disk for note in notes if note.full_disk is not None]
    # a failed run's evidence may hold its own already (copied by the check): these come after
    if capped:
        result.run_notes.logs_truncated = capped
    if full:
        result.run_notes.run_dir_disk = full
        if "full or failing disk" not in result.summary:
            result.summary += f"; {full[0].note}"  # a verdict that stands, said with it


def lane_plan(runner: JobRunner, checks: Sequence[tuple[str, CheckSpec]]) -> list[AheadRun]:
    """The runs of later checks that can start early, beside the checks before them: each
    check's ``ahead`` run (the canary's run, determinism's second run, parallel's N-rank run:
    independent runs of a known request, not timed against anything). Only when some check runs
    before the one that needs it, and only behind lane checks."""
    pool = runner.pool
    if pool.state.checks != tuple(checks):  # not inside run_in_order: the runs of this session
        with pool.session(SessionState(checks=tuple(checks))):
            return lane_plan(runner, checks)
    names = [n for n, _ in checks]
    plan: list[AheadRun] = []
    earlier: set[object] = set()  # the uninterrupted runs the checks before declare: they launch them
    for position, (name, spec) in enumerate(checks):
        check = check_for(name)
        if position and all(_lane(n) for n in names[:position]) and check is not None and check.ahead is not None:
            ahead = check.ahead(context_for(runner.pool, name, spec, runner.request_for(spec)))
            # an uninterrupted run that ran already, or that a check before it launches in the
            # foreground (smoke folded into the canary's run), is not launched again
            if not (ahead.reference and (runner.scheduling.kept_reference(ahead.request) is not None
                                         or share_key(ahead.request) in earlier)):
                plan.append(ahead)
        earlier.update(share_key(d.request) for d in runner.pool.declared(name, spec) if d.run.reference)
    return plan


def run_in_order(
    runner: JobRunner,
    checks: Sequence[tuple[str, CheckSpec]],
    report: Report,
    *,
    on_start: Callable[[str], None] | None = None,
    on_result: Callable[[CheckResult], None] | None = None,
) -> Report:
    """Run ``checks`` one after the other into ``report``, with the runs of :func:`lane_plan`
    started in the runner's background lane; the lane is closed before the first check that
    measures speed (and at the end, whatever happens). A check that times its runs
    (``Check.first``: the profile) runs before the others, alone, so that its runs are the
    uninterrupted runs they share; the report keeps the checks' order. Before anything runs, the
    runner is told which checkpoints the checks will resume from (:func:`keep_declared`). The
    session's state (:class:`~trainguard.run.pool.SessionState`) is this function's: it says
    which check runs, whether one is timed, and whether a check may leave its untimed rest for
    later; the checks read it from their context."""
    with runner.pool.session(SessionState(checks=tuple(checks))) as state:
        return _run_in_order(runner, state, checks, report, on_start, on_result)


def _run_in_order(runner: JobRunner, state: SessionState, checks: Sequence[tuple[str, CheckSpec]],
                  report: Report, on_start: Callable[[str], None] | None,
                  on_result: Callable[[CheckResult], None] | None) -> Report:
    keep_declared(runner, checks)
    first = [c for c in checks if (kind := check_for(c[0])) is not None and kind.first]
    rest = [c for c in checks if c not in first]
    order = {name: i for i, (name, _) in enumerate(checks)}

    def add(result: CheckResult) -> None:
        report.add(result)
        if on_result is not None:
            on_result(result)

    later: list[Later] = []

    def one(name: str, spec: CheckSpec) -> None:
        if on_start is not None:
            on_start(name)
        outcome = _run_check(runner, name, spec)
        if isinstance(outcome, Later):
            later.append(outcome)
        else:
            add(outcome)

    lane: list[bool] = []

    def start_lane() -> None:
        if not lane:
            lane.append(True)
            state.current_check = rest[0][0] if rest else None  # what the lane's first run is beside
            runner.scheduling.start_lane(lane_plan(runner, rest))

    try:
        for name, spec in first:  # alone: no background import, the lane once its runs are done
            state.timing, state.on_timed_done = True, start_lane if name == first[-1][0] else None
            one(name, spec)
            state.timing, state.on_timed_done = False, None
        start_lane()
        state.untimed_later = True  # a check's untimed rest waits until the timed ones are done
        for name, spec in rest:
            if not _lane(name):
                runner.scheduling.close_lane()
            one(name, spec)
        state.untimed_later = False
        finished = _finish_later(runner, later)
        for outcome in finished:
            if isinstance(outcome, CheckResult):
                add(outcome)
        raised = [o for o in finished if not isinstance(o, CheckResult)]
        if raised:
            raise raised[0]
    finally:
        state.untimed_later = False
        state.timing, state.on_timed_done = False, None
        runner.scheduling.close_lane()
        report.checks.sort(key=lambda c: order.get(c.name, len(order)))
    return report


def keep_declared(runner: JobRunner, checks: Sequence[tuple[str, CheckSpec]]) -> None:
    """Register every checkpoint the checks' declared runs resume from (``Run.resumes``), so the
    first uninterrupted run of each request keeps it (:mod:`trainguard.run.keep`) instead of a
    check killing one more run later."""
    metric = progress_metric_of(runner.job_file)
    references = []
    for name, spec in checks:
        for run in runner.pool.declared(name, spec):
            if run.source is not None and run.run.resumes is not None:
                runner.pool.keep(run.source, run.run.resumes.after_step, metric)
            if run.run.reference:
                references.append(share_key(run.request))
    if runner.job_file.job.steps_independent:  # a shorter reference may be a longer one's first steps
        for short in references:
            for long in references:
                if long.steps > short.steps + 1 and dataclasses.replace(long, steps=short.steps) == short:
                    runner.pool.keep(long, short.steps + 1, metric)  # see Keepers.prefix


def run_checks(
    job_file: JobFile,
    runner: JobRunner,
    *,
    only: Iterable[str] | None = None,
    on_result: Callable[[CheckResult], None] | None = None,
) -> Report:
    """Run the job file's checks (or ``only`` those) and collect a report."""
    report = Report(job=job_file.job.name, job_file=str(job_file.path))
    return run_in_order(runner, job_file.enabled_checks(only), report, on_result=on_result)


# documented keyword-only user API (trainguard.check): its options are its parameters (pyproject.toml, PLR0913)
def check(  # noqa: PLR0913
    config: str | Any,
    *,
    only: Iterable[str] | None = None,
    seed: int | None = None,
    report_json: str | None = None,
    echo: Callable[[int, str, str], None] | None = None,
    on_result: Callable[[CheckResult], None] | None = None,
    save_baseline: bool | None = None,
    report_name: str = "report.json",
    soak_seed: int | None = None,
) -> Report:
    """Load a job file, run its checks, write the report (``report_json``, else ``report_name``
    in ``.trainguard/``); the library form of ``trainguard check``. Settings come from
    ``TRAINGUARD_*`` env vars and their defaults.

    ``save_baseline=True`` makes a passing canary this machine's new baseline (docs/baselines.md);
    it needs the canary among the checks run (a :class:`ConfigError` says so otherwise).
    ``soak_seed`` replays every chaos soak with that seed (the ``soak_seed`` setting)."""
    from pathlib import Path

    from trainguard.config import load_config
    from trainguard.session.session import open_session, session_settings

    job_file = load_config(config)
    if report_json:
        _check_report_path(report_json)  # before any check spends its time
    settings = session_settings(seed=seed, save_baseline=save_baseline, soak_seed=soak_seed)
    if settings.save_baseline and "canary" not in {n for n, _ in job_file.enabled_checks(only)}:
        from trainguard.errors import ConfigError

        why = ("the job file has no checks.canary" if job_file.checks.canary is None
               else f"--only {' '.join(only or ())} leaves it out")
        raise ConfigError(
            f"--save-baseline saves the canary's trajectory, but the canary is not run ({why}); "
            "run `trainguard check CONFIG --only canary --save-baseline`",
            path=str(job_file.path),
        )
    target = Path(report_json) if report_json else job_file.state_dir / report_name
    report = Report(job=job_file.job.name, job_file=str(job_file.path))
    with open_session(job_file, settings, command="check", echo=echo) as session:
        report.tracking_uri = session.tracking_uri
        try:
            run_in_order(session.runner, job_file.enabled_checks(only), report, on_result=on_result)
            _measured_recovery_into_sizing(report)
        except KeyboardInterrupt:  # Ctrl-C, SIGTERM: the checks that finished keep their report
            if report.checks:
                report.interrupted = True
                report.save(target)
            raise
        written = report.save(target)  # a failing write falls back and says so; never lost
        if written is not None:
            session.log_artifact(written, "report")
    if session.tracker is not None and session.tracker.unwritable:
        report.tracking_uri = None  # the closed tracker said why; the store is not advertised
    return report


def _measured_recovery_into_sizing(report: Report) -> None:
    """The profile check's sizing, when the same session ran recover drills or soaks, with its
    goodput forecast recomputed from what they measured (as the gate does), so a saved report
    never keeps the default restart cost beside a measured one."""
    from trainguard.profiling.check import ProfileEvidence
    from trainguard.profiling.sizing import Sizing, apply_measured_recovery

    profile = next((c.evidence for c in report.checks if c.name == "profile"), None)
    if not isinstance(profile, ProfileEvidence) or not isinstance(profile.sizing, Sizing):
        return
    refreshed = apply_measured_recovery(copy.deepcopy(profile.sizing), report.checks)
    if refreshed.failure_inputs != profile.sizing.failure_inputs:
        profile.sizing = refreshed


def _check_report_path(report_json: str | os.PathLike[str]) -> None:
    """A ``--report-json`` that cannot be written is a usage error before anything runs."""
    from trainguard._internal.atomic import unwritable_reason
    from trainguard.errors import ConfigError

    reason = unwritable_reason(report_json)
    if reason is not None:
        raise ConfigError(
            f"cannot write the report to {report_json}: {reason}. Name a file in a writable "
            "directory (or leave --report-json out: .trainguard/report.json next to the job "
            "file)",
            key="--report-json",
        )
