"""Stragglers named: which rank is persistently busier than the others (docs/drills.md "Stragglers").

Each rank's run agent writes one line per optimizer step, ``<cpu> <run-queue wait> <wall>`` of
its training thread (``_trainguard_pace_agent``). Between two steps a rank's *busy ratio* is
(CPU time + run-queue wait) over wall time: the share of the step it wanted the CPU. In
synchronous training every rank's step takes the slowest rank's time; the others wait inside a
collective, blocked, wanting no CPU. So the slow rank's ratio is higher than the others', whatever
the machine's load (a loaded machine lengthens every rank's run-queue wait alike, and a rank
waiting in a collective is blocked, not queued).

The judgement is relative and persistent: per window of ``WINDOW`` steps (and at least
``MIN_WINDOW_S`` seconds), each rank's median busy ratio over the busiest other rank's; a rank
above ``1 + threshold`` in at least two windows and two thirds of them is a straggler, named with its ratio. A step in which one
rank alone is busy far longer than its usual step (rank 0 evaluating or saving) is reported apart
as single-rank work, never as a straggler: the medians see through it.
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from trainguard._internal.readers import ReadLimits, open_regular, read_at_most
from trainguard.launch.hook import PACE_DIR

__all__ = [
    "DEFAULT_THRESHOLD",
    "MIN_WINDOWS",
    "MIN_WINDOW_S",
    "WINDOW",
    "PaceReport",
    "RankPace",
    "RunPace",
    "SingleRankWork",
    "StepClock",
    "judge_pace",
    "judged_pace",
    "read_pace",
    "run_pace",
]

#: a rank this much busier (relative) than the others is a straggler
DEFAULT_THRESHOLD = 0.10
#: steps per window of the median
WINDOW = 20
#: the fewest seconds per window: a scheduler's favour on a loaded machine lasts a fraction of one
#: (sched_train's few-millisecond steps beside 4 CPU hogs named rank 1 at 1.56x with 20-step windows)
MIN_WINDOW_S = 2.0
#: the fewest windows a straggler is busier in (a run of fewer cannot name one)
MIN_WINDOWS = 2
#: the steps skipped at the start (warm-up: first allocations, process group start)
_WARMUP = 2
#: a step this many times the rank's median CPU-wanting time, on one rank only, is single-rank work
_SINGLE_FACTOR = 3.0
#: the most bytes read of one rank's file (the agent writes at most 50,000 lines of ~40 bytes)
_MAX_BYTES = 4 * 1024 * 1024


@dataclass(frozen=True)
class StepClock:
    """One line of a rank's file: the training thread's clocks at the end of a step (seconds)."""

    cpu: float
    delay: float
    wall: float


@dataclass(frozen=True)
class RankPace:
    """One rank's row of the table."""

    rank: int
    steps: int
    #: the rank's median busy ratio over the judged steps
    busy: float
    #: its median, over the windows, of its busy ratio over the busiest other rank's
    ratio: float
    straggler: bool
    #: the step (counted from the first recorded) at the end of the window that named it
    named_at_step: int | None


@dataclass(frozen=True)
class SingleRankWork:
    """Steps in which one rank alone was busy far longer than usual (evaluation, save)."""

    rank: int
    steps: tuple[int, ...]
    seconds: float


