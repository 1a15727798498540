"""A report read back with each check's evidence as its registered record.

:func:`trainguard.report.load_report` reads a report as data; which record a check's evidence is
lives in the check registry (:attr:`~trainguard.config.registry.Check.evidence`), a layer above
the report, so the registry's lookup is passed in here.
"""

from __future__ import annotations

import os

from trainguard.config.registry import check_for
from trainguard.evidence import Evidence, JsonObject
from trainguard.report import CheckResult, Report, result_from_dict
from trainguard.report import load_report as load_report_data

__all__ = ["load_report", "record_types", "result_of"]


def record_types(name: str) -> tuple[type[Evidence], ...]:
    """The record types of the check a report names ``name`` (``drill:<name>``: the drills'); none
    for a check this version does not register."""
    check = check_for(name)
    return check.evidence if check is not None else ()


def load_report(path: str | os.PathLike[str]) -> Report:
    """:func:`trainguard.report.load_report`, each check's evidence its registered record."""
    return load_report_data(path, record_types)


def result_of(entry: JsonObject) -> CheckResult:
    """The result a check object of a report (or of a pytest worker's report) was written from,
    its evidence its registered record."""
    return result_from_dict(entry, record_types)
