"""Atomic file writes: a reader sees the old content or the new, never a torn file; and the one
error path of trainguard's own writes (a failing write says why and falls back, never a
traceback, never a lost result)."""

from __future__ import annotations

import contextlib
import errno
import functools
import os
import stat
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "Written",
    "atomic_write_bytes",
    "atomic_write_text",
    "current_umask",
    "fallback_dir",
    "fsync_dir",
    "os_error_text",
    "unwritable_reason",
    "warn",
    "write_or_fallback",
]


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> Path:
    """Write ``data`` to ``path`` via a temp file in the same directory, fsync, then rename.

    The directory is fsynced too, so the rename survives a power cut. On any error the temp
    file is removed and the previous content of ``path`` is left untouched.
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            if hasattr(os, "fchmod"):  # POSIX
                os.fchmod(handle.fileno(), _mode_for(target))
            os.fsync(handle.fileno())
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    fsync_dir(target.parent)
    return target


def atomic_write_text(path: str | os.PathLike[str], text: str, encoding: str = "utf-8") -> Path:
    """Text flavour of :func:`atomic_write_bytes`."""
    return atomic_write_bytes(path, text.encode(encoding))


def _mode_for(target: Path) -> int:
    # mkstemp creates 0o600 files; a report or checkpoint should get the mode open() would give
    # (the old file's, else 0o666 minus the umask), or a CI uploader or another user cannot read it.
    try:
        return stat.S_IMODE(target.stat().st_mode)
    except OSError:
        return 0o666 & ~current_umask()


@functools.cache
def current_umask() -> int:
    mask = os.umask(0o022)  # the umask can only be read by setting it; put it straight back
    os.umask(mask)
    return mask


def fsync_dir(directory: Path) -> None:
    # Not every filesystem lets a directory be opened for fsync (some network mounts);
    # the rename itself already happened, so this is best effort.
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


# -- the one error path for trainguard's own writes ------------------------------------------
#
# A result trainguard computed is never lost to a failing write: a read-only file system, a
# full disk, a path that is a directory. Every report, baseline, profile and run directory goes
# through ``write_or_fallback`` (or ``fallback_dir`` for directories): it says in one line what
# could not be written and why (the errno in words), and puts the data in a place that works.


def os_error_text(exc: OSError) -> str:
    """An OS error in words with its errno name: ``No space left on device (ENOSPC)``."""
    if exc.errno is None:
        return str(exc.strerror or exc) or type(exc).__name__
    name = errno.errorcode.get(exc.errno)
    text = exc.strerror or os.strerror(exc.errno)
    return f"{text} ({name})" if name else text


def warn(text: str) -> None:
    """Say a problem with trainguard's own files on stderr, one line, never a traceback."""
    print(f"trainguard: warning: {text}", file=sys.stderr, flush=True)


def unwritable_reason(path: str | os.PathLike[str], *, example: str = "report.json") -> str | None:
    """Why a file cannot be written at ``path`` (None: it can), checked by creating and
    removing a probe in its directory, so a run finds out before it spends its time.

    A full disk is not found this way (an empty probe fits); :func:`write_or_fallback` covers it.
    """
    target = Path(path)
    if target.is_dir():
        return f"{target} is a directory; name a file in it, e.g. {target / example}"
    existing = target.parent
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        return f"{existing} is not a directory, so {target} cannot be created"
    try:
        if existing == target.parent:
            fd, probe = tempfile.mkstemp(prefix=".trainguard-probe.", dir=existing)
            os.close(fd)
            os.unlink(probe)
        else:  # the missing directories would be made here
            os.rmdir(tempfile.mkdtemp(prefix=".trainguard-probe.", dir=existing))
    except OSError as exc:
        return f"cannot create a file in {existing}: {os_error_text(exc)}"
    return None


@functools.cache
def fallback_dir() -> Path | None:
    """A private directory of this process for what cannot be written where it belongs: under
    the temp directory (``$TMPDIR``, else ``/tmp``), else ``/dev/shm``, else ``~/.cache``;
    None when none of them takes a file."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    roots = [Path(tempfile.gettempdir()), Path("/dev/shm"), Path.home() / ".cache"]
    for root in roots:
        try:
            base = root / f"trainguard-{os.getuid() if hasattr(os, 'getuid') else 'user'}"
            base.mkdir(mode=0o700, parents=True, exist_ok=True)
            owner = os.lstat(base)
            if not stat.S_ISDIR(owner.st_mode) or (hasattr(os, "getuid") and owner.st_uid != os.getuid()):
                continue  # a link or another user's directory in a shared /tmp: not ours to fill
            here = Path(tempfile.mkdtemp(prefix=f"unwritten-{stamp}-", dir=base))
            fd, probe = tempfile.mkstemp(dir=here)
            try:
                os.write(fd, b"trainguard")  # a full disk takes the name but not the bytes
            finally:
                os.close(fd)
                os.unlink(probe)
            return here
        except OSError:
            continue
    return None


@dataclass(frozen=True)
class Written:
    """Where :func:`write_or_fallback` put the data."""

    #: the path asked for
    requested: Path
    #: where the data is now: ``requested``, a fallback file, or None (nowhere)
    path: Path | None
    #: the sentence said when ``requested`` could not be written (None: it was)
    problem: str | None = None

    @property
    def fell_back(self) -> bool:
        return self.problem is not None


def write_or_fallback(
    path: str | os.PathLike[str],
    data: bytes | str,
    *,
    what: str,
    say: Callable[[str], None] | None = warn,
) -> Written:
    """Write ``data`` atomically to ``path``; when that fails (read-only, full disk, not a
    directory, ...) say so in one line naming ``what``, the path and the errno, and write it to
    a file of :func:`fallback_dir` instead (same name, under the original directory's name).
    Never raises an :class:`OSError`: with nowhere to write, ``Written.path`` is None and the
    caller prints the data (a computed result is never lost)."""
    target = Path(path)
    payload = data.encode("utf-8") if isinstance(data, str) else data
    try:
        return Written(target, atomic_write_bytes(target, payload))
    except OSError as exc:
        why = os_error_text(exc)
    base = fallback_dir()
    fallback: Path | None = None
    if base is not None:
        candidate = base / (target.parent.name or "root") / target.name
        try:
            fallback = atomic_write_bytes(candidate, payload)
        except OSError:
            fallback = None
    problem = f"cannot write {what} to {target}: {why}; " + (
        f"wrote it to {fallback} instead" if fallback else "no fallback location took it either")
    if say is not None:
        say(problem)
    return Written(target, fallback, problem)
