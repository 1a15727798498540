"""What launching a valid job file needs from this machine, checked before anything starts.

:func:`~trainguard.config.loading.load_config` checks a job file's text; :func:`preflight` checks
what a launch will do with it here: the working directory exists, every command, argument,
environment value and path renders with real placeholder values, and the checkpoint directory
can be created (not under a file such as ``/dev/null``, not in a kernel file system such as
``/proc``). ``trainguard validate`` runs both and launches nothing; every session runs both before
its first run, so a mistake costs an error naming the key, not a traceback minutes in.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

from trainguard._internal.limits import brief
from trainguard.config.problems import config_error
from trainguard.config.schema import JobFile, MetricFile, PlaceholderValues, render_placeholders

__all__ = ["preflight", "preflight_problems", "sample_values"]

#: kernel file systems: nothing trainguard runs may write checkpoints there
_VIRTUAL = (Path("/proc"), Path("/sys"), Path("/dev"))


def sample_values(job_file: JobFile, *, run_dir: Path | None = None) -> PlaceholderValues:
    """Placeholder values shaped like a real run's (``run_dir`` under the state directory)."""
    job = job_file.job
    run_dir = run_dir or job_file.state_dir / "runs" / "validate"
    values: dict[str, str | int] = {
        "steps": 2,
        "seed": job.seed,
        "world_size": job.world_size,
        "run_dir": str(run_dir),
        "batch_size": job.batch_size if job.batch_size is not None else "",
    }
    checkpoint_dir = Path(render_placeholders(job.checkpoint_dir, values))
    if not checkpoint_dir.is_absolute():
        checkpoint_dir = job_file.cwd / checkpoint_dir
    values["checkpoint_dir"] = str(checkpoint_dir)
    values["latest_checkpoint"] = str(checkpoint_dir / "latest")
    return values


def preflight_problems(job_file: JobFile) -> list[tuple[str, str]]:
    """``(key, message)`` for each thing that would stop a launch of this valid job file here."""
    job = job_file.job
    problems: list[tuple[str, str]] = []
    cwd = job_file.cwd
    if not cwd.exists():
        problems.append(("job.cwd", f"the working directory {brief(str(cwd), 200)} does not exist. Fix: "
                         "create it, or set job.cwd relative to the job file's directory"))
    elif not cwd.is_dir():
        problems.append(("job.cwd", f"{brief(str(cwd), 200)} is not a directory. Fix: set job.cwd to the "
                         "directory the command runs in"))
    elif not os.access(cwd, os.X_OK):
        problems.append(("job.cwd", f"{brief(str(cwd), 200)} cannot be entered (no permission)"))
    try:
        values = sample_values(job_file)
    except (ValueError, KeyError, IndexError, AttributeError) as exc:
        return [*problems, ("job.checkpoint_dir", f"{brief(job.checkpoint_dir)} does not render: {exc}")]
    templates: list[tuple[str, Iterable[str]]] = [
        ("job.command", job.command), ("job.resume_args", job.resume_args),
    ]
    templates += [(f"job.env.{k}", [v]) for k, v in job.env.items()]
    templates += [(f"checks.{name}.args", spec.args) for name, spec in job_file.enabled_checks()
                  if not name.startswith("drill:")]
    templates += [(f"job.metrics.{name}.file", [src.file]) for name, src in job.metrics.items()
                  if isinstance(src, MetricFile)]
    for key, tokens in templates:
        for token in tokens:
            try:
                render_placeholders(token, {**values, "rank": 0})
            except (ValueError, KeyError, IndexError, AttributeError, TypeError, OverflowError) as exc:
                problems.append((key, f"{brief(token)} cannot be filled in at launch: {exc}"))
    checkpoint_dir = Path(os.path.abspath(str(values["checkpoint_dir"])))
    # under .trainguard/ (the default `{run_dir}/checkpoints`) it is trainguard's own directory:
    # when .trainguard/ is read-only or full, run directories move to a fallback, said then
    if not checkpoint_dir.is_relative_to(os.path.abspath(job_file.state_dir)):
        problems += _directory_problems("job.checkpoint_dir", checkpoint_dir)
    canary = job_file.checks.canary
    if canary is not None and canary.baseline not in ("latest", "off"):
        try:
            Path(canary.baseline).expanduser()
        except RuntimeError:
            problems.append(("checks.canary.baseline", f"{brief(canary.baseline)}: the ~user in it does not exist "
                             "here. Fix: the baseline file's path, `latest` or `off`"))
    return problems


def _directory_problems(key: str, directory: Path) -> list[tuple[str, str]]:
    """Whether ``directory`` can be created (or used) by ``mkdir -p`` and written to."""
    shown = brief(str(directory), 200)
    resolved = Path(os.path.abspath(directory))
    for root in _VIRTUAL:
        if resolved == root or root in resolved.parents:
            return [(key, f"{shown} is in {root}, a kernel file system where checkpoints cannot be "
                     "written. Fix: a directory on a disk, e.g. the default `{run_dir}/checkpoints`")]
    existing = resolved
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if existing.exists() and not existing.is_dir():
        return [(key, f"{shown} cannot be created: {brief(str(existing), 200)} is a file, not a directory. "
                 "Fix: a directory path, e.g. the default `{run_dir}/checkpoints`")]
    if existing.exists() and not os.access(existing, os.W_OK | os.X_OK):
        return [(key, f"{shown} cannot be created or written: no write permission on "
                 f"{brief(str(existing), 200)}. Fix: a directory you can write, e.g. `{{run_dir}}/checkpoints`")]
    return []


def preflight(job_file: JobFile) -> None:
    """Raise one :class:`~trainguard.errors.ConfigError` naming every problem
    :func:`preflight_problems` finds."""
    problems = preflight_problems(job_file)
    if problems:
        raise config_error(str(job_file.path), problems)
