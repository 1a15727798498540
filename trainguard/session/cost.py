"""What a gate costs, said before it runs and measured after: launches, rank-seconds, the time
each launch spends reaching its first step, and the same gate projected onto the target.

A launch here is one process start of the job on its ranks (a run, or one attempt of a run a
drill restarts), as the runner recorded it (:class:`~trainguard.run.runner.LaunchRecord`). On a
tiny model a launch is seconds; on a real one it loads weights, compiles and warms up for
minutes on every GPU before its first step: ``target.startup_minutes`` says how long, and the
projection is ``launches x start-up + steps x step time``, in GPU-hours, with the step time per
world size measured here (docs/gate.md, "What the gate costs").
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from trainguard._internal.readers import Unreadable, active_limits, read_json

__all__ = ["Cost", "LaunchCost", "Projection", "launch_shapes", "measured_cost", "planned_cost", "records_from_report"]


@dataclass(frozen=True)
class LaunchCost:
    """One launch as the cost counts it (a gate report's ``cost.records``): the run it was (None
    when read back from a report), its ranks, seconds, seconds to its first step (None: it printed
    none) and steps, times to the millisecond."""

    label: str | None
    world_size: int
    seconds: float
    first_step_s: float | None
    steps: int

    @classmethod
    def of(cls, record: Any) -> LaunchCost:
        """The cost of a :class:`~trainguard.run.runner.LaunchRecord`, as its report holds it."""
        first = record.first_step_s
        return cls(record.label, record.world_size, round(record.seconds, 3),
                   None if first is None else round(first, 3), record.steps)


@dataclass(frozen=True)
class Projection:
    """The same gate on the target (``target.startup_minutes`` to a launch's first step): its
    GPU-hours starting up, stepping (None: a world size's step time was not measured here) and in
    all, with the step time per world size measured here."""

    startup_minutes: float
    startup_gpu_hours: float
    steps_gpu_hours: float | None
    gpu_hours: float | None
    step_seconds: dict[str, float]


@dataclass
class Cost:
    """The cost of one gate, measured (``measured``) or planned from the last one here."""

    launches: int
    measured: bool
    rank_seconds: float | None = None
    #: the median time from a launch to its first step
    startup_s_per_launch: float | None = None
    #: start-up rank-seconds over all rank-seconds
    startup_share: float | None = None
    #: with ``target.startup_minutes``: GPU-hours of the same gate on the target
    projection: Projection | None = None
    #: where an estimate came from, or why there is none
    note: str = ""
    records: list[LaunchCost] = field(default_factory=list)
    #: checks that launched nothing and read another check's run (the gate's default
    #: ``invariants``): name -> seconds spent reading it
    reads: dict[str, float] = field(default_factory=dict)

    def reported(self) -> Cost:
        """This cost as a report holds it: rank-seconds and seconds a launch to 0.1, the share to
        0.001."""
        return dataclasses.replace(self, rank_seconds=_r(self.rank_seconds),
                                   startup_s_per_launch=_r(self.startup_s_per_launch),
                                   startup_share=_r(self.startup_share, 3))

    def to_dict(self) -> dict[str, Any]:
        """The report's ``cost`` object (:meth:`reported`)."""
        shown = self.reported()
        return {"launches": shown.launches, "measured": shown.measured, "rank_seconds": shown.rank_seconds,
                "startup_s_per_launch": shown.startup_s_per_launch, "startup_share": shown.startup_share,
                "projection": asdict(shown.projection) if shown.projection is not None else None,
                "note": shown.note, "records": [asdict(r) for r in shown.records],
                "reads": {name: round(seconds, 1) for name, seconds in shown.reads.items()}}

    def line(self) -> str:
        """One line for people: ``cost: 24 launches, 1834 rank-s, start-up 5.1 s a launch (41 %)``."""
        words = [f"cost: {self.launches} launch(es)"]
        if self.rank_seconds is not None:
            words.append(f"{'' if self.measured else 'about '}{self.rank_seconds:.0f} rank-seconds")
        if self.startup_s_per_launch is not None:
            share = f" ({self.startup_share:.0%} of the rank-seconds)" if self.startup_share is not None else ""
            words.append(f"start-up {self.startup_s_per_launch:.1f} s a launch{share}")
        text = ", ".join(words)
        if self.note:
            text += f" ({self.note})"
        if self.reads:
            text += "; " + ", ".join(f"{name} {seconds:.1f} s reading a run another check made (no launch)"
                                     for name, seconds in self.reads.items())
        if self.projection is not None:
            p = self.projection
            total = "unknown" if p.gpu_hours is None else f"{p.gpu_hours:.2f} GPU-hours"
            text += (f"; on the target ({p.startup_minutes:g} min to a launch's first step): {total}, "
                     f"{p.startup_gpu_hours:.2f} of them starting up")
        return text


def _r(value: float | None, digits: int = 1) -> float | None:
    return None if value is None else round(value, digits)


def _step_seconds(records: Iterable[LaunchCost]) -> dict[int, float]:
    """World size -> the median seconds per step after the first, over launches that printed
    steps."""
    per: dict[int, list[float]] = {}
    for r in records:
        first, steps = r.first_step_s, int(r.steps or 0)
        if first is not None and steps > 1 and r.seconds > first:
            per.setdefault(int(r.world_size), []).append((r.seconds - first) / steps)
    return {ws: statistics.median(v) for ws, v in per.items()}


def _project(shapes: Sequence[tuple[int, int]], step_s: Mapping[int, float], minutes: float | None) -> Projection | None:
    """``shapes``: (world size, steps) per launch."""
    if minutes is None:
        return None
    startup = sum(ws * minutes / 60 for ws, _ in shapes)
    known = all(ws in step_s for ws, steps in shapes if steps)
    steps = sum(ws * steps * step_s.get(ws, 0.0) / 3600 for ws, steps in shapes) if known else None
    return Projection(startup_minutes=minutes, startup_gpu_hours=round(startup, 3),
                      steps_gpu_hours=None if steps is None else round(steps, 3),
                      gpu_hours=None if steps is None else round(startup + steps, 3),
                      step_seconds={str(k): round(v, 4) for k, v in sorted(step_s.items())})


def measured_cost(records: Sequence[Any], startup_minutes: float | None) -> Cost:
    """The cost of the launches the runner recorded (:class:`~trainguard.run.runner.LaunchRecord`)."""
    rows = [LaunchCost.of(r) for r in records]
    rank_seconds = sum(r.world_size * r.seconds for r in rows)
    firsts = [r.first_step_s for r in rows if r.first_step_s is not None]
    startup = sum(r.world_size * r.first_step_s for r in rows if r.first_step_s is not None)
    shapes = [(r.world_size, r.steps) for r in rows]
    return Cost(len(rows), True, rank_seconds, statistics.median(firsts) if firsts else None,
                startup / rank_seconds if rank_seconds > 0 else None,
                _project(shapes, _step_seconds(rows), startup_minutes), records=rows)


def records_from_report(path: Path) -> list[LaunchCost]:
    """The launch records of a gate report (``cost.records``), read as data; [] when there are
    none or the file is not one."""
    try:
        data = read_json(path, active_limits())
    except (OSError, Unreadable):
        return []
    cost = data.get("cost") if isinstance(data, dict) else None
    rows = cost.get("records") if isinstance(cost, dict) else None
    out = []
    for row in rows if isinstance(rows, list) else []:
        if isinstance(row, dict) and all(isinstance(row.get(k), (int, float)) and not isinstance(row.get(k), bool)
                                         and math.isfinite(row[k]) and row[k] >= 0
                                         for k in ("world_size", "seconds", "steps")):
            first = row.get("first_step_s")
            out.append(LaunchCost(None, int(row["world_size"]), float(row["seconds"]),
                                  float(first) if isinstance(first, (int, float)) and math.isfinite(first) else None,
                                  int(row["steps"])))
    return out


def launch_shapes(plan: Any) -> list[tuple[int, int]]:
    """(world size, steps) of each launch a plan makes (its distinct runs)."""
    return [(run.world_size, run.steps) for run in plan.distinct_runs()]


def planned_cost(shapes: Sequence[tuple[int, int]], history: Sequence[LaunchCost], source: str,
                 startup_minutes: float | None) -> Cost:
    """The cost of launches of ``shapes`` before they run: rank-seconds and start-up from the
    launches of the last gate here (``history``) when it measured each world size, else unknown."""
    step_s = _step_seconds(history)
    firsts: dict[int, list[float]] = {}
    for r in history:
        if r.first_step_s is not None:
            firsts.setdefault(int(r.world_size), []).append(float(r.first_step_s))
    startup = {ws: statistics.median(v) for ws, v in firsts.items()}
    cost = Cost(len(shapes), False, projection=_project(shapes, step_s, startup_minutes))
    if not history:
        cost.note = "rank-seconds unknown until a gate has run here"
        return cost
    if not all(ws in startup and (ws in step_s or not steps) for ws, steps in shapes):
        cost.note = f"the last gate ({source}) measured not every world size planned"
        return cost
    starting = sum(ws * startup[ws] for ws, _ in shapes)
    cost.rank_seconds = starting + sum(ws * steps * step_s.get(ws, 0.0) for ws, steps in shapes)
    cost.startup_s_per_launch = statistics.median(startup[ws] for ws, _ in shapes)
    cost.startup_share = starting / cost.rank_seconds if cost.rank_seconds > 0 else None
    cost.note = f"estimated from the launches of {source}"
    return cost
