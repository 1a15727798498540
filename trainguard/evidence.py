"""Evidence as data: what one kind of check found, as a typed record.

A check builds its kind's :class:`Evidence` (a dataclass) and hands ``to_dict()`` to its
:class:`~trainguard.report.CheckResult`: that dict is the report's ``evidence`` object, key for
key, so report readers, the gate and MLflow read what they always read, while the code that
writes it names every key once, with its type.

A key the report holds only sometimes (a stderr tail only after a failure, a resume stage only
when there was one) is a field left at :data:`UNSET` until it is set: ``to_dict()`` leaves it
out. ``None`` is a value (JSON ``null``) like any other. A field with :data:`MERGED` metadata
(``field(default_factory=dict, metadata=MERGED)``) holds keys another layer chose (the
launcher's findings on a run that hit a limit): they are written into the record itself, where
that field stands, a later one of the same name winning. A field with :data:`TRAILING` metadata
is written after every other field, subclasses' included: a base record's conclusion (a drill's
``likely_causes``) stays last whatever record extends it.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from enum import Enum
from typing import Any, Literal, TypeVar

__all__ = ["MERGED", "TRAILING", "UNSET", "Evidence", "Unset", "known"]


class _Unset(Enum):
    UNSET = "unset"

    def __repr__(self) -> str:
        return "UNSET"

    def __bool__(self) -> bool:  # a field not set is no finding
        return False


#: a field the report does not hold (yet): left out of :meth:`Evidence.to_dict`
UNSET = _Unset.UNSET
Unset = Literal[_Unset.UNSET]


T = TypeVar("T")


def known(value: T | Unset) -> T | None:
    """``value``, or None for a field left :data:`UNSET`."""
    return None if value is UNSET else value


#: the metadata of a ``dict[str, Any]`` field whose keys are written into the record itself
MERGED = {"merged": True}

#: the metadata of a field written after all the others (in their order)
TRAILING = {"trailing": True}


def _plain(value: Any) -> Any:
    if isinstance(value, Evidence):
        return value.to_dict()
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


@dataclass
class Evidence:
    """Base of every kind's evidence. Fields are written in their order (:data:`TRAILING` ones
    last); :data:`UNSET` ones are left out; a nested :class:`Evidence` (or a list or dict of
    them) is written as its dict."""

    def to_dict(self) -> dict[str, Any]:
        """The report's ``evidence`` object for this record."""
        out: dict[str, Any] = {}
        for f in sorted(fields(self), key=lambda f: bool(f.metadata.get("trailing"))):
            value = getattr(self, f.name)
            if f.metadata.get("merged"):
                out.update(_plain(value))
            elif value is not UNSET:
                out[f.name] = _plain(value)
        return out
