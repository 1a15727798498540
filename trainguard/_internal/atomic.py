"""Atomic file writes: a reader sees the old content or the new, never a torn file."""

from __future__ import annotations

import contextlib
import functools
import os
import stat
import tempfile
from pathlib import Path


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