@dataclass(frozen=True)
class PaceReport:
    """Every rank's pace, the stragglers named, and single-rank work reported apart."""

    ranks: tuple[RankPace, ...]
    threshold: float
    windows: int
    single_rank_work: tuple[SingleRankWork, ...]

    @property
    def stragglers(self) -> tuple[RankPace, ...]:
        return tuple(r for r in self.ranks if r.straggler)

    @property
    def judged(self) -> bool:
        """Enough windows to name a straggler (``MIN_WINDOWS``): a run judged with none named is clean."""
        return self.windows >= MIN_WINDOWS

    @property
    def notable(self) -> bool:
        """A straggler named or single-rank work found (what a run's evidence reports)."""
        return bool(self.stragglers or self.single_rank_work)

    @property
    def slowest(self) -> RankPace | None:
        """The rank with the highest ratio (sizing uses it)."""
        return max(self.ranks, key=lambda r: r.ratio, default=None)

    def to_dict(self) -> dict[str, object]:
        """The report's evidence: the summary, the per-rank table and the single-rank work."""
        return {"summary": self.summary(), "threshold": self.threshold, "windows": self.windows,
                "window_steps": WINDOW,
                "stragglers": [r.rank for r in self.stragglers],
                "ranks": [{"rank": r.rank, "steps": r.steps, "busy": round(r.busy, 4), "ratio": round(r.ratio, 4),
                           "straggler": r.straggler, "named_at_step": r.named_at_step} for r in self.ranks],
                "single_rank_work": [{"rank": w.rank, "steps": list(w.steps), "seconds": round(w.seconds, 3)}
                                     for w in self.single_rank_work]}

    def summary(self) -> str:
        """One line: the stragglers with their ratios, or that none was found and on what."""
        if not self.ranks:
            return "stragglers: no step clocks recorded"
        if self.windows == 0:
            return f"stragglers: not judged (fewer than {WINDOW} steps and {MIN_WINDOW_S:g} s recorded)"
        named = self.stragglers
        apart = "".join(f"; rank {w.rank} alone busy at steps {', '.join(map(str, w.steps[:5]))}"
                        f"{' ...' if len(w.steps) > 5 else ''} (single-rank work, not a straggler)"
                        for w in self.single_rank_work)
        if not named:
            return (f"stragglers: none over {self.threshold:.0%} in {self.windows} window(s) of "
                    f"{WINDOW}+ steps and {MIN_WINDOW_S:g}+ s{apart}")
        names = ", ".join(f"rank {r.rank} {r.ratio:.2f}x as busy as the others" for r in named)
        return (f"stragglers: {names} (median of {self.windows} window(s) of {WINDOW}+ steps and "
                f"{MIN_WINDOW_S:g}+ s){apart}")


def read_pace(directory: Path) -> dict[int, list[StepClock]]:
    """Each rank's step clocks under ``directory`` (``rank{N}.txt``; bounded reads, a torn or
    malformed line ends that rank's clocks)."""
    out: dict[int, list[StepClock]] = {}
    if not directory.is_dir():
        return out
    for path in sorted(directory.glob("rank*.txt")):
        try:
            rank = int(path.stem[4:])
            with open_regular(path, ReadLimits(max_bytes=2**62)) as handle:  # never a FIFO
                raw = read_at_most(handle, _MAX_BYTES)
        except (ValueError, OSError):
            continue
        clocks: list[StepClock] = []
        for line in raw.decode("ascii", "replace").splitlines(keepends=True):
            fields = line.split()
            if not line.endswith("\n") or len(fields) != 3:
                break
            try:
                cpu, delay, wall = (float(f) for f in fields)
            except ValueError:
                break
            if not all(math.isfinite(v) for v in (cpu, delay, wall)):
                break
            clocks.append(StepClock(cpu, delay, wall))
        out[rank] = clocks
    return out


def _busy(clocks: Sequence[StepClock]) -> tuple[list[float], list[float]]:
    """Per step: the busy ratio and the CPU-wanting seconds (between consecutive lines)."""
    ratios: list[float] = []
    wanted: list[float] = []
    for before, after in itertools.pairwise(clocks):
        wall = after.wall - before.wall
        want = max(0.0, (after.cpu - before.cpu) + (after.delay - before.delay))
        ratios.append(min(1.0, want / wall) if wall > 0 else 0.0)
        wanted.append(want)
    return ratios, wanted


def _single_rank_work(wanted: Mapping[int, list[float]], n: int) -> tuple[SingleRankWork, ...]:
    """The steps where one rank alone wanted the CPU ``_SINGLE_FACTOR`` x its median time."""
    usual = {r: statistics.median(w[:n]) for r, w in wanted.items()}
    found: dict[int, list[int]] = {}
    seconds: dict[int, float] = {}
    for step in range(n):
        long = [r for r, w in wanted.items() if w[step] > _SINGLE_FACTOR * usual[r] and w[step] > 0.01]
        if len(long) == 1 and len(wanted) > 1:
            found.setdefault(long[0], []).append(step + 1)
            seconds[long[0]] = seconds.get(long[0], 0.0) + wanted[long[0]][step] - usual[long[0]]
    return tuple(SingleRankWork(r, tuple(s), seconds[r]) for r, s in sorted(found.items()) if _periodic(s))


def _periodic(steps: Sequence[int]) -> bool:
    """At least two steps at one spacing (an evaluation or save every N steps), not noise."""
    gaps = {b - a for a, b in itertools.pairwise(steps)}
    return len(steps) >= 2 and len(gaps) == 1


