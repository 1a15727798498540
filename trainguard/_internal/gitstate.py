"""The one definition of a checkout's git state, used by baselines, profiles, MLflow tags and
gate provenance alike: a checkout is clean in a baseline's file name exactly when it is clean in
MLflow and in the gate report."""

from __future__ import annotations

import hashlib
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["GitState", "file_sha256", "git_state"]


def file_sha256(path: str | os.PathLike[str]) -> str:
    """sha256 of a file's bytes, hex."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


#: trainguard's own state next to a job file (reports, runs, the MLflow store): writing the
#: report must not make the tree it describes dirty
_EXCLUDE = ":(exclude,glob)**/.trainguard/**"


@dataclass(frozen=True)
class GitState:
    """The job repository's state: commit, dirty flag, and a fingerprint of the uncommitted
    changes (so a report made on a dirty tree is stale once those changes change)."""

    commit: str | None
    dirty: bool | None
    changes_sha256: str | None


def git_state(directory: str | os.PathLike[str], timeout: float = 10.0) -> GitState:
    """The state of the repository holding ``directory`` (all None outside one).

    Dirty means tracked changes or untracked files that are not ignored (what ``git status
    --porcelain`` lists), outside trainguard's ``.trainguard/`` state dirs. The fingerprint
    hashes ``git diff HEAD`` plus the content of those untracked files.
    """

    def git(*args: str, text: bool = True) -> Any:
        try:
            proc = subprocess.run(
                ["git", "-C", str(directory), *args],
                capture_output=True,
                text=text,
                timeout=timeout,
                stdin=subprocess.DEVNULL,
            )
        except (OSError, subprocess.TimeoutExpired):
            return None
        return proc.stdout if proc.returncode == 0 else None

    commit = git("rev-parse", "HEAD")
    top = git("rev-parse", "--show-toplevel")
    if commit is None or top is None:
        return GitState(None, None, None)
    root = Path(top.strip())
    status = git("-C", str(root), "status", "--porcelain", "--", ".", _EXCLUDE)
    if status is None:
        return GitState(commit.strip(), None, None)
    if not status.strip():
        return GitState(commit.strip(), False, None)
    digest = hashlib.sha256()
    digest.update(
        git("-C", str(root), "diff", "HEAD", "--binary", "--", ".", _EXCLUDE, text=False) or b""
    )
    untracked = (
        git(
            "-C", str(root), "ls-files", "--others", "--exclude-standard", "-z", "--", ".", _EXCLUDE
        )
        or ""
    )
    for name in sorted(n for n in untracked.split("\0") if n):
        digest.update(name.encode() + b"\0")
        try:
            digest.update(file_sha256(root / name).encode())
        except OSError:
            digest.update(b"unreadable")
    return GitState(commit.strip(), True, digest.hexdigest())
