"""The setup every entry point shares, written once: settings -> tracker -> runner, closed in one
place (``trainguard check``, ``drill``, ``gate``, ``profile`` and their library forms).

``with open_session(job_file, settings, command="check") as session:`` gives a
:class:`Session` whose runner reports to the session's tracker (None when tracking is off); on
the way out -- a verdict, an exception or Ctrl-C -- the runner is closed (background runs
stopped, the embedded Ray head shut down) and then the tracker is flushed and closed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from trainguard.config import JobFile
from trainguard.config.preflight import preflight
from trainguard.config.settings import Settings, resolve
from trainguard.errors import ConfigError
from trainguard.run.runner import JobRunner
from trainguard.tracking import Tracker, open_tracker

__all__ = ["Session", "open_session", "session_settings"]


def session_settings(
    *,
    seed: int | None = None,
    save_baseline: bool | None = None,
    environ: Mapping[str, str] | None = None,
    soak_seed: int | None = None,
) -> Settings:
    """The settings of a session run outside pytest: ``TRAINGUARD_*`` variables (of ``environ``,
    default the process's) over the defaults, then the caller's explicit ``seed`` and
    ``save_baseline`` (a CLI flag wins over the environment)."""
    settings = resolve(environ=os.environ if environ is None else environ)
    if seed is not None:
        if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= 2**32 - 1:
            # the rule of job.seed, TRAINGUARD_SEED and `--seed` (the CLI checks its flag first)
            raise ConfigError(f"invalid seed {seed!r}: expected an integer between 0 and 2**32-1",
                              key="seed")
        settings = dataclasses.replace(settings, seed=seed)
    if save_baseline is not None:
        settings = dataclasses.replace(settings, save_baseline=save_baseline)
    if soak_seed is not None:  # `trainguard soak --seed N` (checked by the CLI)
        settings = dataclasses.replace(settings, soak_seed=soak_seed)
    return settings


@dataclass
class Session:
    """One job file's runner and tracker for the length of one command."""

    job_file: JobFile
    settings: Settings
    runner: JobRunner
    #: None when tracking is off (``TRAINGUARD_TRACKING=off``, or no MLflow)
    tracker: Tracker | None

    @property
    def tracking_uri(self) -> str | None:
        return self.tracker.tracking_uri if self.tracker is not None else None

    def log_artifact(self, path: str | os.PathLike[str], folder: str) -> None:
        """Attach ``path`` to the session's MLflow run under ``folder`` (nothing when not tracked)."""
        if self.tracker is not None and self.tracker.session is not None:
            self.tracker.log_artifact(self.tracker.session, Path(path), folder)


@contextlib.contextmanager
def open_session(
    job_file: JobFile,
    settings: Settings,
    *,
    command: str,
    echo: Callable[[int, str, str], None] | None = None,
) -> Iterator[Session]:
    """Open the tracker (its session run named ``trainguard <command> <job>``) and a runner that
    reports to it; close both on the way out, the runner first (its last runs are logged).
    Nothing starts before :func:`~trainguard.config.preflight.preflight` has passed."""
    preflight(job_file)
    tracker = open_tracker(job_file, settings, run_name=f"trainguard {command} {job_file.job.name}")
    try:
        runner = JobRunner(job_file, settings, echo=echo, tracker=tracker)
        try:
            yield Session(job_file, settings, runner, tracker)
        finally:
            runner.close()
    finally:
        if tracker is not None:
            tracker.close()
