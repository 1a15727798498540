"""Evidence as data: what one kind of check found, as a typed record.

A check builds its kind's :class:`Evidence` (a dataclass) and hands ``to_dict()`` to its
:class:`~trainguard.report.CheckResult`: that dict is the report's ``evidence`` object, key for
key, so report readers, the gate and MLflow read what they always read, while the code that
writes it names every key once, with its type.

A key the report holds only sometimes (a stderr tail only after a failure, a resume stage only
when there was one) is a field left at :data:`UNSET` until it is set: ``to_dict()`` leaves it
out. ``None`` is a value (JSON ``null``) like any other. A field with :data:`MERGED` metadata
(``field(default_factory=dict, metadata=MERGED)``) holds keys another layer chose (the launcher's findings on a run that hit a limit): they are written
into the record itself, where that field stands, a later one of the same name winning.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from enum import Enum
from typing import Any, Literal

__all__ = ["MERGED", "UNSET", "Evidence", "Unset"]


class _Unset(Enum):
    UNSET = "unset"

    def __repr__(self) -> str:
        return "UNSET"


#: a field the report does not hold (yet): left out of :meth:`Evidence.to_dict`
UNSET = _Unset.UNSET
Unset = Literal[_Unset.UNSET]


#: the metadata of a ``dict[str, Any]`` field whose keys are written into the record itself
MERGED = {"merged": True}


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
    """Base of every kind's evidence. Fields are written in their order; :data:`UNSET` ones are
    left out; a nested :class:`Evidence` (or a list or dict of them) is written as its dict."""

    def to_dict(self) -> dict[str, Any]:
        """The report's ``evidence`` object for this record."""
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.metadata.get("merged"):
                out.update(_plain(value))
            elif value is not UNSET:
                out[f.name] = _plain(value)
        return out
