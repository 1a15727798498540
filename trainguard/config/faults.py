"""Fault kinds -> the classes that inject them, resolved lazily.

The job file is validated without importing a fault module until a drill names that kind, and a
kind whose module is missing (an older or partial install, a fault still being written) is
reported in words, not as an ImportError traceback. This module imports nothing heavy.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from enum import StrEnum
from typing import Any, Protocol

from trainguard.errors import TrainguardError

__all__ = [
    "DEFAULT_EXPECT",
    "EXPECTATIONS",
    "EXPECTATION_FAULTS",
    "FAULT_CLASSES",
    "FAULT_EXPECTATIONS",
    "KIND_EXPECTATIONS",
    "Expectation",
    "FaultClass",
    "FaultNotInstalled",
    "fault_class",
]

#: fault kind -> "module:Class"
FAULT_CLASSES: dict[str, str] = {
    "kill_rank": "trainguard.faults.kill:KillRankFault",
    "hang": "trainguard.faults.hang:HangFault",
    "oom": "trainguard.faults.oom:OomFault",
    "disk_full": "trainguard.faults.disk_full:DiskFullFault",
    "network": "trainguard.faults.network:NetworkFault",
    "preempt": "trainguard.faults.preempt:PreemptFault",
    "nan": "trainguard.faults.nan:NanFault",
    "storage": "trainguard.faults.storage:StorageFault",
    "kill_during_save": "trainguard.faults.kill_during_save:KillDuringSaveFault",
    "kill_worker": "trainguard.faults.kill_worker:KillWorkerFault",
    "slow_rank": "trainguard.faults.slow_rank:SlowRankFault",
    "soak": "trainguard.faults.soak:SoakFault",
    "node_loss": "trainguard.faults.node_loss:NodeLossFault",
}

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


#: what a drill expects of the job, in docs/drills.md
EXPECTATIONS = tuple(Expectation)

#: expectations only some faults can be judged by (others: every fault)
EXPECTATION_FAULTS: dict[Expectation, tuple[str, ...]] = {
    Expectation.SAVE_AND_EXIT: ("preempt",), Expectation.HANDLE_NONFINITE: ("nan",),
}

#: faults judged by some expectations only (a soak is judged as one long recover)
FAULT_EXPECTATIONS: dict[str, tuple[Expectation, ...]] = {"soak": (Expectation.RECOVER,)}

_FAIL_OR_RECOVER = (Expectation.FAIL_CLEAN, Expectation.RECOVER)
#: a fault's own kinds (its ``params.kind``) judged by some expectations only; the first is the
#: default when the spec names none
KIND_EXPECTATIONS: dict[tuple[str, str], tuple[Expectation, ...]] = {
    ("storage", "slow"): (Expectation.CONTINUE,),
    ("storage", "corrupt"): _FAIL_OR_RECOVER,
    ("storage", "eio_read"): _FAIL_OR_RECOVER,
    ("storage", "eio_write"): _FAIL_OR_RECOVER,
    ("storage", "fsync"): _FAIL_OR_RECOVER,
}

#: the expectation a drill of each kind has when its spec names none
DEFAULT_EXPECT: dict[str, Expectation] = {
    "kill_rank": Expectation.RECOVER,
    "hang": Expectation.RECOVER,
    "oom": Expectation.FAIL_CLEAN,
    "disk_full": Expectation.FAIL_CLEAN,
    "network": Expectation.CONTINUE,
    "preempt": Expectation.SAVE_AND_EXIT,
    "nan": Expectation.HANDLE_NONFINITE,
    "storage": Expectation.FAIL_CLEAN,
    "kill_during_save": Expectation.RECOVER,
    "kill_worker": Expectation.FAIL_CLEAN,
    "slow_rank": Expectation.CONTINUE,
    "soak": Expectation.RECOVER,
    "node_loss": Expectation.RECOVER,
}


class FaultClass(Protocol):
    """A fault class as this layer sees it (:class:`trainguard.faults.base.Fault` and its
    subclasses): the job file validates a drill's ``params`` with it, and the drill driver
    constructs the fault from it. Defined here so the config layer never imports the faults one."""

    def __call__(
        self,
        params: Mapping[str, Any] | None = None,
        *,
        rank: int = 0,
        after_step: int = 1,
        duration: float | None = None,
    ) -> Any:
        """A fault of this kind for one drill."""
        ...

    def validate(self, params: Mapping[str, Any]) -> list[tuple[str, str]]:
        """Problems with ``params`` as ``(key, message with the fix)`` pairs; empty when valid."""
        ...

    def unavailable_for(self, ray_train: bool) -> str | None:
        """Why the fault cannot strike a job of that kind (``ray_train``), with what to use
        instead; None when it can."""
        ...


class FaultNotInstalled(TrainguardError):
    """A known fault kind whose implementation cannot be imported here."""


def fault_class(kind: str) -> FaultClass:
    """The class injecting ``kind``; ``KeyError`` for an unknown kind (the config layer reports
    it with the list of kinds), :class:`FaultNotInstalled` when its module cannot be imported."""
    target = FAULT_CLASSES[kind]
    module_name, _, class_name = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise FaultNotInstalled(
            f"fault {kind!r} is not available in this installation: importing {module_name} "
            f"failed ({type(exc).__name__}: {exc}); upgrade trainguard (or install the missing "
            "package named there), or remove the drill"
        ) from None
    cls = getattr(module, class_name, None)
    if cls is None:
        raise FaultNotInstalled(
            f"fault {kind!r} is not available in this installation: {module_name} has no "
            f"{class_name}; upgrade trainguard or remove the drill"
        )
    return cls  # type: ignore[no-any-return]
