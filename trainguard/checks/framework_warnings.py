"""The framework's own warnings on a run's stderr that name a cause of a failed resume
(``lr_scheduler`` state missing, a DataLoader that is not resumable, ...)."""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path

__all__ = ["framework_warnings", "stderr_lines"]

#: the framework's own words on stderr that point at a cause (case-insensitive)
_WARNING_PATTERNS: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("data_position", re.compile(r"not resumable|dataloader.*(?:resum|restart)|(?:resum|restart).*dataloader"
                                 r"|ended before the epoch ended|sampler.*(?:resum|state)", re.I)),
    ("scheduler", re.compile(r"lr_scheduler|scheduler.*(?:state|resum|restor)", re.I)),
    ("optimizer", re.compile(r"optimizer.*(?:state|resum|restor|not found|missing)", re.I)),
    ("rng", re.compile(r"rng.?state|random state|seed.*(?:resum|restor)", re.I)),
)
_WARNING_LINE = re.compile(r"warn|could not|cannot|not found|missing|skipp", re.I)


def framework_warnings(lines: Iterable[str], *, limit: int = 5) -> list[tuple[str, str]]:
    """``(cause key, line)`` for warning lines that name a cause, in order, at most ``limit``."""
    found: list[tuple[str, str]] = []
    seen: set[str] = set()
    for raw in lines:
        line = raw.strip()
        if not line or line in seen or not _WARNING_LINE.search(line):
            continue
        for key, pattern in _WARNING_PATTERNS:
            if pattern.search(line):
                found.append((key, line[:300]))
                seen.add(line)
                break
        if len(found) >= limit:
            break
    return found


def stderr_lines(run_dir: Path, world_size: int, *, max_bytes: int = 2_000_000) -> list[str]:
    """The stderr lines of every rank of a run (the last ``max_bytes`` of each log)."""
    lines: list[str] = []
    for rank in range(world_size):
        path = run_dir / f"rank{rank}.stderr.log"
        try:
            with open(path, "rb") as handle:
                handle.seek(0, 2)
                size = handle.tell()
                handle.seek(max(0, size - max_bytes))
                lines += handle.read().decode("utf-8", errors="replace").splitlines()
        except OSError:
            continue
    return lines
