"""The one way trainguard runs git: with no program the repository's or the user's
configuration names.

A job's repository is not trainguard's to trust: its ``.git/config`` can name an fsmonitor, a hooks
directory (``post-checkout`` runs on a worktree checkout), filters (``smudge`` on a checkout,
``clean`` on ``status``), an external diff or a textconv; the user's own configuration can name
the same. :func:`git_command` builds every git command trainguard runs so that none of them runs:

* the system and global configuration are not read (``GIT_CONFIG_NOSYSTEM``,
  ``GIT_CONFIG_GLOBAL=/dev/null``); two of their values are kept, both data: ``safe.directory``
  (a CI container's checkout owned by another user) and ``core.excludesFile`` (the user's ignore
  list, so the files they ignore stay ignored);
* the repository's configuration, which git always reads, is overridden with command-line scope,
  which wins over every file (``GIT_CONFIG_COUNT``: as ``-c``, but a driver name holding ``=``
  cannot break it), for every key that runs a program: ``core.fsmonitor``, ``core.hooksPath``,
  ``core.pager``, the commands of every ``filter.<driver>`` it defines, and
  ``protocol.allow=never``, so nothing is fetched (a partial clone's missing object is not
  fetched lazily; no ssh command, credential helper or proxy runs);
* ``diff`` runs with ``--no-ext-diff --no-textconv`` (``diff.external``,
  ``diff.<driver>.command`` and ``.textconv``);
* git's variables in the caller's environment (``GIT_DIR`` of a hook trainguard runs from,
  ``GIT_EXTERNAL_DIFF``, ``GIT_SSH_COMMAND``, ``GIT_CONFIG_PARAMETERS``, ...) are dropped; a read
  does not write the index (``GIT_OPTIONAL_LOCKS=0``) and git never prompts.
"""

from __future__ import annotations

import functools
import os
import subprocess
from collections.abc import Sequence

__all__ = ["GitError", "git_command", "run_git"]

#: overrides of the repository's configuration for every key that runs a program (or fetches)
_SAFE_CONFIG = (
    ("core.fsmonitor", "false"),
    ("core.hooksPath", os.devnull),
    ("core.pager", "cat"),  # "cat" is git's word for no pager
    ("protocol.allow", "never"),
    ("credential.helper", ""),
    ("submodule.recurse", "false"),
    ("gc.auto", "0"),
    ("maintenance.auto", "false"),
)
#: the caller's git variables kept: they say where to look for a repository, nothing else
_KEPT_GIT_VARS = ("GIT_CEILING_DIRECTORIES", "GIT_DISCOVERY_ACROSS_FILESYSTEM")
#: the variables that say where the user's configuration files are
_USER_FILES_VARS = ("HOME", "XDG_CONFIG_HOME", "GIT_CONFIG_GLOBAL", "GIT_CONFIG_SYSTEM", "GIT_CONFIG_NOSYSTEM")
#: a filter driver's keys that run a program
_FILTER_KEYS = ("clean", "smudge", "process")
#: subcommands that print diffs
_DIFFS = ("diff", "log", "show")


class GitError(Exception):
    """A git command failed: the message says which and why, in words."""


def git_command(directory: str | os.PathLike[str], *args: str) -> tuple[list[str], dict[str, str]]:
    """The argv and environment of ``git -C directory ARGS`` with no program of the repository's
    or the user's configuration run (the module's docstring says how)."""
    user = _user_data_config(tuple(os.environ.get(k) for k in _USER_FILES_VARS))
    overrides = [*_SAFE_CONFIG, *user, *_filter_overrides(str(directory))]
    env = _base_env()
    env["GIT_CONFIG_COUNT"] = str(len(overrides))
    for i, (key, value) in enumerate(overrides):  # no `-c`: a driver's name may hold a `=`
        env[f"GIT_CONFIG_KEY_{i}"], env[f"GIT_CONFIG_VALUE_{i}"] = key, value
    argv = ["git", "--no-pager", "-C", str(directory)]
    if args and args[0] in _DIFFS:
        return [*argv, args[0], "--no-ext-diff", "--no-textconv", *args[1:]], env
    return [*argv, *args], env


