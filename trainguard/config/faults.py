"""Fault kinds -> the classes that inject them, and expectations -> their judges, resolved lazily.

Two registries (:class:`~trainguard._internal.registry.Registry`): :data:`FAULTS` and
:data:`EXPECTATIONS`. The job file is validated without importing a fault module until a drill
names that kind, and a kind whose module is missing (an older or partial install, a fault still
being written) is reported in words, not as an ImportError traceback. The job-file schema, the
``fault`` marker and the docs' tables take their names from here. This module imports nothing
heavy.
"""

from __future__ import annotations

from collections.abc import Callable
from enum import StrEnum
from typing import TYPE_CHECKING, Any, Protocol

from trainguard._internal.registry import Registry
from trainguard.config.fault_params import FaultParams
from trainguard.errors import TrainguardError

if TYPE_CHECKING:  # pragma: no cover
    from trainguard.launch.backend import JobBackend

__all__ = [
    "EXPECTATIONS",
    "FAULTS",
    "Expectation",
    "ExpectationJudge",
    "FaultClass",
    "FaultNotInstalled",
    "fault_class",
    "faults_judged_by",
]

class Expectation(StrEnum):
    """What a drill expects of the job (docs/drills.md); each is judged by its own judge
    (:mod:`trainguard.drills.judges`). Equal to its text, the value of ``expect:``."""

    #: the job is restarted from its latest checkpoint and trains on exactly as if unhurt
    RECOVER = "recover"
    #: the job exits non-zero within a deadline, having lost no more than it may
    FAIL_CLEAN = "fail_clean"
    #: the job keeps training through the fault, slower at most by a floor
    CONTINUE = "continue"
    #: on a pre-emption notice the job saves and exits 0 within the grace
    SAVE_AND_EXIT = "save_and_exit"
    #: a non-finite loss or gradient is skipped or stops the job, as its policy says
    HANDLE_NONFINITE = "handle_nonfinite"
    #: trainguard's own records name a silent corruption: the replica invariant, or the first
    #: divergence from the uninterrupted run (rank, step, tensor)
    CAUGHT = "caught"
    #: the job's own defence reports a silent corruption within ``within_steps``
    DETECT = "detect"
    #: a fault that strikes every attempt: the restart policy stops within its cap, waits its
    #: backoff, resumes from the checkpoint, and the report names the step that keeps failing
    GIVE_UP = "give_up"



class ExpectationJudge(Protocol):
    """An expectation's judge as this layer sees it (:class:`trainguard.drills.expectations.JudgeEntry`):
    what the drill driver calls, and how."""

    #: the expectation it judges (``expect:``)
    name: str
    #: ``(DrillContext) -> Judgement``
    judge: Callable[[Any], Any]
    #: its verdict waits on an untimed verification run (fail_clean's resume from the checkpoint
    #: the fault left): a session that runs those after its timed checks finishes it then
    finishes_later: bool

class FaultClass(Protocol):
    """A fault class as this layer sees it (:class:`trainguard.faults.base.Fault` and its
    subclasses): the job file validates a drill's ``params`` with it, and the drill driver
    constructs the fault from it. Defined here so the config layer never imports the faults one."""

    def __call__(
        self,
        params: FaultParams | None = None,
        *,
        rank: int = 0,
        after_step: int = 1,
        duration: float | None = None,
    ) -> Any:
        """A fault of this kind for one drill."""
        ...

    def validate(self, params: FaultParams) -> list[tuple[str, str]]:
        """Problems with ``params`` as ``(key, message with the fix)`` pairs; empty when valid."""
        ...

    def expectations_for(self, params: FaultParams) -> tuple[Expectation, ...]:
        """The expectations a drill with these ``params`` may be judged by, its default first."""
        ...

    drill_runner: str | None
    spec_keys_not_applying: tuple[tuple[str, ...], str]
    #: it strikes once every reporting rank has printed after_step (:attr:`Fault.strikes_every_rank`)
    strikes_every_rank: bool

    def drill_runs(self, spec: Any, world_size: int, seed: int | None) -> tuple[list[Any], str] | None:
        """The runs a drill of this fault makes (None: the usual ones)."""
        ...

    def drill_items(self, spec: Any, seed: int | None) -> list[tuple[str, Any]]:
        """The pytest items of a drill: (id suffix, spec each runs)."""
        ...

    def plan_problems(self, params: FaultParams, steps: int, world_size: int) -> list[tuple[str, str]]:
        """Problems of ``params`` that need the drill's steps and world size."""
        ...

    def unavailable_for(self, backend: JobBackend) -> str | None:
        """Why the fault cannot strike a job whose ranks run as ``backend`` says, with what to
        use instead; None when it can."""
        ...


