"""The report contract: what every check produces, written atomically as JSON.

``{"trainguard_version", "job", "status": "passed"|"failed"|"skipped"|"interrupted", "checks":
[{"name", "status", "summary", "evidence", "duration_s"}], ...}`` -- CI and every later check
read this shape. In the process a result's ``evidence`` is its check's record
(:class:`~trainguard.evidence.Evidence`); it becomes the JSON object here, in :meth:`Report.to_dict`,
and the record again in :func:`load_report`.
"""

from __future__ import annotations

import json
import math
import os
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from enum import StrEnum
from pathlib import Path
from typing import Any, Generic, Literal

from typing_extensions import TypeVar

from trainguard._internal.atomic import atomic_write_text, write_or_fallback
from trainguard._internal.readers import OWN_FILE_LIMITS, Unreadable, read_json
from trainguard._version import __version__
from trainguard.errors import CheckFailed, ConfigError
from trainguard.evidence import (
    UNSET,
    Evidence,
    EvidenceError,
    JsonObject,
    NoEvidence,
    Recorded,
    Unset,
    read_first,
)

__all__ = [
    "REPORT_SCHEMA_VERSION",
    "STATUSES",
    "CappedLogs",
    "CheckId",
    "CheckResult",
    "CheckStatus",
    "FullDisk",
    "RecordTypes",
    "Report",
    "ReportStatus",
    "RunNotes",
    "SkipReason",
    "load_report",
    "read_evidence",
    "result_from_dict",
]

REPORT_SCHEMA_VERSION = 1

#: the one status vocabulary of checks, drills and reports (the values written to report JSON)
CheckStatus = Literal["passed", "failed", "error", "skipped"]
STATUSES: tuple[CheckStatus, ...] = ("passed", "failed", "error", "skipped")
#: a whole report's status: ``failed`` (a check failed or errored), ``interrupted`` (a signal
#: ended the run before every check ran), ``skipped`` (every check was skipped: nothing was
#: tested) or ``passed``
ReportStatus = Literal["passed", "failed", "skipped", "interrupted"]


class SkipReason(StrEnum):
    """Why a check was skipped, as the gate decides on it (``gate.on_missing``): never read from
    the summary's words. Written to a skipped check's report entry as ``skip_reason``."""

    #: root-level machine features: cgroups, a size-limited tmpfs, FUSE, mounts
    NEEDS_ROOT = "needs_root"
    #: an NVIDIA GPU
    NEEDS_GPU = "needs_gpu"
    #: Ray (``ray[train]``, a cluster)
    NEEDS_RAY = "needs_ray"
    #: this machine cannot host it for another reason (a service that did not start, a missing
    #: package): no policy allows it
    UNAVAILABLE = "unavailable"
    #: the check does not apply to this kind of job (``trainguard validate`` refuses it first)
    JOB_KIND = "job_kind"
    #: configured, but this trainguard version has no such check
    NOT_IN_THIS_VERSION = "not_in_this_version"

    @property
    def capability(self) -> str | None:
        """The ``gate.on_missing`` key this reason falls under (None: no policy allows it)."""
        return self.value.removeprefix("needs_") if self.value.startswith("needs_") else None


@dataclass(frozen=True)
class CheckId:
    """Which check a result, a pytest item or ``--only`` names: a plain check (``smoke``,
    ``canary``, ``profile``, ...) or one drill of ``checks.drills``. Its text form, ``str(id)``,
    is the name written to reports: the check's name, or ``drill:<drill name>``.

    >>> CheckId.parse("drill:kill_rank1")
    CheckId(check='drill', drill='kill_rank1')
    >>> str(CheckId.of_drill("kill_rank1")), CheckId.parse("smoke").is_drill
    ('drill:kill_rank1', False)
    """

    #: the check's name; ``"drill"`` for a drill
    check: str
    #: the drill's name (only for a drill)
    drill: str | None = None

    DRILL_PREFIX = "drill:"

    @classmethod
    def parse(cls, text: str | CheckId) -> CheckId:
        """The id a report name (or ``--only`` value) stands for."""
        if isinstance(text, CheckId):
            return text
        if text.startswith(cls.DRILL_PREFIX):
            return cls("drill", text[len(cls.DRILL_PREFIX):])
        return cls(text)

    @classmethod
    def of_drill(cls, name: str) -> CheckId:
        """The id of the drill called ``name``."""
        return cls("drill", name)

    @property
    def is_drill(self) -> bool:
        return self.drill is not None

    def __str__(self) -> str:
        return f"{self.DRILL_PREFIX}{self.drill}" if self.drill is not None else self.check


