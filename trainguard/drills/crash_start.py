"""Crash runs that start at the save, not at step 1 (``checks.crash_points``, issue 49;
docs/crash-points.md, "Crash runs start at the save").

The recording run keeps a copy of its checkpoint directory when trainguard reads the line of step
``after_step`` (:class:`CopyAtStep`): the save explored begins after that line, so the copy is
the checkpoint the job had before it. Each crash run then starts from that copy, resumed with
``resume_args``, and trains only from the checkpoint to the save. Its boundaries are the
recording's, their ordinals less the operations the recording had made before the copy
(:meth:`SaveStart.shifted`).

A crash run from the copy is used only when it did what a run from step 1 would: it reached its
boundary, it resumed (its first step is after the run's first), and every step it printed equals
the uninterrupted run's. Otherwise that crash is made again from step 1, and so is every later
one (:meth:`SaveStart.give_up`, the reason in the evidence). There is no copy, and every crash
run starts at step 1, in power-loss mode (the checkpoint before the save must be written by the
crash run itself: whether it was made durable is part of the answer), when no checkpoint was
written before the save, and when the job wrote to its checkpoint directory while the copy was
made.
"""

from __future__ import annotations

import shutil
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from trainguard.checks.equivalence import compare_trajectories
from trainguard.drills.crash_records import Boundary, CrashRule
from trainguard.faults.fusefs import FuseLayer, JournalEvent
from trainguard.launch import Launcher, MetricPoint
from trainguard.launch.metrics import aligned_trajectories

__all__ = ["CopyAtStep", "SaveStart", "StepWatch", "save_start", "unlike_a_run_from_step_1"]


@dataclass
class CopyAtStep:
    """The recording run's copy of the checkpoint directory, made when the line of
    ``after_step`` is read: when it began and ended (the journal's clock), the step read."""

    backing: Path
    keep: Path
    after_step: int
    began: float | None = None
    ended: float | None = None
    step: int | None = None

    def __call__(self, step: int) -> None:
        if self.began is not None or step < self.after_step:
            return
        self.began, self.step = time.time(), step
        shutil.rmtree(self.keep, ignore_errors=True)
        try:
            shutil.copytree(self.backing, self.keep, symlinks=True)
        except (OSError, shutil.Error):
            shutil.rmtree(self.keep, ignore_errors=True)
            self.began = None
            self.step = -1  # never again: a run from step 1
            return
        self.ended = time.time()


@dataclass
class SaveStart:
    """Where each crash run starts: the kept copy (``keep``; ``shift``: the operations before
    it, per rank, file and kind), or step 1 (``keep`` None, ``why`` says why)."""

    keep: Path | None
    why: str
    shift: Counter[tuple[int, str, str]] = field(default_factory=Counter)
    #: crash runs that started from the copy and were used
    used: int = 0
    #: boundaries restarted on the state the recording left, with no crash run (crash_restore)
    from_states: int = 0
    #: the counts are kept from every lane at once (crash_lanes)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def count(self, *, used: int = 0, from_states: int = 0) -> None:
        """Count a crash run from the copy that was used, or a boundary restarted on its state."""
        with self._lock:
            self.used, self.from_states = self.used + used, self.from_states + from_states

    def shifted(self, boundary: Boundary) -> Boundary | None:
        """``boundary`` as a run from the copy names it (None: the copy holds it already)."""
        ordinal = boundary.ordinal - self.shift[(boundary.rank, boundary.path, boundary.op)]
        return Boundary(boundary.rank, boundary.path, boundary.op, ordinal, boundary.to) if ordinal >= 1 else None

    def give_up(self, why: str) -> None:
        self.keep, self.why = None, f"step 1 from the crash run that {why} on (the ones before it started at the save)"

    def words(self) -> str:
        said = self.why if self.keep is None else f"{self.why}; {self.used} crash runs started there"
        return said + (f"; {self.from_states} boundaries restarted on the state the recording run left right "
                       "after them (no crash run)" if self.from_states else "")


def save_start(copy: CopyAtStep | None, events: list[JournalEvent], first: Boundary, checkpoint_before: bool,
               mode: str) -> SaveStart:
    """Where the crash runs of a save that begins at ``first`` start (the module's docstring)."""
    if mode == "power":
        return SaveStart(None, "step 1: in power-loss mode the crash run writes the checkpoint before the save "
                               "itself (whether it was made durable is part of the answer)")
    if copy is None or copy.began is None or copy.ended is None:
        return SaveStart(None, "step 1: no copy of the checkpoint directory was kept when the line of step "
                               f"{copy.after_step if copy else '?'} was read")
    if not checkpoint_before:
        return SaveStart(None, "step 1: no checkpoint was written before the save, so there is none to start from")
    ops = [e for e in events if e.event == "op"]
    if any(e.start <= copy.ended and e.t >= copy.began for e in ops):
        return SaveStart(None, "step 1: the job wrote to its checkpoint directory while the copy was made")
    began = next((e.start for e in ops if first.made(e)), None)
    if began is None or began <= copy.ended:
        return SaveStart(None, "step 1: the save began before the copy of the checkpoint directory was complete")
    shift = Counter((int(e.rank or 0), e.path, e.op) for e in ops if e.t < copy.began)
    return SaveStart(copy.keep, f"the save: each crash run resumed from a copy of the checkpoint directory kept "
                                f"when the line of step {copy.step} was read", shift)


def unlike_a_run_from_step_1(points: list[MetricPoint], reference: list[MetricPoint], metric: str, base: int,
                             rtol: float, atol: float) -> str | None:
    """Why a crash run started from the copy is not what a run from step 1 would have been
    (None: it is): it printed no step, began at the first step, or differs from the uninterrupted
    run."""
    steps = sorted({p.step for p in points if p.name == metric})
    if not steps:
        return "printed no step before the crash"
    if steps[0] <= base:
        return f"began at step {steps[0]}, not after the copy's checkpoint"
    actual, expected = aligned_trajectories(points, reference, metric)
    diff = compare_trajectories(actual, expected, metric=metric, steps=range(steps[0], steps[-1] + 1),
                                rtol=rtol, atol=atol)
    if not diff.ok:
        return (f"resumed from the copy and {metric} differs from the uninterrupted run at step "
                f"{diff.first_divergent_step} (the job's resume is not exact)")
    return None


class StepWatch:
    """The metric callback of a crash_points run (recording or crash). The rule is armed before the job starts
    (so a boundary's ordinal counts from the start, whatever the lag of the job's output); once
    the ranks are known the crash rule is rewritten with their process groups to kill. It keeps
    the arrival time of every step line (when the launcher read it)."""

    def __init__(self, layer: FuseLayer, metric: str, rule: str, spec: CrashRule, *hooks: Callable[[int], None]) -> None:
        self.layer, self.metric, self.rule, self.spec, self.hooks = layer, metric, rule, spec, hooks
        self.arrivals: list[tuple[int, float]] = []
        self._told = False
        layer.arm({rule: spec})

    def __call__(self, point: MetricPoint, launcher: Launcher) -> None:
        if point.name != self.metric:
            return
        # when the launcher's pump read the line, not when this callback runs: the monitor may
        # come to it late on a busy machine, after a save that began after it was printed
        self.arrivals.append((point.step, time.time() - max(0.0, launcher.elapsed() - point.t)))
        for hook in self.hooks:  # the recording's: the copy before the save, the state copies
            hook(point.step)
        if not self._told and self.rule == "crash":
            self._told = True
            self.layer.arm({self.rule: {**self.spec, "kill": [r.pid for r in launcher.ranks]}})