class FaultNotInstalled(TrainguardError):
    """A known fault kind whose implementation cannot be imported here."""


def _fault_not_installed(kind: str, line: str, exc: Exception) -> Exception:
    module_name, _, class_name = line.partition(":")
    if isinstance(exc, ImportError):
        return FaultNotInstalled(
            f"fault {kind!r} is not available in this installation: importing {module_name} "
            f"failed ({type(exc).__name__}: {exc}); upgrade trainguard (or install the missing "
            "package named there), or remove the drill"
        )
    return FaultNotInstalled(
        f"fault {kind!r} is not available in this installation: {module_name} has no "
        f"{class_name}; upgrade trainguard or remove the drill"
    )


#: fault kind -> the class that injects it (a :class:`trainguard.faults.base.Fault`), in
#: docs/drills.md's order of the ``fault`` marker
FAULTS: Registry[FaultClass] = Registry("fault", {
    "kill_rank": "trainguard.faults.kill:KillRankFault",
    "hang": "trainguard.faults.hang:HangFault",
    "oom": "trainguard.faults.oom:OomFault",
    "disk_full": "trainguard.faults.disk_full:DiskFullFault",
    "network": "trainguard.faults.network:NetworkFault",
    "preempt": "trainguard.faults.preempt:PreemptFault",
    "nan": "trainguard.faults.nan:NanFault",
    "sdc": "trainguard.faults.sdc:SdcFault",
    "storage": "trainguard.faults.storage:StorageFault",
    "kill_during_save": "trainguard.faults.kill_during_save:KillDuringSaveFault",
    "kill_worker": "trainguard.faults.kill_worker:KillWorkerFault",
    "slow_rank": "trainguard.faults.slow_rank:SlowRankFault",
    "node_loss": "trainguard.faults.node_loss:NodeLossFault",
    "soak": "trainguard.faults.soak:SoakFault",
    "crash_loop": "trainguard.faults.crash_loop:CrashLoopFault",
}, accepts=lambda value: isinstance(value, type), a="a fault class", error=FaultNotInstalled,
    missing=_fault_not_installed)

#: expectation -> its judge (``expect:``; docs/drills.md, "What each expectation proves")
EXPECTATIONS: Registry[ExpectationJudge] = Registry("expectation", {
    "recover": "trainguard.drills.expectations:RECOVER",
    "fail_clean": "trainguard.drills.expectations:FAIL_CLEAN",
    "continue": "trainguard.drills.expectations:CONTINUE",
    "save_and_exit": "trainguard.drills.save_and_exit:SAVE_AND_EXIT",
    "handle_nonfinite": "trainguard.drills.nonfinite:HANDLE_NONFINITE",
    "caught": "trainguard.drills.sdc:CAUGHT",
    "detect": "trainguard.drills.sdc:DETECT",
    "give_up": "trainguard.drills.crash_loop:GIVE_UP",
}, accepts=lambda value: callable(getattr(value, "judge", None)), a="an expectation's judge (drills.expectations.JudgeEntry)",
    name_of=lambda entry: entry.name)


def fault_class(kind: str) -> FaultClass:
    """The class injecting ``kind``; ``KeyError`` for an unknown kind (the config layer reports
    it with the list of kinds), :class:`FaultNotInstalled` when its module cannot be imported."""
    return FAULTS.get(kind)


def faults_judged_by(expect: Expectation) -> list[str]:
    """The fault kinds a drill judged by ``expect`` may have (imports every installed fault
    module: for an error message, not for validating a job file)."""
    kinds = []
    for kind in FAULTS:
        try:
            cls = fault_class(kind)
        except FaultNotInstalled:
            continue
        if expect in cls.expectations_for(FaultParams()) or any(expect in e for e in getattr(cls, "kind_expectations", {}).values()):
            kinds.append(kind)
    return kinds
