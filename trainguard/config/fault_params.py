"""A fault's parameters (a drill's ``params:``), read by type.

The job file gives a drill's ``params`` as YAML made them; each fault's
:meth:`~trainguard.faults.base.Fault.validate` says what is wrong with them in its own words (the
job file is refused with those). A fault reads them through :class:`FaultParams`: ``number``,
``text``, ``integer``, ``flag`` (and their ``optional_`` forms, where null is a value) return the
type they name or raise :class:`FaultParamError` naming the key, what it holds and what it should;
:meth:`FaultParams.raw` is for the values that are free-form on purpose (a toxic's attributes, a
soak's list of kinds) and for the validators, which read before they judge.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from trainguard.errors import TrainguardError

__all__ = ["FaultParamError", "FaultParams"]


class FaultParamError(TrainguardError):
    """A fault parameter that is not of the type the fault reads it as: the message names the
    key (``params.<key>``), what it holds and what it should hold."""

    def __init__(self, key: str, expected: str, value: object) -> None:
        shown = repr(value)
        shown = shown if len(shown) <= 60 else f"{shown[:60]}... ({len(shown)} characters)"
        super().__init__(f"fault parameter `params.{key}`: expected {expected}, got {shown}; "
                         "fix the drill's `params` (`trainguard validate` lists each fault's rules)")
        self.key = key


class FaultParams:
    """A fault's parameters: the drill's own, over the fault's defaults (:meth:`over`). Read by
    type; a key neither gives raises ``KeyError`` naming it (a fault reads only what its
    defaults declare)."""

    __slots__ = ("_values",)

    def __init__(self, given: Mapping[str, Any] | None = None) -> None:
        self._values = dict(given or {})

    def over(self, defaults: FaultParams) -> FaultParams:
        """These parameters, with ``defaults`` for the keys they do not give."""
        return FaultParams({**defaults._values, **self._values})

    def __contains__(self, key: object) -> bool:
        return key in self._values

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, FaultParams) and other._values == self._values

    __hash__ = None  # type: ignore[assignment]  # mutable content, like the dict it wraps

    def __repr__(self) -> str:
        return f"FaultParams({self._values!r})"

    def raw(self, key: str, default: object = None) -> object:
        """The value of ``key`` as YAML gave it (``default`` when absent): for free-form values
        and for validators, which say what is wrong with it in their own words."""
        return self._values.get(key, default)

    def _value(self, key: str) -> object:
        if key not in self._values:
            raise KeyError(key)
        return self._values[key]

    def number(self, key: str) -> float:
        """``key``'s number (an int stays one: it is written back as it was)."""
        value = self._value(key)
        if not isinstance(value, int | float) or isinstance(value, bool):
            raise FaultParamError(key, "a number", value)
        return value

    def optional_number(self, key: str) -> float | None:
        """``key``'s number, or None where it is null."""
        return None if self._value(key) is None else self.number(key)

    def integer(self, key: str) -> int:
        value = self._value(key)
        if not isinstance(value, int) or isinstance(value, bool):
            raise FaultParamError(key, "an integer", value)
        return value

    def text(self, key: str) -> str:
        value = self._value(key)
        if not isinstance(value, str):
            raise FaultParamError(key, "a string", value)
        return value

    def optional_text(self, key: str) -> str | None:
        """``key``'s string, or None where it is null."""
        return None if self._value(key) is None else self.text(key)

    def flag(self, key: str) -> bool:
        value = self._value(key)
        if not isinstance(value, bool):
            raise FaultParamError(key, "true or false", value)
        return value

    def optional_integer(self, key: str) -> int | None:
        """``key``'s integer, or None where it is null."""
        return None if self._value(key) is None else self.integer(key)

    def texts(self, key: str) -> list[str]:
        """``key``'s list of strings."""
        value = self._value(key)
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise FaultParamError(key, "a list of strings", value)
        return list(value)

    def optional_integers(self, key: str) -> list[int] | None:
        """``key``'s list of integers, or None where it is null."""
        value = self._value(key)
        if value is None:
            return None
        if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            raise FaultParamError(key, "a list of integers", value)
        return list(value)

    def to_dict(self) -> dict[str, Any]:
        """The parameters as the job file holds them (JSON, for a report or a spec made from them)."""
        return dict(self._values)
