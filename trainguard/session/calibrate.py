"""``trainguard calibrate``, the library form: the reference runs of a job file's calibrated
checks, each repeated with one seed and across seeds, stored as this machine's calibration
(:mod:`trainguard.checks.calibration`, docs/calibration.md)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

__all__ = ["calibrate"]


def calibrate(
    config: Any,
    *,
    runs: int = 5,
    only: Iterable[str] | None = None,
    seed: int | None = None,
    echo: Callable[[int, str, str], None] | None = None,
    on_request: Callable[[str], None] | None = None,
) -> list[dict[str, Any]]:
    """Calibrate every reference run the configured checks (or ``only`` those) compare against:
    ``runs`` runs with the seed and one with each of ``runs - 1`` more seeds; returns one summary
    per run calibrated (its file, launches, seconds, the largest spreads). A run that does not
    complete stops it with :class:`~trainguard.checks.calibration.CalibrationError`."""
    from trainguard.checks.calibration import MIN_RUNS, calibrate_request, calibration_requests
    from trainguard.config import load_config
    from trainguard.errors import ConfigError
    from trainguard.session.session import open_session, session_settings

    job_file = load_config(config)
    if runs < MIN_RUNS:
        raise ConfigError(f"--runs {runs}: a calibration needs at least {MIN_RUNS} runs of one seed to "
                          "measure a spread; use --runs 5", path=str(job_file.path))
    wanted = list(only) if only else None
    settings = session_settings(seed=seed)
    out = []
    with open_session(job_file, settings, command="calibrate", echo=echo) as session:
        requests = calibration_requests(session.runner, wanted)
        if not requests:
            which = f"--check {' '.join(wanted)} names" if wanted else "the job file configures"
            raise ConfigError(f"nothing to calibrate: {which} no check whose tolerance a calibration "
                              "sets (canary, resume, compat, parallel, reshard)", path=str(job_file.path))
        for request, checks in requests:
            if on_request is not None:
                on_request(f"{request.steps} steps at {request.world_size} rank(s)"
                           + (f", args {' '.join(request.args)}" if request.args else "")
                           + f" (for {', '.join(checks)})")
            _, summary = calibrate_request(session.runner, request, runs)
            out.append({"checks": checks, "steps": request.steps, "world_size": request.world_size,
                        "args": list(request.args), **summary})
    return out