def run_git(directory: str | os.PathLike[str], *args: str, timeout: float = 120.0) -> bytes:
    """``git -C directory ARGS`` (:func:`git_command`), its stdout as bytes; :class:`GitError`
    saying which command and why when it fails, takes longer than ``timeout`` s, or git is
    missing."""
    what = f"`git {' '.join(args[:3])}`"
    argv, env = git_command(directory, *args)
    try:
        proc = subprocess.run(argv, capture_output=True, timeout=timeout, stdin=subprocess.DEVNULL, env=env)
    except FileNotFoundError:
        raise GitError("git is not installed (no `git` on PATH)") from None
    except subprocess.TimeoutExpired:
        raise GitError(f"{what} took longer than {timeout:g} s") from None
    except (OSError, ValueError) as exc:  # ValueError: a NUL byte in an argument
        raise GitError(f"{what} could not be run: {exc}") from None
    if proc.returncode != 0:
        lines = proc.stderr.decode(errors="replace").strip().splitlines()
        why = (lines or [f"exit status {proc.returncode}"])[-1]
        raise GitError(f"{what} failed: {why}")
    return proc.stdout


def _base_env(*, user_files: bool = False) -> dict[str, str]:
    """The caller's environment less git's own variables; the system and global configuration
    switched off unless ``user_files`` (then the caller's choice of them is kept)."""
    kept = (*_KEPT_GIT_VARS, "GIT_CONFIG_GLOBAL", "GIT_CONFIG_SYSTEM", "GIT_CONFIG_NOSYSTEM") if user_files \
        else _KEPT_GIT_VARS
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_") or k in kept}
    env.update(GIT_TERMINAL_PROMPT="0", GIT_OPTIONAL_LOCKS="0", GIT_ASKPASS="", SSH_ASKPASS="")
    if not user_files:
        env.update(GIT_CONFIG_NOSYSTEM="1", GIT_CONFIG_GLOBAL=os.devnull)
    return env


def _config_values(args: Sequence[str], *, cwd: str | None = None, user_files: bool = False) -> list[str]:
    """The NUL-separated values ``git config ARGS`` prints (reading configuration runs no
    program); [] when it fails."""
    try:
        proc = subprocess.run(["git", "config", "--null", *args], capture_output=True, timeout=30, cwd=cwd,
                              stdin=subprocess.DEVNULL, env=_base_env(user_files=user_files))
    except (OSError, ValueError, subprocess.TimeoutExpired):
        return []
    text = proc.stdout.decode(errors="surrogateescape")
    return [item for item in text.split("\0") if item] if proc.returncode == 0 else []


@functools.cache
def _user_data_config(where: tuple[str | None, ...]) -> tuple[tuple[str, str], ...]:
    """The user's ``safe.directory`` entries and ``core.excludesFile`` from their system and
    global files: the two values of that configuration trainguard keeps (data, no program).
    Read once per ``where``, the variables that say which files those are."""
    scopes = ["--global"] if os.environ.get("GIT_CONFIG_NOSYSTEM", "0") not in ("", "0", "false") \
        else ["--system", "--global"]
    out: list[tuple[str, str]] = []
    for key in ("safe.directory", "core.excludesFile"):
        values = [v for scope in scopes for v in _config_values(
            [scope, "--includes", "--type=path", "--get-all", key], user_files=True)]
        if key == "safe.directory":
            out += [(key, v) for v in values]
        elif values:
            out.append((key, values[-1]))  # global wins over system
    return tuple(out)


def _filter_overrides(directory: str) -> list[tuple[str, str]]:
    """Every filter driver the repository's configuration defines, switched off: an empty
    command is no filter, and ``required=false`` lets its absence pass."""
    names = _config_values(["--name-only", "--get-regexp", r"^filter\..*\.(clean|smudge|process)$"], cwd=directory)
    drivers = dict.fromkeys(name.rsplit(".", 1)[0] for name in names if name.count(".") >= 2)
    return [(f"{driver}.{key}", "") for driver in drivers for key in _FILTER_KEYS] + \
        [(f"{driver}.required", "false") for driver in drivers]
