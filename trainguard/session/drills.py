"""Drills run as checks of a session: tracked like any check, into a report (the library form of
``trainguard drill``). The driver and the judges live in :mod:`trainguard.drills`."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable

from trainguard.config import DrillSpec, load_config
from trainguard.report import CheckId, CheckResult, Report
from trainguard.run.runner import JobRunner
from trainguard.session.orchestrate import check, run_check

__all__ = ["drill", "run_drills", "soak"]


def run_drills(
    runner: JobRunner,
    specs: Iterable[DrillSpec] | None = None,
    *,
    on_result: Callable[[CheckResult], None] | None = None,
) -> list[CheckResult]:
    """Run ``specs`` (default: every drill of the runner's job file), each through
    :func:`trainguard.session.run_check` (tracked like any check)."""
    results = []
    for spec in runner.job_file.checks.drills if specs is None else specs:
        outcome = run_check(runner, str(CheckId.of_drill(spec.name)), spec)
        results.append(outcome)
        if on_result is not None:
            on_result(outcome)
    return results


def drill(
    config: str | os.PathLike[str],
    *,
    only: Iterable[str] | None = None,
    report_json: str | None = None,
    seed: int | None = None,
    echo: Callable[[int, str, str], None] | None = None,
    on_result: Callable[[CheckResult], None] | None = None,
) -> Report:
    """Run a job file's drills (or ``only`` those names) and write the report (default
    ``.trainguard/drills-report.json``); the library form of ``trainguard drill``."""
    job_file = load_config(config)
    names = [n if CheckId.parse(n).is_drill else str(CheckId.of_drill(n)) for n in only] if only else ["drills"]
    # the default place is not checked up front: a read-only .trainguard/ falls back, it is no
    # usage error (a --report-json the user named is)
    return check(job_file.path, only=names, seed=seed, report_json=report_json, echo=echo,
                 on_result=on_result, report_name="drills-report.json")


def soak(
    config: str | os.PathLike[str],
    *,
    only: Iterable[str] | None = None,
    seed: int | None = None,
    report_json: str | None = None,
    echo: Callable[[int, str, str], None] | None = None,
    on_result: Callable[[CheckResult], None] | None = None,
) -> Report:
    """Run a job file's chaos soaks (its ``fault: soak`` drills, or ``only`` those names), each
    with ``seed`` when given (a replay), and write the report (default
    ``.trainguard/soak-report.json``); the library form of ``trainguard soak``."""
    job_file = load_config(config)
    soaks = [d.name for d in job_file.checks.drills if d.fault == "soak"]
    wanted = [CheckId.parse(n).drill or n for n in only] if only else soaks
    unknown = [n for n in wanted if n not in soaks]
    if not soaks or unknown:
        from trainguard.errors import ConfigError

        have = f"its soaks: {', '.join(soaks)}" if soaks else "it has none"
        raise ConfigError(
            f"{job_file.path}: no soak drill {', '.join(unknown) if unknown else ''} in checks.drills "
            f"({have}); add one, e.g. `- {{name: chaos, fault: soak, steps: 120, params: "
            "{kinds: [kill_rank], faults: 5}}` (docs/drills.md, \"Chaos soak\")", key="checks.drills")
    return check(job_file.path, only=[str(CheckId.of_drill(n)) for n in wanted], report_json=report_json,
                 echo=echo, on_result=on_result, report_name="soak-report.json", soak_seed=seed)
