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

A record leaves the process as its dict (a report file, MLflow, pytest's terminal) and comes back
with :meth:`Evidence.from_dict`, which reads each field by its type (nested records, lists and
dicts of them, ``X | None``, ``X | Unset``): an absent key is a field left :data:`UNSET`, the
keys no field names go to the :data:`MERGED` field (a record without one refuses them), and a
value of the wrong type raises :class:`EvidenceError` naming the key. Reading runs no code of the
data: it builds only the record types the caller names. :class:`Recorded` is the record of
evidence no registered type reads (a check this version does not have): its keys, as they were.
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from enum import Enum
from pathlib import Path
from typing import Any, Literal, Self, TypeVar, Union, get_args, get_origin, get_type_hints

__all__ = ["MERGED", "TRAILING", "UNSET", "Evidence", "EvidenceError", "NoEvidence", "Recorded", "RunDidNotComplete", "StartedAhead",
           "Unset",
           "known", "read_first", "read_record",
           "record_dict"]


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
R = TypeVar("R")


def known(value: T | Unset) -> T | None:
    """``value``, or None for a field left :data:`UNSET`."""
    return None if value is UNSET else value


#: a report's evidence object as JSON gives it
JsonObject = dict[str, Any]

#: the metadata of a ``dict[str, Any]`` field (or a nested record) whose keys are written into
#: the record itself
MERGED = {"merged": True}

#: the metadata of a field written after all the others (in their order)
TRAILING = {"trailing": True}


def _plain(value: Any) -> Any:
    if isinstance(value, Evidence):
        return value.to_dict()
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return record_dict(value)
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

    def to_dict(self) -> JsonObject:
        """The report's ``evidence`` object for this record."""
        return record_dict(self)

    @classmethod
    def from_dict(cls, data: object, where: str = "evidence") -> Self:
        """The record ``data`` (a report's ``evidence`` object) was written from, each field read
        by its type; :class:`EvidenceError` naming the key (``where`` and the field) when a key is
        missing, unknown or of another type."""
        return read_record(cls, data, where)


def record_dict(record: Any) -> JsonObject:
    """The JSON object of a record (an :class:`Evidence`, or a plain dataclass nested in one):
    its fields in order (:data:`TRAILING` ones last), :data:`UNSET` ones left out, a
    :data:`MERGED` one's keys in place, nested records as their objects."""
    out: JsonObject = {}
    for f in sorted(fields(record), key=lambda f: bool(f.metadata.get("trailing"))):
        value = getattr(record, f.name)
        if f.metadata.get("merged"):
            out.update(_plain(value) if value is not UNSET else {})
        elif value is not UNSET:
            out[f.name] = _plain(value)
    return out


def read_record(cls: type[R], data: object, where: str = "evidence") -> R:
    """The record of type ``cls`` (an :class:`Evidence`, or a plain dataclass nested in one) that
    :func:`record_dict` wrote as ``data``, each field read by its type (see
    :meth:`Evidence.from_dict`)."""
    if not isinstance(data, Mapping):
        raise EvidenceError(where, f"expected an object, got {_kind(data)}")
    hints = _hints(cls)
    values: dict[str, Any] = {}
    merged: str | None = None
    for f in fields(cls):  # type: ignore[arg-type]  # a dataclass
        if f.metadata.get("merged"):
            merged = f.name
        elif f.name in data:
            values[f.name] = _read(hints[f.name], data[f.name], f"{where}.{f.name}")
        elif f.default is not UNSET and f.init:
            raise EvidenceError(f"{where}.{f.name}", "missing")
    rest = {k: v for k, v in data.items() if k not in values}
    if merged is not None:
        values[merged] = _read_merged(hints[merged], rest, where)
    elif rest:
        raise EvidenceError(f"{where}.{next(iter(rest))}", f"not a key of {cls.__name__}")
    return cls(**values)


@dataclass
class NoEvidence(Evidence):
    """A result that holds no evidence (a check skipped before it ran anything): ``{}``."""


@dataclass
class RunDidNotComplete(Evidence):
    """A run a check compares against did not complete (an error): where it ran and its stderr's
    tail. A record any check's error may hold."""

    run_dir: str
    stderr_tail: str


@dataclass
class StartedAhead(Evidence):
    """A check's run that started in the background beside the check before it (its time is not
    an idle figure): the launcher's ``started_ahead`` (``run.scheduling``)."""

    #: the check it started beside
    beside: str | None
    note: str


@dataclass
class Recorded(Evidence):
    """Evidence that no registered record reads (a check this trainguard version does not have):
    the keys as the report held them, written back unchanged."""

    keys: JsonObject = field(default_factory=dict, metadata=MERGED)


class EvidenceError(ValueError):
    """A report's evidence that does not read as its record: ``key`` names where (``evidence.
    trajectory.metric``), the message what is wrong."""

    def __init__(self, key: str, problem: str) -> None:
        super().__init__(f"{key}: {problem}")
        self.key, self.problem = key, problem


#: each record class's field types, read once
_HINTS: dict[type, dict[str, Any]] = {}


def _hints(cls: type) -> dict[str, Any]:
    if cls not in _HINTS:
        _HINTS[cls] = get_type_hints(cls)
    return _HINTS[cls]


def _kind(value: object) -> str:
    return "null" if value is None else type(value).__name__


def _read(hint: Any, value: object, where: str) -> Any:
    """``value`` (JSON) read as ``hint``."""
    origin = get_origin(hint)
    if hint is Any or hint is object:
        return value
    if origin is Union or origin is types.UnionType:
        return _read_union(get_args(hint), value, where)
    if origin is Literal:
        if value in get_args(hint):
            return value
        raise EvidenceError(where, f"expected one of {get_args(hint)}, got {value!r}")
    if isinstance(hint, type) and issubclass(hint, Evidence):
        return hint.from_dict(value, where)
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return read_record(hint, value, where)
    if origin in (list, tuple):
        return _read_items(origin, get_args(hint), value, where)
    if origin in (dict, Mapping) or hint is dict:
        if not isinstance(value, dict):
            raise EvidenceError(where, f"expected an object, got {_kind(value)}")
        key_type, item = get_args(hint) or (Any, Any)
        return {_key(key_type, k, where): _read(item, v, f"{where}.{k}") for k, v in value.items()}
    return _read_scalar(hint, value, where)


def _read_merged(hint: Any, rest: dict[str, Any], where: str) -> Any:
    """The keys no field named, read as the :data:`MERGED` field's type: a record (UNSET when
    there are none and it may be) or a dict."""
    arms = get_args(hint) if get_origin(hint) in (Union, types.UnionType) else (hint,)
    records = [a for a in arms if isinstance(a, type) and issubclass(a, Evidence)]
    if not records:
        return _read(hint, rest, where)
    if not rest and len(records) < len(arms):
        return UNSET
    return read_first(records, rest, where)


def read_first(kinds: Sequence[type[Evidence]], data: object, where: str = "evidence") -> Evidence:
    """``data`` read as the first of ``kinds`` that reads it; the first kind's
    :class:`EvidenceError` when none does."""
    first: EvidenceError | None = None
    for kind in kinds:
        try:
            return kind.from_dict(data, where)
        except EvidenceError as exc:
            first = first or exc
    raise first or EvidenceError(where, "no record type to read it as")


def _read_union(arms: tuple[Any, ...], value: object, where: str) -> Any:
    if value is None and type(None) in arms:
        return None
    problems = []
    for arm in arms:
        if arm is type(None) or get_origin(arm) is Literal:  # null, or UNSET: never in JSON
            continue
        try:
            return _read(arm, value, where)
        except EvidenceError as exc:
            problems.append(exc.problem)
    raise EvidenceError(where, "; ".join(problems) or f"unexpected {_kind(value)}")


def _read_items(origin: Any, args: tuple[Any, ...], value: object, where: str) -> Any:
    if not isinstance(value, list):
        raise EvidenceError(where, f"expected a list, got {_kind(value)}")
    if origin is tuple and args and args[-1] is not Ellipsis:  # a fixed tuple: one type an item
        if len(args) != len(value):
            raise EvidenceError(where, f"expected {len(args)} items, got {len(value)}")
        return tuple(_read(a, v, f"{where}[{i}]") for i, (a, v) in enumerate(zip(args, value, strict=True)))
    read = [_read(args[0] if args else Any, v, f"{where}[{i}]") for i, v in enumerate(value)]
    return tuple(read) if origin is tuple else read


def _read_scalar(hint: Any, value: object, where: str) -> Any:
    if hint is type(None):
        if value is None:
            return None
        raise EvidenceError(where, f"expected null, got {_kind(value)}")
    if hint is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return value  # an int stays one: it is written back as it was
        raise EvidenceError(where, f"expected a number, got {_kind(value)}")
    if hint in (int, str, bool):
        if isinstance(value, hint) and (hint is bool or not isinstance(value, bool)):
            return value
        raise EvidenceError(where, f"expected {hint.__name__}, got {_kind(value)}")
    if hint is Path:
        if isinstance(value, str):
            return Path(value)
        raise EvidenceError(where, f"expected a path, got {_kind(value)}")
    if isinstance(hint, type) and issubclass(hint, Enum):
        try:
            return hint(value)
        except ValueError:
            raise EvidenceError(where, f"not a {hint.__name__}: {value!r}") from None
    raise EvidenceError(where, f"a {hint!r} field is not read from a report")


def _key(hint: Any, key: str, where: str) -> Any:
    if hint is int:
        try:
            return int(key)
        except ValueError:
            raise EvidenceError(f"{where}.{key}", "expected an integer key") from None
    return key
