"""Ray Train jobs under trainguard: the user's ``train_func`` run with ``TorchTrainer``.

trainguard launches :mod:`trainguard.raytrain.driver` as the job's command (one process, the Ray
driver); the driver connects to Ray (``RAY_ADDRESS``, or a private local instance), runs the
user's function with ``TorchTrainer`` and prints every ``ray.train.report`` of world rank 0 as a
metric line, so every check and drill built on the launcher works for Ray Train jobs unchanged.
See docs/ray-train.md.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import NamedTuple

__all__ = [
    "RAY_TRAIN_DEFAULTS", "REPORT_PREFIX", "WORKER_PREFIX", "WorkerLine", "format_worker_line", "metric_regex",
    "parse_worker_line", "ray_train_defaults",
]

#: the line a worker prints for each ``ray.train.report`` (world rank 0 only)
REPORT_PREFIX = "trainguard-report"
#: the line every worker prints once at start (fault drills find the worker's pid by rank)
WORKER_PREFIX = "trainguard-worker"
#: Ray Train's settings on trainguard's own Ray (the embedded head of a check session, the
#: driver's private instance), where Ray's own defaults suit long runs on a shared cluster, not
#: short test fits. A value in the environment or in ``job.env`` wins; on a real cluster
#: (``RAY_ADDRESS``) none is set. docs/ray-train.md, "Ray Train's pace".
RAY_TRAIN_DEFAULTS: dict[str, str] = {
    # Ray Train V2's controller takes each worker's report from a queue of one every interval
    # (Ray: 2 s), so a step of a fast function costs the interval: 0.25 s makes a 12-step fit of
    # the digits example ~20 s shorter, and a failure is noticed in 0.25 s instead of 2 s
    "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.25",
    # nothing drains or preempts a local head's node: one actor process per fit fewer
    "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0",
}
_WORKER_LINE = re.compile(rf"{WORKER_PREFIX} rank=(\d+) pid=(\d+)(?: node=(\S+))?(?: node_id=(\w+))?")


class WorkerLine(NamedTuple):
    """A parsed ``trainguard-worker rank=R pid=P node=IP node_id=ID`` line (``node`` and
    ``node_id`` None when absent: the nodes of one machine share an IP, never an id)."""

    rank: int
    pid: int
    node: str | None
    node_id: str | None = None


def format_worker_line(rank: int, pid: int, node: str, node_id: str | None = None) -> str:
    """The line a worker prints at start; :func:`parse_worker_line` reads it back."""
    return f"{WORKER_PREFIX} rank={rank} pid={pid} node={node}" + (f" node_id={node_id}" if node_id else "")


def parse_worker_line(line: str) -> WorkerLine | None:
    """The worker line found anywhere in ``line`` (Ray prefixes forwarded lines), or None."""
    found = _WORKER_LINE.search(line)
    if found is None:
        return None
    return WorkerLine(int(found[1]), int(found[2]), found[3], found[4])


def ray_train_defaults(environ: Mapping[str, str]) -> dict[str, str]:
    """The :data:`RAY_TRAIN_DEFAULTS` that ``environ`` does not set (the user's value wins)."""
    return {key: value for key, value in RAY_TRAIN_DEFAULTS.items() if key not in environ}


def metric_regex(name: str) -> str:
    """The regex that reads metric ``name`` from the driver's report lines."""
    return rf"{REPORT_PREFIX} step=(?P<step>\d+)\b.*\s{re.escape(name)}=(?P<value>\S+)"
