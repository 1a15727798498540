"""Reading progress from a job: metric lines on stdout/stderr (regex) or a JSONL file."""

from __future__ import annotations

import json
import math
import re
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

__all__ = ["JsonlTail", "MetricParser", "MetricPoint", "trajectory"]


@dataclass(frozen=True)
class MetricPoint:
    """One metric value as it arrived: which rank printed it and when (seconds since launch)."""

    name: str
    step: int
    value: float
    rank: int
    t: float


def _to_float(text: str) -> float | None:
    try:
        return float(text.rstrip(",;"))
    except ValueError:
        return None


class MetricParser:
    """Applies each metric's regex (named groups ``step`` and ``value``) to output lines."""

    def __init__(self, regexes: Mapping[str, str]) -> None:
        self._patterns = [(name, re.compile(rx)) for name, rx in regexes.items()]

    def parse(self, line: str, *, rank: int, t: float) -> list[MetricPoint]:
        points = []
        for name, pattern in self._patterns:
            match = pattern.search(line)
            if match is None:
                continue
            value = _to_float(match.group("value"))
            try:
                step = int(match.group("step"))
            except ValueError:
                continue
            if value is None:
                # "nan"/"inf" parse as floats; anything else is not a number we can judge
                continue
            points.append(MetricPoint(name, step, value, rank, t))
        return points


class JsonlTail:
    """Follows a JSONL metrics file as the job appends to it (one object per line with ``step``)."""

    def __init__(self, path: Path, names: Iterable[str], *, rank: int) -> None:
        self.path = path
        self.names = list(names)
        self.rank = rank
        self._offset = 0
        self._partial = b""

    def poll(self, t: float) -> list[MetricPoint]:
        try:
            with open(self.path, "rb") as handle:
                handle.seek(self._offset)
                data = handle.read()
        except FileNotFoundError:
            return []
        self._offset += len(data)
        data = self._partial + data
        lines = data.split(b"\n")
        self._partial = lines.pop()  # an incomplete last line waits for its newline
        points = []
        for raw in lines:
            try:
                obj = json.loads(raw)
            except ValueError:
                continue
            if not isinstance(obj, dict) or "step" not in obj:
                continue
            for name in self.names:
                if name in obj and isinstance(obj[name], (int, float)):
                    points.append(MetricPoint(name, int(obj["step"]), float(obj[name]), self.rank, t))
        return points


def trajectory(points: Iterable[MetricPoint], name: str = "loss") -> dict[int, float]:
    """Per-step value of one metric: the mean over the ranks that printed it.

    A script that logs its local loss on every rank and one that logs the all-reduced loss on
    rank 0 both give one value per step. When a step was printed twice by the same rank (a
    restarted attempt re-running it), the latest value wins.
    """
    per_step: dict[int, dict[int, float]] = defaultdict(dict)
    for p in points:
        if p.name == name:
            per_step[p.step][p.rank] = p.value
    out = {}
    for step in sorted(per_step):
        values = list(per_step[step].values())
        out[step] = math.fsum(values) / len(values)
    return out