@dataclass
class CappedLogs(Evidence):
    """The logs of one run that the log cap cut (``trainguard_max_log_bytes``)."""

    run_dir: str
    #: each capped log: its path, bytes printed, bytes dropped
    logs: list[dict[str, object]]


@dataclass
class FullDisk(Evidence):
    """A run directory on a full or failing disk (``launch.ranklog.log_evidence``)."""

    path: str
    error: str
    note: str
    logs_not_written: list[dict[str, object]]


@dataclass
class RunNotes(Evidence):
    """What the session noted of a check's runs after it ran (``session.run_check``), whatever
    the check's record: they are keys of the report's ``evidence`` object, after the record's."""

    logs_truncated: list[CappedLogs] | Unset = UNSET
    #: the runs whose directory was on a full disk (a launcher's own entry is one, not a list)
    run_dir_disk: list[FullDisk] | FullDisk | Unset = UNSET


#: the evidence record a result holds (covariant: a ``CheckResult[SmokeEvidence]`` is a
#: ``CheckResult``, whose evidence is some :class:`~trainguard.evidence.Evidence`)
E = TypeVar("E", bound=Evidence, default=Evidence, covariant=True)


@dataclass
class CheckResult(Generic[E]):
    """Outcome of one check: a verdict, one line for people, and the evidence behind it (its
    check's record: read its attributes; the report's JSON object is ``evidence.to_dict()``)."""

    name: str
    status: CheckStatus
    summary: str
    evidence: E = field(default_factory=NoEvidence)  # type: ignore[assignment]  # none: no keys
    duration_s: float = 0.0
    reproduce: str | None = None
    #: why it was skipped (only on a skipped result; the report JSON has the key only then)
    skip_reason: SkipReason | None = None
    #: what the session noted of the check's runs (capped logs, a full disk), written into the
    #: report's ``evidence`` object after the record's keys
    run_notes: RunNotes = field(default_factory=lambda: RunNotes())

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"status must be one of {STATUSES}, got {self.status!r}")
        if self.skip_reason is not None:
            self.skip_reason = SkipReason(self.skip_reason)  # a report read back holds the text

    @property
    def ok(self) -> bool:
        """True when the check passed or was skipped (neither failed nor errored)."""
        return self.status in ("passed", "skipped")

    @property
    def check_id(self) -> CheckId:
        """What :attr:`name` names: a plain check or a drill."""
        return CheckId.parse(self.name)

    def raise_for_status(self) -> None:
        """Raise :class:`~trainguard.errors.CheckFailed` unless the check passed or was skipped."""
        if not self.ok:
            raise CheckFailed(self.render(), results=(self,))

    def to_dict(self) -> JsonObject:
        """The report's object for this result, its evidence record as its dict."""
        out: JsonObject = {"name": self.name, "status": self.status, "summary": self.summary,
                           "evidence": self.evidence.to_dict() | self.run_notes.to_dict(),
                           "duration_s": self.duration_s,
                           "reproduce": self.reproduce}
        if self.skip_reason is not None:  # the key is a skipped check's alone
            out["skip_reason"] = str(self.skip_reason)
        return out

    def render(self) -> str:
        """The verdict for people: ``name status: summary`` and how to reproduce it."""
        text = f"{self.name} {self.status}: {self.summary}"
        return text + (f"\nreproduce: {self.reproduce}" if self.reproduce else "")


