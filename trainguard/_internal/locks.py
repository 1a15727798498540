"""Inter-process file locks: one writer at a time to a file several processes share.

pytest-xdist workers (and the Ray workers of a fit on one machine) open the same MLflow sqlite
store and the same run registry; creating a schema or a run there is done under these locks.
"""

from __future__ import annotations

import contextlib
import fcntl
from collections.abc import Iterator
from pathlib import Path

__all__ = ["file_lock", "store_lock"]


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``path`` (created when missing) for the ``with`` block."""
    with open(path, "a+") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


@contextlib.contextmanager
def store_lock(uri: str) -> Iterator[None]:
    """An exclusive file lock next to a sqlite tracking store (``<db>.lock``; pytest-xdist
    workers share it); a no-op for other stores."""
    if not uri.startswith("sqlite:///"):
        yield
        return
    db = Path(uri[len("sqlite:///"):])
    db.parent.mkdir(parents=True, exist_ok=True)
    with file_lock(db.with_name(db.name + ".lock")):
        yield
