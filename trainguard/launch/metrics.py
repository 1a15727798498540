"""Reading progress from a job: metric lines on stdout/stderr (regex) or a JSONL file."""

from __future__ import annotations

import json
import math
import re
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

__all__ = ["JsonlTail", "LineMetric", "MetricParser", "MetricPoint", "first_step", "trajectory"]


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


@dataclass(frozen=True)
class LineMetric:
    """A metric read from output lines whose step may be implicit.

    ``regex`` has a ``value`` group. ``step`` is ``"count"`` (the n-th matching line of a rank is
    step ``n * every``, n from 1, counted from the launch of the attempt) or the name of the
    group holding the step.
    """

    regex: str
    step: str = "step"
    every: int = 1


class MetricParser:
    """Applies each metric's regex to output lines: a plain string has the named groups ``step``
    and ``value``; a :class:`LineMetric` names its step group or counts matching lines, per rank
    (one parser per launch attempt, so a restarted attempt counts from 1 again)."""

    def __init__(self, regexes: Mapping[str, str | LineMetric]) -> None:
        self._patterns = [
            (name, re.compile(rx.regex if isinstance(rx, LineMetric) else rx),
             rx if isinstance(rx, LineMetric) else LineMetric(rx))
            for name, rx in regexes.items()
        ]
        self._counts: dict[tuple[str, int], int] = defaultdict(int)

    def parse(self, line: str, *, rank: int, t: float) -> list[MetricPoint]:
        points = []
        for name, pattern, metric in self._patterns:
            match = pattern.search(line)
            if match is None:
                continue
            if metric.step == "count":
                # a matching line is a step whether or not its value parses
                self._counts[name, rank] += 1
                step = self._counts[name, rank] * metric.every
            else:
                try:
                    step = int(match.group(metric.step))
                except (TypeError, ValueError):
                    continue
            value = _to_float(match.group("value"))
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


def per_rank(points: Iterable[MetricPoint], name: str = "loss") -> dict[int, dict[int, float]]:
    """``{step: {rank: value}}`` of one metric; a step printed twice by the same rank (a
    restarted attempt re-running it) keeps the latest value."""
    per_step: dict[int, dict[int, float]] = defaultdict(dict)
    for p in points:
        if p.name == name:
            per_step[p.step][p.rank] = p.value
    return dict(per_step)


def _mean(values: Iterable[float]) -> float:
    values = list(values)
    return math.fsum(values) / len(values)


def first_step(points: Iterable[MetricPoint], name: str = "loss") -> int:
    """The first step a run printed of metric ``name`` (1 when none): jobs count from 1 or, as
    nanoGPT's ``iter 0``, from 0. A restarted run whose first step is at most the uninterrupted
    run's first began again from scratch."""
    return min((p.step for p in points if p.name == name), default=1)


def trajectory(points: Iterable[MetricPoint], name: str = "loss") -> dict[int, float]:
    """Per-step value of one metric: the mean over the ranks that printed it.

    A script that logs its local loss on every rank and one that logs the all-reduced loss on
    rank 0 both give one value per step. When a step was printed twice by the same rank (a
    restarted attempt re-running it), the latest value wins.
    """
    steps = per_rank(points, name)
    return {step: _mean(steps[step].values()) for step in sorted(steps)}


def aligned_trajectories(
    actual: Iterable[MetricPoint], expected: Iterable[MetricPoint], name: str = "loss"
) -> tuple[dict[int, float], dict[int, float]]:
    """Trajectories of two runs made comparable step by step.

    A step that only some ranks printed (the last step of an attempt whose other ranks were torn
    down before printing it) is compared on those ranks only: the expected value is the mean over
    the same ranks. Runs with different rank sets (N ranks vs 1) compare their plain means.
    """
    a_steps, e_steps = per_rank(actual, name), per_rank(expected, name)
    a_out: dict[int, float] = {}
    e_out: dict[int, float] = {}
    for step in sorted(set(a_steps) | set(e_steps)):
        a, e = a_steps.get(step), e_steps.get(step)
        if a is not None and e is not None and len(e) > 1 and set(a) < set(e):
            e_out[step] = _mean(e[r] for r in a)
        elif e is not None:
            e_out[step] = _mean(e.values())
        if a is not None:
            a_out[step] = _mean(a.values())
    return a_out, e_out
