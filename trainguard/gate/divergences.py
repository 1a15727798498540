"""The table the gate's HTML report shows for each failed check whose runs' step records were
compared: where they first differ, and the first quantity that differs at each step around it
(:attr:`trainguard.checks.divergence.DivergenceEvidence.steps`), both runs' values side by side.

Read from the report's own JSON (every ``first_divergence`` object in a failed check's evidence,
a reshard pair's included), each as its record: one that does not read as one is left out."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from trainguard.checks.divergence import DivergenceEvidence
from trainguard.evidence import EvidenceError

__all__ = ["DivergenceTable", "divergence_tables"]

#: how deep a check's evidence is searched (a reshard pair's evidence is two levels down)
_DEPTH = 4


@dataclass(frozen=True)
class DivergenceTable:
    """One comparison's table: the check (and where in its evidence), the sentence, the rows."""

    check: str
    divergence: DivergenceEvidence


def divergence_tables(checks: Iterable[object]) -> list[DivergenceTable]:
    """The tables of the failed checks in ``checks`` (the report's ``checks``, as JSON objects)
    that hold a first divergence with its per-step rows."""
    out = []
    for check in checks:
        if not isinstance(check, dict) or check.get("status") != "failed":
            continue
        for where, data in _found(check.get("evidence"), str(check.get("name", "")), 0):
            try:
                found = DivergenceEvidence.from_dict(data, f"{where}.first_divergence")
            except EvidenceError:
                continue
            if found.steps:
                out.append(DivergenceTable(where, found))
    return out


def _found(evidence: object, where: str, depth: int) -> Iterator[tuple[str, object]]:
    if not isinstance(evidence, dict) or depth > _DEPTH:
        return
    for key, value in evidence.items():
        if key == "first_divergence":
            yield where, value
        elif isinstance(value, dict):
            yield from _found(value, f"{where} {key}" if key not in ("pairs", "evidence") else where, depth + 1)