@dataclass
class Report:
    """All check results of one ``trainguard check`` run or pytest session."""

    job: str
    checks: list[CheckResult] = field(default_factory=list)
    job_file: str | None = None
    created_at: float = field(default_factory=time.time)
    host: str = field(default_factory=socket.gethostname)
    trainguard_version: str = __version__
    schema_version: int = REPORT_SCHEMA_VERSION
    #: where the MLflow runs of this report went (None: tracking was off)
    tracking_uri: str | None = None
    path: str | None = field(default=None, compare=False)  # where write() last put it
    #: why write() could not put the report where it was asked (then ``path`` is the fallback
    #: file, or None when nothing took it); None when it was written as asked
    write_problem: str | None = field(default=None, compare=False)
    #: True when a signal (Ctrl-C, SIGTERM) ended the run before every check ran: the report
    #: holds the checks that had finished
    interrupted: bool = False

    @property
    def status(self) -> ReportStatus:
        """``failed`` when a check failed or errored; else ``interrupted`` when a signal ended
        the run before every check ran (never ``passed``: a check was cut short); else
        ``skipped`` when every check was skipped (nothing was tested); else ``passed``."""
        if not all(c.ok for c in self.checks):
            return "failed"
        if self.interrupted:
            return "interrupted"
        if self.checks and all(c.status == "skipped" for c in self.checks):
            return "skipped"
        return "passed"

    @property
    def ok(self) -> bool:
        """No check failed or errored and the run was not interrupted (``passed`` or
        ``skipped``): what a zero exit of ``trainguard check`` means."""
        return self.status in ("passed", "skipped")

    def raise_for_failures(self) -> None:
        """Raise :class:`~trainguard.errors.CheckFailed` naming every check that failed or
        errored (the library form of a non-zero ``trainguard check`` exit)."""
        bad = [c for c in self.checks if not c.ok]
        if bad:
            raise CheckFailed(
                f"{len(bad)} of {len(self.checks)} check(s) of {self.job} did not pass:\n"
                + "\n".join(c.render() for c in bad),
                results=tuple(bad),
            )

    def add(self, result: CheckResult) -> CheckResult:
        self.checks.append(result)
        return result

    def to_dict(self) -> JsonObject:
        """The report as JSON data, each check's evidence record as its dict."""
        data: JsonObject = {"job": self.job, "checks": [c.to_dict() for c in self.checks]}
        for name in ("job_file", "created_at", "host", "trainguard_version", "schema_version",
                     "tracking_uri", "interrupted"):
            data[name] = getattr(self, name)
        data["status"] = self.status
        return data

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=False, default=_json_default) + "\n"

    def write(self, path: str | os.PathLike[str]) -> Path:
        """Write the report atomically (temp file, fsync, rename); an OSError is raised."""
        written = atomic_write_text(path, self.to_json())
        self.path, self.write_problem = str(written), None
        return written

    def save(self, path: str | os.PathLike[str]) -> Path | None:
        """:meth:`write` that never loses the report: a failing write (read-only, full disk, a
        directory, ...) is said on stderr (the path and the errno in words) and the report goes
        to a fallback file under the temp directory
        (:func:`~trainguard._internal.atomic.write_or_fallback`). :attr:`path` and
        :attr:`write_problem` say where it is and why. None when no place took it: print
        :meth:`to_json` then."""
        outcome = write_or_fallback(path, self.to_json(), what="the report")
        self.path = None if outcome.path is None else str(outcome.path)
        self.write_problem = outcome.problem
        return outcome.path


def _json_default(value: Any) -> Any:
    if isinstance(value, Path):
        return str(value)
    if hasattr(value, "item"):  # numpy / torch scalars
        return value.item()
    if isinstance(value, (set, tuple)):
        return list(value)
    return repr(value)


#: the keys of a report and of each of its checks, with their types (a float may be an int)
_REPORT_KEYS: dict[str, tuple[type, bool]] = {
    "job": (str, False), "job_file": (str, True), "created_at": (float, False), "host": (str, False),
    "trainguard_version": (str, False), "schema_version": (int, False), "tracking_uri": (str, True),
    "interrupted": (bool, False),
}
_CHECK_KEYS: dict[str, tuple[type, bool]] = {
    "name": (str, False), "status": (str, False), "summary": (str, False), "evidence": (dict, False),
    "duration_s": (float, False), "reproduce": (str, True), "skip_reason": (str, True),
}


#: ``(check name) -> the record types its results hold``, the first that reads the evidence
#: object wins (``config.records.record_types``: the registry's); none: :class:`Recorded`
RecordTypes = Callable[[str], Sequence[type[Evidence]]]


