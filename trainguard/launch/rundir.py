"""Run directories: ``.trainguard/runs/<time>-<job>-<label>/`` next to the job file.

``.trainguard/`` is the only place trainguard writes inside a user's repository; it carries its
own ``.gitignore`` so nothing in it is ever committed by accident. Only the newest ``keep`` run
directories of a job are kept.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import time
from pathlib import Path

from trainguard._internal.atomic import atomic_write_text, fallback_dir, os_error_text, warn
from trainguard._internal.pids import pid_alive
from trainguard.errors import TrainguardError

__all__ = ["ensure_state_dir", "new_run_dir", "prune_runs"]

_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]+")


def ensure_state_dir(state_dir: Path) -> Path:
    """Create ``.trainguard/`` with a ``.gitignore`` that ignores everything in it."""
    state_dir.mkdir(parents=True, exist_ok=True)
    ignore = state_dir / ".gitignore"
    if not ignore.exists():
        atomic_write_text(ignore, "# written by trainguard: run outputs, never commit them\n*\n")
    return state_dir


def _slug(text: str) -> str:
    return _UNSAFE.sub("-", text).strip("-")[:60] or "run"


def _job_slug(job: str) -> str:
    # No "-" in the job part: it ends the job name, so pruning job "mlp" never matches the runs
    # of job "mlp-large" ("<time>-mlp_large-<label>").
    return _slug(job).replace("-", "_")


#: state directories that could not take a run directory, and where their runs went instead
_MOVED: dict[Path, Path] = {}


def new_run_dir(state_dir: Path, job: str, label: str, *, keep: int = 20) -> Path:
    """Create a fresh, unique run directory and prune old ones of the same job.

    When ``state_dir`` cannot take it (a read-only ``.trainguard/``, a full disk), that is said
    once on stderr, naming the directory and the errno, and the run directories of this process
    go to ``runs/`` of the temp-directory fallback (:func:`fallback_dir`) instead."""
    moved = _MOVED.get(state_dir)
    if moved is None:
        try:
            runs = ensure_state_dir(state_dir) / "runs"
            runs.mkdir(exist_ok=True)
            return _new_in(runs, job, label, keep=keep)
        except OSError as exc:
            why = os_error_text(exc)
        base = fallback_dir()
        if base is None:
            raise TrainguardError(
                f"cannot create a run directory under {state_dir}: {why}, and no temp "
                "directory takes one either; free space there or make it writable"
            ) from None
        moved = _MOVED[state_dir] = base / "runs"
        warn(f"cannot create a run directory under {state_dir}: {why}; run directories go "
             f"to {moved} instead")
    try:
        moved.mkdir(parents=True, exist_ok=True)
        return _new_in(moved, job, label, keep=keep)
    except OSError as exc:
        raise TrainguardError(
            f"cannot create a run directory under {state_dir} nor under {moved}: "
            f"{os_error_text(exc)}; free space there or make it writable"
        ) from None


def _new_in(runs: Path, job: str, label: str, *, keep: int) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    prefix = f"{stamp}-{_job_slug(job)}-{_slug(label)}"
    for attempt in range(1000):
        candidate = runs / (prefix if attempt == 0 else f"{prefix}-{attempt}")
        try:
            candidate.mkdir()  # atomic: two pytest-xdist workers never share one
        except FileExistsError:
            continue
        try:
            (candidate / _OWNER).write_text(str(os.getpid()))
        except OSError:
            shutil.rmtree(candidate, ignore_errors=True)  # a full disk takes the name only
            raise
        prune_runs(runs, _job_slug(job), keep=keep, protect=candidate)
        return candidate
    raise RuntimeError(f"could not create a unique run directory under {runs}")


_OWNER = ".owner"  # pid of the process that created the run directory


def _owned_by_live_process(run_dir: Path) -> bool:
    """A run directory whose creator is still alive may still be in use (a reference run shared
    between checks, another xdist worker's run): never pruned."""
    try:
        pid = int((run_dir / _OWNER).read_text().strip())
    except (OSError, ValueError):
        return False
    return pid_alive(pid)


def prune_runs(runs: Path, job_slug: str, *, keep: int, protect: Path | None = None) -> list[Path]:
    """Delete all but the newest ``keep`` run directories of one job; returns the deleted.

    Directories whose creating process is still alive are kept (they may be in use)."""
    pattern = re.compile(rf"^\d{{8}}-\d{{6}}-{re.escape(job_slug)}-")
    mine = [p for p in runs.iterdir() if p.is_dir() and pattern.match(p.name)]
    mine.sort(key=lambda p: (p.name[:15], p.stat().st_mtime, p.name), reverse=True)
    deleted = []
    for old in mine[keep:]:
        if (protect is not None and old == protect) or _owned_by_live_process(old):
            continue
        with contextlib.suppress(OSError):
            shutil.rmtree(old)
            deleted.append(old)
    return deleted


def relpath(path: Path, start: Path | None = None) -> str:
    """``path`` relative to ``start`` (default: cwd) when it is below it, else absolute."""
    try:
        return str(path.relative_to(start or Path(os.getcwd())))
    except ValueError:
        return str(path)
