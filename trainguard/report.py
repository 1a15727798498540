"""The report contract: what every check produces, written atomically as JSON.

``{"trainguard_version", "job", "status": "passed"|"failed"|"skipped"|"interrupted", "checks":
[{"name", "status", "summary", "evidence", "duration_s"}], ...}`` -- CI and every later check
read this shape.
"""

from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any, Literal

from trainguard._internal.atomic import atomic_write_text, write_or_fallback
from trainguard._internal.readers import active_limits, read_json
from trainguard._version import __version__
from trainguard.errors import CheckFailed, ConfigError

__all__ = [
    "REPORT_SCHEMA_VERSION",
    "STATUSES",
    "CheckId",
    "CheckResult",
    "CheckStatus",
    "Report",
    "ReportStatus",
    "SkipReason",
    "load_report",
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
class CheckResult:
    """Outcome of one check: a verdict, one line for people, and the evidence behind it."""

    name: str
    status: CheckStatus
    summary: str
    evidence: dict[str, Any] = field(default_factory=dict)
    duration_s: float = 0.0
    reproduce: str | None = None
    #: why it was skipped (only on a skipped result; the report JSON has the key only then)
    skip_reason: SkipReason | None = None

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

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data.pop("path")
        data.pop("write_problem")
        data["status"] = self.status
        for check in data["checks"]:
            if check["skip_reason"] is None:  # the key is a skipped check's alone
                del check["skip_reason"]
            else:
                check["skip_reason"] = str(check["skip_reason"])
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


#: the keys of a report and of each of its checks, and the types each may hold
_NONE = type(None)
_REPORT_KEYS: dict[str, tuple[type, ...]] = {
    "job": (str,), "job_file": (str, _NONE), "created_at": (int, float), "host": (str,),
    "trainguard_version": (str,), "schema_version": (int,), "tracking_uri": (str, _NONE),
    "interrupted": (bool,), "status": (str,), "checks": (list,),
}
_CHECK_KEYS: dict[str, tuple[type, ...]] = {
    "name": (str,), "status": (str,), "summary": (str,), "evidence": (dict,), "duration_s": (int, float),
    "reproduce": (str, _NONE), "skip_reason": (str, _NONE),
}


def _checked(data: Any, keys: dict[str, tuple[type, ...]], where: str) -> dict[str, Any]:
    """``data`` when it is an object of ``keys`` each of its type (a number finite, never a huge
    integer); ValueError naming the key otherwise."""
    if not isinstance(data, dict):
        raise ValueError(f"{where or 'the top level'} must be an object")
    for key, value in data.items():
        types = keys.get(key)
        if types is None:
            raise ValueError(f"{where}{str(key)[:80]}: not a key of a trainguard report")
        if not isinstance(value, types) or (isinstance(value, bool) and bool not in types) or (
                isinstance(value, (int, float)) and not isinstance(value, bool)
                and not -1e300 <= value <= 1e300):  # compared, not converted: NaN, inf and huge ints fail
            raise ValueError(f"{where}{key} must be {' or '.join(t.__name__ for t in types)}, not {str(value)[:60]}")
    return data


def load_report(path: str | os.PathLike[str]) -> Report:
    """Read a report written by :meth:`Report.write`, as data (within the read limits,
    docs/security.md), every key checked; :class:`~trainguard.errors.ConfigError` naming the file
    and the key otherwise."""
    fix = "it is not a report trainguard wrote, or it was edited; run the checks again to write one"
    try:
        data = _checked(read_json(Path(path), active_limits()), _REPORT_KEYS, "")
        data.pop("status", None)
        checks = [CheckResult(**_checked(c, _CHECK_KEYS, f"checks[{i}].")) for i, c in enumerate(data.pop("checks", []))]
        return Report(checks=checks, **data)
    except (OSError, ValueError, TypeError) as exc:  # Unreadable is a ValueError
        raise ConfigError(f"not a readable trainguard report ({exc}); {fix}", path=str(path)) from None
