"""Fault kinds -> the classes that inject them, resolved lazily.

The job file is validated without importing a fault module until a drill names that kind, and a
kind whose module is missing (an older or partial install, a fault still being written) is
reported in words, not as an ImportError traceback. This module imports nothing heavy.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from trainguard.errors import TrainguardError

if TYPE_CHECKING:  # pragma: no cover
    from trainguard.faults.base import Fault

__all__ = [
    "DEFAULT_EXPECT",
    "EXPECTATIONS",
    "FAULT_CLASSES",
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
}

#: what a drill expects of the job, in docs/drills.md
EXPECTATIONS = ("recover", "fail_clean", "continue")

#: the expectation a drill of each kind has when its spec names none
DEFAULT_EXPECT: dict[str, str] = {
    "kill_rank": "recover",
    "hang": "recover",
    "oom": "fail_clean",
    "disk_full": "fail_clean",
    "network": "continue",
}


class FaultNotInstalled(TrainguardError):
    """A known fault kind whose implementation cannot be imported here."""


def fault_class(kind: str) -> type[Fault]:
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
