"""Fault kinds -> the classes that inject them, resolved lazily.

The job file is validated without importing a fault module until a drill names that kind, and a
kind whose module is missing (an older or partial install, a fault still being written) is
reported in words, not as an ImportError traceback. This module imports nothing heavy.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any, Protocol

from trainguard.errors import TrainguardError

__all__ = [
    "DEFAULT_EXPECT",
    "EXPECTATIONS",
    "EXPECTATION_FAULTS",
    "FAULT_CLASSES",
    "FAULT_EXPECTATIONS",
    "KIND_EXPECTATIONS",
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

#: what a drill expects of the job, in docs/drills.md
EXPECTATIONS = ("recover", "fail_clean", "continue", "save_and_exit", "handle_nonfinite")

#: expectations only some faults can be judged by (others: every fault)
EXPECTATION_FAULTS: dict[str, tuple[str, ...]] = {"save_and_exit": ("preempt",), "handle_nonfinite": ("nan",)}

#: faults judged by some expectations only (a soak is judged as one long recover)
FAULT_EXPECTATIONS: dict[str, tuple[str, ...]] = {"soak": ("recover",)}

#: a fault's own kinds (its ``params.kind``) judged by some expectations only; the first is the
#: default when the spec names none
KIND_EXPECTATIONS: dict[tuple[str, str], tuple[str, ...]] = {
    ("storage", "slow"): ("continue",),
    ("storage", "corrupt"): ("fail_clean", "recover"),
    ("storage", "eio_read"): ("fail_clean", "recover"),
    ("storage", "eio_write"): ("fail_clean", "recover"),
    ("storage", "fsync"): ("fail_clean", "recover"),
}

#: the expectation a drill of each kind has when its spec names none
DEFAULT_EXPECT: dict[str, str] = {
    "kill_rank": "recover",
    "hang": "recover",
    "oom": "fail_clean",
    "disk_full": "fail_clean",
    "network": "continue",
    "preempt": "save_and_exit",
    "nan": "handle_nonfinite",
    "storage": "fail_clean",
    "kill_during_save": "recover",
    "kill_worker": "fail_clean",
    "slow_rank": "continue",
    "soak": "recover",
    "node_loss": "recover",
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
