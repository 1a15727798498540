"""An older commit of the job's repository, checked out beside it for as long as a check needs it.

:func:`checkout` adds a detached ``git worktree`` of one commit under a parent directory and
removes it again on the way out (Ctrl-C and SIGTERM included); a checkout left by a process that
was killed outright (its pid in the folder's name is gone) is removed the next time, and git's
record of it pruned. The user's own working tree, index and branches are never touched.

:func:`link_ignored` makes the files git ignores (data made locally, a virtual environment) visible
in the checkout as symlinks to the working tree's, since the commit does not hold them.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

from trainguard._internal.gitcmd import GitError, run_git
from trainguard._internal.pids import pid_alive

__all__ = ["checkout", "link_ignored", "missing_at", "repository_root", "resolve_commit"]

#: entries of ``git ls-files --others --ignored`` linked at most (a tree of millions of ignored
#: files is linked by its top folders, which ``--directory`` lists once each)
MAX_LINKS = 10_000

_CHECKOUT = re.compile(r"^checkout-(\d+)-[0-9a-f]+$")


def _git(directory: Path, *args: str, timeout: float = 120.0) -> str:
    return run_git(directory, *args, timeout=timeout).decode("utf-8", "surrogateescape")


def repository_root(directory: Path) -> Path | None:
    """The top of the git working tree holding ``directory``; None outside one (or without git)."""
    try:
        return Path(_git(directory, "rev-parse", "--show-toplevel", timeout=10).strip())
    except GitError:
        return None


def resolve_commit(root: Path, ref: str) -> str:
    """The full commit id ``ref`` (a branch, tag, commit or ``HEAD~2``) names in ``root``'s
    repository; :class:`GitError` saying so when it names none."""
    if not ref or ref.startswith("-"):
        raise GitError(f"{ref!r} is not a git ref")
    try:
        return _git(root, "rev-parse", "--verify", "--quiet", "--end-of-options", f"{ref}^{{commit}}",
                    timeout=10).strip()
    except GitError:
        shallow = "; this is a shallow clone: `git fetch --unshallow` fetches all of history" if _is_shallow(root) else ""
        raise GitError(f"{ref!r} names no commit of the repository at {root}{shallow}") from None


def _remove(root: Path, path: Path) -> None:
    with contextlib.suppress(GitError):
        _git(root, "worktree", "remove", "--force", "--force", str(path), timeout=60)
    if path.exists() or path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)


def _remove_stale(root: Path, parent: Path) -> None:
    """Checkouts under ``parent`` whose process is gone, removed; git's records of missing ones
    pruned."""
    for entry in parent.iterdir() if parent.is_dir() else []:
        found = _CHECKOUT.match(entry.name)
        if found and not pid_alive(int(found.group(1))):
            _remove(root, entry)
    with contextlib.suppress(GitError):
        _git(root, "worktree", "prune", timeout=60)


@contextlib.contextmanager
def checkout(root: Path, commit: str, parent: Path) -> Iterator[Path]:
    """``commit`` of ``root``'s repository checked out (detached) in a new folder under
    ``parent``; removed, with git's record of it, when the block ends however it ends."""
    parent.mkdir(parents=True, exist_ok=True)
    _remove_stale(root, parent)
    path = parent / f"checkout-{os.getpid()}-{commit[:12]}"
    if path.exists():
        _remove(root, path)
    try:
        _git(root, "worktree", "add", "--detach", "--force", str(path), commit, timeout=600)
        yield path
    finally:
        _remove(root, path)
        with contextlib.suppress(GitError):
            _git(root, "worktree", "prune", timeout=60)


def missing_at(root: Path, commit: str, relative: Path) -> str | None:
    """Why ``commit`` of ``root``'s repository cannot run a job in ``relative`` (a folder, relative
    to the repository's top), in words with the fix; None when it can: the commit is missing (a
    shallow clone: which commit to fetch, and how), or the folder is not in it."""
    try:
        _git(root, "cat-file", "-e", f"{commit}^{{commit}}", timeout=30)
    except GitError:
        fix = f"`git fetch origin {commit}`"
        if _is_shallow(root):
            return (f"commit {commit} is not in this shallow clone ({root}); fetch it first: {fix}, or all of "
                    "history: `git fetch --unshallow`")
        return f"commit {commit} is not in the repository at {root}; fetch it first: {fix}"
    folder = relative.as_posix()
    spec = f"{commit}^{{tree}}" if folder in ("", ".") else f"{commit}:{folder}"
    try:
        kind = _git(root, "cat-file", "-t", spec, timeout=30).strip()
    except GitError:
        kind = "nothing"
    if kind != "tree":
        return (f"commit {commit[:12]} has no folder {folder}/, the job's directory: the job came after it, so it "
                "cannot run the job and has no checkpoints in flight. Fix: name a commit that has it (`git log "
                f"--diff-filter=A --format=%h -- {folder}` names the one that added it), or drop checks.compat "
                "until then")
    return None


def _is_shallow(root: Path) -> bool:
    try:
        return _git(root, "rev-parse", "--is-shallow-repository", timeout=10).strip() == "true"
    except GitError:
        return False


def link_ignored(root: Path, checkout_dir: Path, *, skip: Callable[[str], bool],
                 extra: Sequence[str] = ()) -> list[str]:
    """Symlink into ``checkout_dir`` every file and folder of ``root`` that git ignores (and each
    path of ``extra``, relative to ``root``) that the checkout lacks; ``skip(relative path)``
    leaves one out. Returns the relative paths linked."""
    listed = _git(root, "ls-files", "--others", "--ignored", "--exclude-standard", "--directory", "-z")
    names = [n.rstrip("/") for n in listed.split("\0") if n][:MAX_LINKS]
    linked = []
    for name in [*names, *extra]:
        source, target = root / name, checkout_dir / name
        if skip(name) or not (source.exists() or source.is_symlink()):
            continue
        if target.exists() or target.is_symlink():
            continue
        if not target.resolve().is_relative_to(checkout_dir.resolve()):
            continue  # `..` in an extra path: nothing outside the checkout is touched
        target.parent.mkdir(parents=True, exist_ok=True)
        target.symlink_to(source.resolve())
        linked.append(name)
    return linked
