"""The goodput forecast: what share of the full run's wall-clock makes new progress.

Goodput here is Meta's effective training time ratio (ETTR): time spent making new progress /
wall-clock, between 0 and 1. The model (docs/profiling.md, "Goodput forecast"), per world size:

* ``work_s``: the failure-free run (the sizing's wall-clock without failures);
* a checkpoint every ``interval_s`` of work costs ``save_s`` (the profile's checkpoint cost);
* failures arrive at rate 1 / MTBF of the job (per wall-clock second);
* one failure costs ``restart_s`` (fault -> the first new step: detection, relaunch, start-up),
  ``load_s`` (reading the checkpoint back; part of ``restart_s`` when that was measured) and the
  work done since the last checkpoint, half an interval on average.

Wall-clock W = work (1 + save/interval) + (W / MTBF) x (restart + load + interval/2), so

    goodput = work / W = (1 - (restart + load + interval/2) / MTBF) / (1 + save / interval)

and the interval that maximises it solves interval^2 + 2 save interval - 2 a save MTBF = 0,
a = 1 - (restart + load) / MTBF: interval* = -save + sqrt(save^2 + 2 a save MTBF), which is
Young/Daly's sqrt(2 save MTBF) when save and restart are small against the MTBF.

Inputs are measured where this session measured them (the profile's checkpoint cost; restart
cost and lost steps from the recover drills of the same gate/check session,
:func:`measured_recovery`), else the ``target:`` defaults; :class:`FailureInputs` keeps each
one's source, so the report can say which.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable
from dataclasses import dataclass

from trainguard.drills.evidence import (
    DrillEvidence,
    DrillReport,
    FailCleanEvidence,
    RecoverEvidence,
    SaveAndExitEvidence,
    SoakEvidence,
    SoakMeasured,
    SoakReport,
    SoakRuns,
)
from trainguard.report import CheckResult

__all__ = [
    "FailureInputs",
    "IntervalChoice",
    "goodput",
    "interval_curve",
    "measured_recovery",
    "optimal_interval_s",
    "wall_clock_s",
]


@dataclass(frozen=True)
class FailureInputs:
    """What one failure costs, with where each figure came from (``measured ...`` or
    ``default ...``). ``load_s`` None: the load takes as long as the save at each size."""

    restart_s: float
    restart_source: str
    load_s: float | None
    load_source: str
    #: the restart was measured from fault to the first new step, which includes the load
    load_in_restart: bool = False
    #: steps a recover drill lost per failure at the job's own checkpoint cadence (None: none ran)
    lost_steps: float | None = None
    lost_source: str = "no recover drill in this session"

    def fixed_s(self, save_s: float | None) -> float:
        """Seconds every failure costs besides the lost work: restart + load (the load defaults
        to the save time when neither was given)."""
        if self.load_in_restart:
            return self.restart_s
        return self.restart_s + (self.load_s if self.load_s is not None else save_s or 0.0)


def wall_clock_s(work_s: float, interval_s: float, save_s: float, mtbf_s: float, fixed_s: float) -> float:
    """Expected wall-clock of ``work_s`` seconds of work checkpointed every ``interval_s`` (each
    save ``save_s``), failures every ``mtbf_s`` on average costing ``fixed_s`` + interval/2.
    ``inf`` when a failure costs as much as the time between failures (no progress)."""
    if work_s <= 0:
        return 0.0
    share = (fixed_s + interval_s / 2) / mtbf_s
    if share >= 1:
        return math.inf
    return work_s * (1 + save_s / interval_s) / (1 - share)


def goodput(interval_s: float, save_s: float, mtbf_s: float, fixed_s: float) -> float:
    """Work / wall-clock (0..1) at ``interval_s`` (see :func:`wall_clock_s`)."""
    if interval_s <= 0:
        return 0.0
    share = (fixed_s + interval_s / 2) / mtbf_s
    return max(0.0, 1 - share) / (1 + save_s / interval_s)


@dataclass(frozen=True)
class IntervalChoice:
    """The checkpoint interval chosen and why."""

    interval_s: float
    optimum_s: float | None  # the uncapped goodput optimum (None: saves cost nothing measurable)
    young_daly_s: float | None  # sqrt(2 save MTBF), for comparison
    rule: str


def optimal_interval_s(save_s: float, mtbf_s: float, fixed_s: float, cap_s: float,
                       floor_s: float = 0.0) -> IntervalChoice:
    """The interval that maximises :func:`goodput`, capped at ``cap_s`` (a failure loses at
    most that much work) and at least ``floor_s`` (one step: a job saves between steps)."""
    if save_s <= 0:
        return IntervalChoice(cap_s, None, None,
                              "checkpoints cost nothing measurable: interval = the lost-work cap")
    a = max(0.0, 1 - fixed_s / mtbf_s)
    best = -save_s + math.sqrt(save_s * save_s + 2 * a * save_s * mtbf_s)
    daly = math.sqrt(2 * save_s * mtbf_s)
    if best > cap_s:
        return IntervalChoice(cap_s, best, daly, f"the goodput optimum is {best / 60:.1f} min "
                              f"(Young/Daly {daly / 60:.1f} min); capped at the lost-work limit")
    if best < floor_s:
        return IntervalChoice(floor_s, best, daly, "the goodput optimum is shorter than one step: "
                              "every step")
    return IntervalChoice(best, best, daly, "goodput optimum -C + sqrt(C^2 + 2 C (MTBF - restart)) "
                          f"(Young/Daly sqrt(2 C MTBF) gives {daly / 60:.1f} min)")


def interval_curve(save_s: float, mtbf_s: float, fixed_s: float, around_s: float,
                   floor_s: float = 0.0, points: int = 41) -> list[tuple[float, float]]:
    """(interval, goodput) on a log grid from around_s / 30 to around_s x 30 (not below
    ``floor_s``): the plot of goodput vs checkpoint interval."""
    lo = max(around_s / 30, floor_s, 1e-3)
    hi = max(around_s * 30, lo * 2)
    step = (math.log(hi) - math.log(lo)) / (points - 1)
    grid = [math.exp(math.log(lo) + i * step) for i in range(points)]
    return [(t, goodput(t, save_s, mtbf_s, fixed_s)) for t in grid]


def _recover_drills(checks: Iterable[CheckResult]) -> list[tuple[str, DrillEvidence]]:
    """(name, judged record) of each passed drill that restarted the job."""
    return [(c.name, c.evidence.found) for c in checks if c.check_id.is_drill and c.status == "passed"
            and isinstance(c.evidence, DrillReport) and isinstance(c.evidence.found, DrillEvidence)
            and c.evidence.found.restarts]


def _soak_runs(checks: Iterable[CheckResult]) -> list[tuple[str, SoakReport]]:
    """(name, run) of each run of each passed chaos soak (several seeds: one a seed)."""
    out: list[tuple[str, SoakReport]] = []
    for c in checks:
        if c.check_id.is_drill and c.status == "passed":
            if isinstance(c.evidence, SoakRuns):
                out += [(c.name, run) for run in c.evidence.runs]
            elif isinstance(c.evidence, SoakReport):
                out.append((c.name, c.evidence))
    return out


def _number(value: object) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def measured_recovery(checks: Iterable[CheckResult], defaults: FailureInputs) -> FailureInputs:
    """``defaults`` with what the passed recover drills among ``checks`` measured: the restart
    cost (median fault -> first step after the restart, which includes loading the checkpoint)
    and the steps lost per failure (median); a passed chaos soak counts as one such drill per
    seed, with its mean over its faults. Unchanged when no such drill ran."""
    checks = list(checks)
    drills = _recover_drills(checks)
    restarts = [(name, cost) for name, found in drills if isinstance(found, RecoverEvidence)
                and (cost := _number(found.fault_to_first_step_after_restart_s)) is not None]
    lost = [(name, gone) for name, found in drills
            if isinstance(found, RecoverEvidence | FailCleanEvidence | SaveAndExitEvidence)
            and (gone := _number(found.lost_steps)) is not None]
    for name, run in _soak_runs(checks):  # a passed chaos soak: the mean over its faults
        measured = run.found.measured if isinstance(run.found, SoakEvidence) else None
        if not isinstance(measured, SoakMeasured):
            continue
        label = f"{name} seed {run.seed}"
        if measured.restart_s is not None:
            restarts.append((label, float(measured.restart_s.mean)))
        if measured.lost_steps is not None:
            lost.append((label, float(measured.lost_steps.mean)))
    out = defaults
    if restarts:
        names = ", ".join(n for n, _ in restarts)
        out = FailureInputs(
            restart_s=statistics.median(v for _, v in restarts),
            restart_source=f"measured: fault -> first new step, median of {names} on this machine",
            load_s=None, load_source="included in the measured restart", load_in_restart=True,
            lost_steps=out.lost_steps, lost_source=out.lost_source,
        )
    if lost:
        names = ", ".join(n for n, _ in lost)
        out = FailureInputs(out.restart_s, out.restart_source, out.load_s, out.load_source,
                            out.load_in_restart, lost_steps=statistics.median(v for _, v in lost),
                            lost_source=f"measured: median of {names} (the job's own checkpoint cadence)")
    return out
