"""``crash_loop``: a fault that strikes again on every attempt at the same step -- a poison batch, a
rank that always dies there -- and the restart policy under test must give up (``expect:
give_up``).

In every attempt, when the job prints step ``after_step`` (or the first step past it), rank
``rank`` is sent SIGKILL (a hard death, as the OOM killer or a bad GPU's Xid leaves it; never
SIGINT). The drill (:mod:`trainguard.drills.crash_loop`) lets the job's own restart policy run --
trainguard's launcher with ``job.max_restarts`` and ``job.restart`` -- and judges what it did:
it stopped within ``max_attempts`` attempts, waited at least ``min_backoff_s`` before each
restart, and never began again from step 1 while a checkpoint existed. The report names the step
that keeps failing, each attempt's progress, the waits measured and the rank-seconds spent.

Parameters (``params`` of a ``fault: crash_loop`` drill):

* ``max_attempts``: the cap: the most attempts the policy may start (default ``job.max_restarts``
  + 1); the drill lets one attempt past it start, to prove a policy without a limit does not stop;
* ``min_backoff_s``: the shortest wait before a restart that the policy promises (default
  ``job.restart.backoff_s``; 0: not judged);
* ``target``: ``rank`` (default: the rank's own process; trainguard's launcher restarts the group)
  or ``worker``: the rank's child processes -- the workers of a job whose command is ``torchrun
  --max-restarts N ...`` (one trainguard rank, ``distributed_env: false``): torchrun's own policy
  is under test. An attempt is then a worker generation: its wait is measured from the kill to
  the next worker's process start, and a generation past the cap is stopped by the drill;
* ``how``: ``kill`` (default: SIGKILL) or ``raise``: the rank's Python raises a RuntimeError at
  the step (trainguard's start-up hook, armed in every attempt; the drill names the attempt's pid
  in the trigger, so each attempt raises once): the rank's process on trainguard's launcher,
  torchrun's workers (``target: worker``), the train function's thread of a Ray Train worker;
* ``node: first`` (a ``ray_train`` job): the fault follows a node, not the step: it strikes only
  while the rank's worker runs on the node it ran on in attempt 0 (a bad GPU's node); a restart
  that puts the rank back there fails, one that moves it off passes when the job completes.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, ClassVar

from trainguard.config.fault_params import FaultParams
from trainguard.config.faults import Expectation
from trainguard.faults.base import Fault

if TYPE_CHECKING:  # pragma: no cover
    from trainguard.config import DrillSpec
    from trainguard.config.registry import Run
    from trainguard.launch import Launcher

__all__ = ["HOWS", "MAX_CAP", "TARGETS", "CrashLoopFault"]

#: what the fault kills: the rank's process, or its child processes (torchrun's workers)
TARGETS = ("rank", "worker")
#: how the fault strikes: SIGKILL, or a RuntimeError raised in the rank's Python at the step
HOWS = ("kill", "raise")
#: the largest ``max_attempts`` a drill may set (each attempt is a real launch)
MAX_CAP = 20


class CrashLoopFault(Fault):
    """The ``crash_loop`` entry of the fault registry: its parameters; the drill strikes every
    attempt itself (this class injects nothing)."""

    kind: ClassVar[str] = "crash_loop"
    expectations: ClassVar[tuple[Expectation, ...]] = (Expectation.GIVE_UP,)
    drill_runner: ClassVar[str | None] = "trainguard.drills.crash_loop:run_crash_loop"
    spec_keys_not_applying: ClassVar[tuple[tuple[str, ...], str]] = (
        ("duration",), "the fault strikes every attempt until the policy gives up; remove it")
    defaults: ClassVar[FaultParams] = FaultParams({"max_attempts": None, "min_backoff_s": None, "target": "rank", "node": None,
                                                   "how": "kill"})

    @classmethod
    def validate(cls, params: FaultParams) -> list[tuple[str, str]]:
        problems = super().validate(params)
        cap = params.raw("max_attempts")
        if cap is not None and (not isinstance(cap, int) or isinstance(cap, bool) or not 1 <= cap <= MAX_CAP):
            problems.append(("max_attempts", f"expected the most attempts the policy may start, from 1 to "
                             f"{MAX_CAP}, e.g. `max_attempts: 3`"))
        wait = params.raw("min_backoff_s")
        if wait is not None and (not isinstance(wait, (int, float)) or isinstance(wait, bool)
                                 or not math.isfinite(wait) or not 0 <= wait <= 600):
            problems.append(("min_backoff_s", "expected the shortest wait before a restart in seconds, from 0 "
                             "to 600, e.g. `min_backoff_s: 1`"))
        if params.raw("target", "rank") not in TARGETS:
            problems.append(("target", f"expected one of {', '.join(TARGETS)}: `rank` (trainguard restarts the "
                             "group) or `worker` (torchrun --max-restarts restarts its workers)"))
        if params.raw("how", "kill") not in HOWS:
            problems.append(("how", "expected `kill` (SIGKILL to the rank) or `raise` (the rank's Python raises a "
                             "RuntimeError at the step, through trainguard's start-up hook)"))
        if params.raw("node") not in (None, "first"):
            problems.append(("node", "expected `first` (strike only on the node the rank ran on in attempt 0)"))
        return problems

    @classmethod
    def drill_runs(cls, spec: DrillSpec, world_size: int, seed: int | None) -> tuple[list[Run], str] | None:
        from trainguard.config.registry import Run

        cap = spec.params.get("max_attempts")
        runs = [Run(f"attempt {i}", world_size) for i in range((cap or 1) + 1)]
        return runs, (f"crash loop: SIGKILL to rank {spec.rank} at step {spec.after_step} of every attempt, "
                      f"expect give_up within {cap or 'job.max_restarts + 1'} attempts")

    def inject(self, launcher: Launcher) -> None:  # the drill strikes each attempt itself
        raise NotImplementedError("crash_loop is driven by trainguard.drills.crash_loop")
