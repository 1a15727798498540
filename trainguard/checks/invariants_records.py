"""The findings of the invariants check, as data (:mod:`trainguard.checks.invariants`): each
names the invariant, where it was first seen, the ranks, the tensor or loader, the observation and
the fix; the coverage says what each invariant compared, so nothing compared is never a pass."""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum

__all__ = ["NOTHING_ALLOWED", "Allowed", "Coverage", "Finding", "Invariant", "Invariants", "matches"]


class Invariant(StrEnum):
    """What a correct training step keeps (docs/invariants.md)."""

    REPLICAS = "replicas"
    TRAINS = "trains"
    SCALER = "scaler"
    DATA = "data"
    ZERO_GRADS = "zero_grads"
    MODES = "modes"


@dataclass(frozen=True)
class Allowed:
    """Intended exceptions, each a list of names or globs (``checks.invariants.allow``)."""

    #: tensors deliberately different per rank (a per-rank adapter, a rank-seeded module):
    #: their replicas are not compared
    per_rank: tuple[str, ...] = ()
    #: datasets (as the sample records name them: ``TensorDataset(384)``, globs) every rank reads
    #: whole on purpose: their samples may be drawn by several ranks
    shared_samples: tuple[str, ...] = ()
    #: datasets whose loader replays one order every epoch on purpose
    same_order: tuple[str, ...] = ()
    #: parameters an optimizer holds that are frozen on purpose: no gradient is no finding
    frozen: tuple[str, ...] = ()
    #: the job accumulates gradients across optimizer steps on purpose: carried ones are no finding
    accumulates: bool = False
    #: modules (dropout, batch norm; names or globs) kept in eval mode while training on purpose
    eval_modules: tuple[str, ...] = ()
    #: modules run in training mode without gradients on purpose (MC dropout, an EMA teacher)
    train_modules: tuple[str, ...] = ()


#: no exception declared
NOTHING_ALLOWED = Allowed()


def matches(name: str, patterns: Iterable[str]) -> bool:
    """Whether ``name`` is one of ``patterns`` (exact names or globs)."""
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)


@dataclass(frozen=True)
class Finding:
    """One invariant a run broke, where it was first seen."""

    invariant: Invariant
    #: the optimizer step (from 1, per optimizer) it was seen at; None for a data finding
    step: int | None
    #: the ranks it names: those in the minority, or every rank involved when none is
    ranks: tuple[int, ...]
    #: the parameter (its qualified name, wrapper prefixes removed), or the loader
    name: str
    observation: str
    #: what to change, and the setting that declares an intended exception
    fix: str
    #: the epoch (the loader's pass, from 0) of a data finding
    epoch: int | None = None
    #: the optimizer (by the order of its first step) of a step finding
    optimizer: int = 0

    def sentence(self) -> str:
        where = f"at step {self.step}" if self.step is not None else f"in epoch {self.epoch}"
        return f"{self.invariant.value}: {self.name} {where}: {self.observation}"


@dataclass(frozen=True)
class Coverage:
    """What one invariant compared (``compared`` > 0) or why it did not apply (``reason``)."""

    invariant: Invariant
    #: comparisons made (a tensor at a step across the ranks, a loader's epoch)
    compared: int
    what: str
    #: why it did not apply, or what it left out
    reason: str = ""


@dataclass(frozen=True)
class Invariants:
    """The result of :func:`check_invariants` on one run."""

    findings: tuple[Finding, ...]
    coverage: tuple[Coverage, ...]
    #: what the records could not say (ranks cut at a cap, malformed lines)
    notes: tuple[str, ...] = ()

    @property
    def compared(self) -> int:
        return sum(c.compared for c in self.coverage)