def load_report(path: str | os.PathLike[str], records: RecordTypes | None = None) -> Report:
    """Read a report written by :meth:`Report.write`, as data: a regular file within
    :data:`~trainguard._internal.readers.OWN_FILE_LIMITS`, each key of the right type (numbers
    finite); a :class:`~trainguard.errors.ConfigError` naming the file and the key otherwise.
    Each check's evidence becomes the first of ``records(name)`` that reads it (a
    :class:`~trainguard.evidence.Recorded` without ``records``, or for a check it names no type
    of); ``config.records.load_report`` passes the registry's."""
    where = str(path)
    again = "not a report trainguard wrote, or it was edited; run `trainguard check` again to write one"
    try:
        data = read_json(Path(path), OWN_FILE_LIMITS)
    except Unreadable as exc:
        raise ConfigError(f"cannot read the report: {exc}; {again}", path=where) from None
    if not isinstance(data, dict) or not isinstance(data.get("checks", []), list):
        raise ConfigError(f"not a report: no JSON object with a list of `checks`; {again}", path=where)
    data = {k: v for k, v in data.items() if k != "status"}
    checks = []
    for i, entry in enumerate(data.pop("checks", [])):
        if not isinstance(entry, dict):
            raise ConfigError(f"a {type(entry).__name__}, not a check object; {again}", path=where, key=f"checks[{i}]")
        _check_keys(entry, _CHECK_KEYS, where, f"checks[{i}].", again)
        _require(entry, ("name", "status", "summary"), where, f"checks[{i}]", again)
        try:
            checks.append(result_from_dict(entry, records, f"checks[{i}].evidence"))
        except EvidenceError as exc:
            raise ConfigError(f"{exc.problem}; {again}", path=where, key=exc.key) from None
        except ValueError as exc:
            raise ConfigError(f"{exc}; {again}", path=where, key=f"checks[{i}]") from None
    _check_keys(data, _REPORT_KEYS, where, "", again)
    _require(data, ("job",), where, None, again)
    return Report(checks=checks, **data)


def result_from_dict(entry: JsonObject, records: RecordTypes | None = None,
                     where: str = "evidence") -> CheckResult:
    """The :class:`CheckResult` a report's check object (:meth:`Report.to_dict`) was written
    from, its evidence read as the first of ``records(name)`` that reads it (see
    :func:`load_report`); :class:`~trainguard.evidence.EvidenceError` naming the key when none
    does."""
    data = dict(entry)
    evidence = data.pop("evidence", {})
    if not isinstance(evidence, dict):
        raise EvidenceError(where, f"expected an object, got {type(evidence).__name__}")
    evidence = dict(evidence)
    notes = {k: evidence.pop(k) for k in [f.name for f in fields(RunNotes)] if k in evidence}
    kinds = list(records(str(data.get("name", "")))) if records is not None else []
    return CheckResult(**data, evidence=read_evidence(evidence, kinds, where),
                       run_notes=RunNotes.from_dict(notes, where))


def read_evidence(data: object, kinds: Sequence[type[Evidence]], where: str = "evidence") -> Evidence:
    """``data`` read as the first of ``kinds`` that reads it (``{}``: a :class:`NoEvidence`; a
    :class:`Recorded` with no kinds); the first kind's :class:`~trainguard.evidence.EvidenceError`
    when none does."""
    return read_first([*kinds, NoEvidence] if kinds else [NoEvidence, Recorded], data, where)


def _require(data: dict[str, Any], keys: tuple[str, ...], where: str, key: str | None, again: str) -> None:
    missing = [k for k in keys if k not in data]
    if missing:
        raise ConfigError(f"missing {', '.join(missing)}; {again}", path=where, key=key)


def _check_keys(data: dict[str, Any], keys: dict[str, tuple[type, bool]], where: str,
                prefix: str, again: str) -> None:
    """Every key of ``data`` one of ``keys``, of its type (a float finite), None only where
    nullable."""
    for key, value in data.items():
        if key not in keys:
            raise ConfigError(f"unknown key; {again}", path=where, key=prefix + key)
        kind, nullable = keys[key]
        if value is None and nullable:
            continue
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            try:
                value = float(value)
            except OverflowError:
                value = math.inf
        ok = isinstance(value, kind) and (kind is bool or not isinstance(value, bool))
        if not ok or (kind is float and not math.isfinite(value)):
            raise ConfigError(f"expected a {'finite number' if kind is float else kind.__name__}"
                              f"{' or null' if nullable else ''}, got {_cut(repr(value))}; {again}",
                              path=where, key=prefix + key)


def _cut(text: str, most: int = 80) -> str:
    return text if len(text) <= most else text[:most] + "..."
