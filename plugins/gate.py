"""The gate verdict in pytest's terminal summary: for each collected job file with a ``gate:``
section, :func:`trainguard.gate.policy.decide` over the results of its check items.

A verdict is only given when the session ran every check the policy requires (``pytest -m
canary`` runs one check: the gate is then "not judged", with the checks that did not run); a
``block`` fails the session, so the exit code carries it.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:  # pragma: no cover
    from trainguard.plugins.session import TrainguardSession

    from trainguard.report import CheckResult

__all__ = ["judge_gates"]


def judge_gates(config: pytest.Config, state: TrainguardSession) -> bool:
    """Decide each job file's gate, put the verdict lines in ``state.gate_lines``; False when a
    gate blocked."""
    by_file: dict[str, list[CheckResult]] = defaultdict(list)
    for nodeid, result in state.check_results:
        path, sep, _ = nodeid.partition("::")
        if sep and path.endswith((".yaml", ".yml")):
            by_file[path].append(result)
    ok = True
    for rel, results in by_file.items():
        ok = _judge(config, rel, results, state) and ok
    return ok


def _judge(config: pytest.Config, rel: str, results: list[CheckResult], state: TrainguardSession) -> bool:
    from trainguard.config import load_config
    from trainguard.errors import ConfigError
    from trainguard.gate.policy import Capabilities, configured_checks, decide, sizing_of
    from trainguard.gate.run import judged_paces
    from trainguard.report import Report

    try:
        job_file = load_config(Path(config.rootpath) / rel)
    except ConfigError:
        return True  # its items already reported the error
    if job_file.gate is None:
        return True
    ran = {r.name for r in results} | ({"drills"} if any(r.check_id.is_drill for r in results) else set())
    configured = configured_checks(job_file)
    missing = [n for n in job_file.gate.require if n in configured and n not in ran]
    if missing:
        state.gate_lines.append(f"GATE    {job_file.job.name}: not judged: this session did not run "
                                f"{', '.join(missing)} (run them all, or `trainguard gate {rel}`)")
        return True
    report = Report(job=job_file.job.name, checks=list(results))
    runner = state.runners.get(str(job_file.path))  # none here under xdist: its workers made the runs
    decision = decide(report, job_file.gate, Capabilities.probe(), sizing=sizing_of(report),
                      configured=configured, paces=None if runner is None else judged_paces(runner.launches))
    state.gate_lines.append(f"GATE    {job_file.job.name}: {decision.verdict.upper()}  [{rel}]")
    state.gate_lines += [f"        - {reason}" for reason in decision.reasons]
    state.gate_lines += [f"        warning: {warning}" for warning in decision.warnings]
    return decision.promoted
