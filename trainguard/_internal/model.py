"""The one base of every job-file section model (config/ and the Ray Train job keys in raytrain/).

Every section of the job file (``job:``, ``checks:``, ``target:``, ``gate:`` and everything under
them) is a :class:`ConfigModel`: an unknown key is an error (it is usually a typo that would
otherwise silently weaken a check), values are not coerced between types (``steps: "5"`` is
reported, not read as 5), a number must be finite (``rtol: .inf`` would switch a comparison off
as surely as NaN), and a validated section cannot be changed afterwards.
"""

from __future__ import annotations

from collections.abc import Container, Iterable
from typing import Any, Protocol

from pydantic import BaseModel, BeforeValidator, ConfigDict
from pydantic_core import PydanticCustomError

__all__ = ["ConfigModel", "one_of"]


class _Names(Container[str], Iterable[str], Protocol):
    pass


class ConfigModel(BaseModel):
    """Base of the job file's section models: unknown keys rejected, strict types, finite numbers,
    immutable."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, allow_inf_nan=False)


def one_of(names: _Names) -> BeforeValidator:
    """A key whose value is one of ``names`` as they are when a file is read (a registry's:
    one registered later is accepted too); anything else is said as pydantic says a value
    outside a ``Literal`` ("Input should be 'ray' or 'slurm'"). None passes (an optional key)."""

    def check(value: Any) -> Any:
        if value is None or (isinstance(value, str) and value in names):
            return value
        *most, last = [repr(name) for name in names]
        raise PydanticCustomError("literal_error", "Input should be {expected}",
                                  {"expected": f"{', '.join(most)} or {last}" if most else last})

    return BeforeValidator(check)
