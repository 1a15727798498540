"""The one base of every job-file section model (config/ and the Ray Train job keys in raytrain/).

Every section of the job file (``job:``, ``checks:``, ``target:``, ``gate:`` and everything under
them) is a :class:`ConfigModel`: an unknown key is an error (it is usually a typo that would
otherwise silently weaken a check), values are not coerced between types (``steps: "5"`` is
reported, not read as 5), a number must be finite (``rtol: .inf`` would switch a comparison off
as surely as NaN), and a validated section cannot be changed afterwards.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

__all__ = ["ConfigModel"]


class ConfigModel(BaseModel):
    """Base of the job file's section models: unknown keys rejected, strict types, finite numbers,
    immutable."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, allow_inf_nan=False)
