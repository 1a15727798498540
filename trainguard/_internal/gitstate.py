"""The one definition of a checkout's git state, used by baselines, profiles, MLflow tags and
gate provenance alike: a checkout is clean in a baseline's file name exactly when it is clean in
MLflow and in the gate report."""

from __future__ import annotations

import hashlib
import os
import stat
from dataclasses import dataclass
from pathlib import Path

from trainguard._internal.gitcmd import GitError, run_git

__all__ = ["GitState", "changes_fingerprint", "file_sha256", "git_state"]


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
    (:func:`changes_fingerprint`) hashes the bytes of every changed file and the staged diff.
    """

    def git(where: str | os.PathLike[str], *args: str) -> str | None:
        try:
            return run_git(where, *args, timeout=timeout).decode("utf-8", "surrogateescape")
        except GitError:
            return None

    commit = git(directory, "rev-parse", "HEAD")
    top = git(directory, "rev-parse", "--show-toplevel")
    if commit is None or top is None:
        return GitState(None, None, None)
    root = Path(top.strip())
    status = git(root, "status", "--porcelain", "--", ".", _EXCLUDE)
    if status is None:
        return GitState(commit.strip(), None, None)
    if not status.strip():
        return GitState(commit.strip(), False, None)
    return GitState(commit.strip(), True, changes_fingerprint(root, timeout=timeout))


def changes_fingerprint(root: Path, *, timeout: float = 10.0) -> str | None:
    """sha256 of the uncommitted changes of the working tree at ``root``: the name and the bytes
    of every file that differs from HEAD or is untracked (not ignored), and the staged diff.

    Made from the files themselves, not from ``git diff``'s text, so no diff setting (an
    external diff, a textconv, a filter) can make two different edits look the same. None when
    git cannot list the changes."""
    try:
        changed = run_git(root, "diff", "HEAD", "--name-only", "--no-renames", "-z", "--", ".", _EXCLUDE,
                          timeout=timeout)
        untracked = run_git(root, "ls-files", "--others", "--exclude-standard", "-z", "--", ".", _EXCLUDE,
                            timeout=timeout)
        staged = run_git(root, "diff", "--cached", "HEAD", "--binary", "--full-index", "--no-color", "--", ".",
                         _EXCLUDE, timeout=timeout)
    except GitError:
        return None
    digest = hashlib.sha256()
    names = {os.fsdecode(n) for n in (changed + b"\0" + untracked).split(b"\0") if n}
    for name in sorted(names):
        digest.update(os.fsencode(name) + b"\0" + _content_digest(root / name, timeout).encode() + b"\0")
    digest.update(b"staged\0" + staged)
    return digest.hexdigest()


def _content_digest(path: Path, timeout: float) -> str:
    """What a changed path holds, as text for the fingerprint: a regular file's sha256, a link's
    target, a submodule's commit, absent, or the kind of a special file (never opened: a FIFO
    would block)."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return "absent"
    except OSError as exc:
        return f"unreadable {exc.errno}"
    if stat.S_ISLNK(mode):
        return "link " + os.readlink(path)
    if stat.S_ISDIR(mode):  # a submodule: its commit, and whether it has changes of its own
        try:
            head = run_git(path, "rev-parse", "HEAD", timeout=timeout).decode().strip()
            dirty = run_git(path, "status", "--porcelain", timeout=timeout).strip() != b""
        except GitError:
            return "submodule unreadable"
        return f"submodule {head}{'-dirty' if dirty else ''}"
    if not stat.S_ISREG(mode):
        return f"special {stat.S_IFMT(mode):o}"
    try:
        return file_sha256(path)
    except OSError as exc:
        return f"unreadable {exc.errno}"