def _windows(clocks: Sequence[StepClock], n: int) -> list[tuple[int, int]]:
    """[start, end) step ranges of at least ``WINDOW`` steps and ``MIN_WINDOW_S`` seconds each
    (rank 0's clocks; every rank's steps take the same wall time)."""
    out: list[tuple[int, int]] = []
    start = 0
    for end in range(1, n + 1):
        if end - start >= WINDOW and clocks[end].wall - clocks[start].wall >= MIN_WINDOW_S:
            out.append((start, end))
            start = end
    return out


def judge_pace(clocks: Mapping[int, Sequence[StepClock]], *,
               threshold: float = DEFAULT_THRESHOLD) -> PaceReport:
    """The stragglers among ``clocks`` (rank -> its step clocks), judged on the steps every rank
    recorded, after the warm-up."""
    if not clocks:
        return PaceReport((), threshold, 0, ())
    per_rank = {r: _busy(c[_WARMUP:]) for r, c in clocks.items()}
    n = min(len(ratios) for ratios, _ in per_rank.values())
    spans = _windows(clocks[min(clocks)][_WARMUP:], n) if len(clocks) > 1 else []
    apart = _single_rank_work({r: w for r, (_, w) in per_rank.items()}, n) if n else ()
    rel: dict[int, list[float]] = {r: [] for r in clocks}
    for a, b in spans:
        medians = {r: statistics.median(ratios[a:b]) for r, (ratios, _) in per_rank.items()}
        for r, m in medians.items():
            # the busiest other rank: two ranks a busy scheduler favours unevenly are not a
            # straggler and its waiting peers (measured: 4 even ranks on 2 loaded cores, 1.16x
            # over the others' median in 2 windows of 3, 1.08x over the busiest other)
            others = max(v for q, v in medians.items() if q != r)
            rel[r].append(m / others if others > 0 else (1.0 if m == 0 else math.inf))
    rows = []
    for r in sorted(clocks):
        ratios = per_rank[r][0][:n]
        named_at = _named_at(rel[r], [b for _, b in spans], threshold)
        rows.append(RankPace(
            rank=r, steps=n, busy=statistics.median(ratios) if ratios else 0.0,
            ratio=statistics.median(rel[r]) if rel[r] else 1.0, straggler=named_at is not None,
            named_at_step=named_at))
    return PaceReport(tuple(rows), threshold, len(spans), apart)


def _named_at(rel: Sequence[float], ends: Sequence[int], threshold: float) -> int | None:
    """When the rank is a straggler over the whole run (above the threshold in at least two
    windows and two thirds of them): the step at the end of the first window after which it
    was one so far; else None."""
    over = [v > 1 + threshold for v in rel]
    if sum(over) < MIN_WINDOWS or sum(over) * 3 < len(over) * 2:
        return None
    count = 0
    for k, (value, end) in enumerate(zip(over, ends, strict=True), start=1):
        count += value
        if count >= MIN_WINDOWS and count * 3 >= k * 2:
            return _WARMUP + end + 1
    return None  # pragma: no cover -- the whole run met the test, so some prefix did


def run_pace(run_dir: Path, *, threshold: float = DEFAULT_THRESHOLD) -> PaceReport:
    """The pace of the run whose folder is ``run_dir`` (its agent's ``trainguard-pace``)."""
    return judge_pace(read_pace(run_dir / PACE_DIR), threshold=threshold)


def judged_pace(pace_dir: Path) -> PaceReport | None:
    """The judgement of the step clocks under ``pace_dir`` (a launched run's ``trainguard-pace``);
    never raises (None: not readable, or fewer than two ranks recorded clocks). A run's ``evidence["pace"]`` holds it only when
    :attr:`PaceReport.notable` (a clean, even run's evidence is unchanged); the runner keeps it
    for the profile and the gate's per-rank tables."""
    try:
        clocks = read_pace(pace_dir)
        return judge_pace(clocks) if len(clocks) > 1 else None
    except (OSError, ValueError, ArithmeticError):  # pragma: no cover -- the reader is bounded and total
        return None


@dataclass(frozen=True)
class RunPace:
    """One judged multi-rank run's pace, named by the run (the gate report's ``pace`` rows)."""

    label: str
    world_size: int
    report: PaceReport

    def to_dict(self) -> dict[str, object]:
        """The run, its world size and :meth:`PaceReport.to_dict`."""
        return {"run": self.label, "world_size": self.world_size, **self.report.to_dict()}
