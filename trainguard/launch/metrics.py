"""Reading progress from a job: metric lines on stdout/stderr (regex) or a JSONL file."""

from __future__ import annotations

import itertools
import json
import math
import re
import statistics
import time
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from trainguard._internal.readers import LineTail, Unreadable, active_limits

__all__ = ["JsonlTail", "LineMetric", "MetricParser", "MetricPoint", "first_step", "step_rate", "trajectory"]


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
    """Follows a JSONL metrics file as the job appends to it (one object per line with ``step``).

    The file is data (docs/security.md): read through :class:`~trainguard._internal.readers.LineTail`
    (a regular file only, one bounded line at a time, each poll within the read timeout); a
    line that is not a JSON object with a ``step`` read as a whole number is skipped. A
    file that cannot be read (a FIFO, over the read limit) gives no points and its reason is
    kept in :attr:`unreadable`."""

    def __init__(self, path: Path, names: Iterable[str], *, rank: int) -> None:
        self.path = path
        self.names = list(names)
        self.rank = rank
        self._lines = LineTail(path, max_line=_MAX_JSONL_LINE)
        #: why the file was not read (None while it reads)
        self.unreadable: str | None = None

    def poll(self, t: float) -> list[MetricPoint]:
        if self.unreadable is not None:
            return []
        points: list[MetricPoint] = []
        try:
            for raw in self._lines.lines(until=time.monotonic() + active_limits().seconds):
                points += self._points(raw, t)
        except Unreadable as exc:
            self.unreadable = str(exc)
        return points

    def _points(self, raw: bytes, t: float) -> list[MetricPoint]:
        try:
            obj = json.loads(raw)
            step = int(obj["step"]) if isinstance(obj, dict) else None
        except (ValueError, RecursionError, KeyError, TypeError, OverflowError):
            return []  # not JSON, nested too deep, a step that is no whole number
        if step is None:
            return []
        return [MetricPoint(name, step, float(obj[name]), self.rank, t) for name in self.names
                if isinstance(obj.get(name), (int, float))]


#: the longest line of a JSONL metrics file read (a longer one is cut, so skipped)
_MAX_JSONL_LINE = 1024 * 1024


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


#: arrival gaps shorter than this are lines read together, not steps that took that long
_BURST_S = 0.002
#: a span shorter than this is all burst: the median alone decides
_MIN_SPAN_S = 0.05


def step_rate(arrivals: Iterable[tuple[int, float]]) -> float | None:
    """Steps per second from ``(step, arrival time)`` pairs: one over the median time per step
    between consecutive lines. Lines are timed when trainguard reads them, and a busy machine
    reads several at once (nine lines of 20 ms steps within 40 us, seen under load: the first
    to last span made that 230 000 steps/s). The median ignores such a burst as long as most
    lines came apart; the first-to-last span (when it is at least 50 ms) is kept when lower, since
    lines read in regular clumps fool the median. None when fewer than two steps are known or most
    came in bursts."""
    ordered = sorted(arrivals)
    per_step = [(t1 - t0) / (s1 - s0) for (s0, t0), (s1, t1) in itertools.pairwise(ordered) if s1 > s0]
    if not per_step:
        return None
    middle = statistics.median(per_step)
    if middle < _BURST_S:
        return None
    # a starved reader takes lines in clumps a few ms apart (eight 20 ms steps read 2.4 ms apart,
    # every 160 ms, seen beside two CPU hogs): the median then says 400 steps/s. The first-to-last
    # span is not fooled by clumps inside it; the lower of the two is kept
    (first, start), (last, end) = ordered[0], ordered[-1]
    span = end - start
    return min(1.0 / middle, (last - first) / span) if span >= _MIN_SPAN_S else 1.0 / middle
