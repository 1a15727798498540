"""Ray Train jobs under trainguard: the user's ``train_func`` run with ``TorchTrainer``.

trainguard launches :mod:`trainguard.raytrain.driver` as the job's command (one process, the Ray
driver); the driver connects to Ray (``RAY_ADDRESS``, or a private local instance), runs the
user's function with ``TorchTrainer`` and prints every ``ray.train.report`` of world rank 0 as a
metric line, so every check and drill built on the launcher works for Ray Train jobs unchanged.
See docs/ray-train.md.
"""

from __future__ import annotations

import re
from typing import NamedTuple

__all__ = ["REPORT_PREFIX", "WORKER_PREFIX", "WorkerLine", "format_worker_line", "metric_regex", "parse_worker_line"]

#: the line a worker prints for each ``ray.train.report`` (world rank 0 only)
REPORT_PREFIX = "trainguard-report"
#: the line every worker prints once at start (fault drills find the worker's pid by rank)
WORKER_PREFIX = "trainguard-worker"
_WORKER_LINE = re.compile(rf"{WORKER_PREFIX} rank=(\d+) pid=(\d+)(?: node=(\S+))?")


class WorkerLine(NamedTuple):
    """A parsed ``trainguard-worker rank=R pid=P node=IP`` line (``node`` None when absent)."""

    rank: int
    pid: int
    node: str | None


def format_worker_line(rank: int, pid: int, node: str) -> str:
    """The line a worker prints at start; :func:`parse_worker_line` reads it back."""
    return f"{WORKER_PREFIX} rank={rank} pid={pid} node={node}"


def parse_worker_line(line: str) -> WorkerLine | None:
    """The worker line found anywhere in ``line`` (Ray prefixes forwarded lines), or None."""
    found = _WORKER_LINE.search(line)
    if found is None:
        return None
    return WorkerLine(int(found[1]), int(found[2]), found[3])


def metric_regex(name: str) -> str:
    """The regex that reads metric ``name`` from the driver's report lines."""
    return rf"{REPORT_PREFIX} step=(?P<step>\d+)\b.*\s{re.escape(name)}=(?P<value>\S+)"
