"""What a gate report was made from, and whether it still describes the job.

A promoted report is only a licence to submit the job it checked. :func:`provenance_for`
records the job file's sha256, the job repository's git commit and dirty state, the trainguard
version and the time; :func:`staleness` compares that record with the job as it is now and
returns every reason the report no longer applies (empty: fresh).
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from trainguard._internal.gitstate import file_sha256, git_state
from trainguard._version import __version__

__all__ = ["Provenance", "provenance_for", "staleness"]


@dataclass(frozen=True)
class Provenance:
    """The record a gate report carries (``report["provenance"]``)."""

    job_file: str
    job_file_sha256: str
    #: None when the job is not in a git repository (or git is missing)
    git_commit: str | None
    git_dirty: bool | None
    trainguard_version: str
    created_at: float
    #: fingerprint of the uncommitted changes when ``git_dirty``
    git_changes_sha256: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Provenance:
        """Read a record back; a missing or mistyped field raises ``ValueError`` naming it."""
        fields = {
            "job_file": str,
            "job_file_sha256": str,
            "git_commit": (str, type(None)),
            "git_dirty": (bool, type(None)),
            "trainguard_version": str,
            "created_at": (int, float),
        }
        optional = {"git_changes_sha256": (str, type(None))}
        missing = [k for k in fields if k not in data]
        if missing:
            raise ValueError(f"provenance record lacks {', '.join(missing)}")
        for key, kind in fields.items():
            if not isinstance(data[key], kind):  # type: ignore[arg-type]
                raise ValueError(f"provenance.{key} has the wrong type: {data[key]!r}")
        for key, kind in optional.items():
            if not isinstance(data.get(key), kind):  # type: ignore[arg-type]
                raise ValueError(f"provenance.{key} has the wrong type: {data[key]!r}")
        return cls(
            job_file=data["job_file"],
            job_file_sha256=data["job_file_sha256"],
            git_commit=data["git_commit"],
            git_dirty=data["git_dirty"],
            trainguard_version=data["trainguard_version"],
            created_at=float(data["created_at"]),
            git_changes_sha256=data.get("git_changes_sha256"),
        )


def provenance_for(job_file: str | os.PathLike[str], *, now: float | None = None) -> Provenance:
    """The record for a report about ``job_file`` made now."""
    path = Path(job_file).resolve()
    git = git_state(path.parent)
    return Provenance(
        job_file=str(path),
        job_file_sha256=file_sha256(path),
        git_commit=git.commit,
        git_dirty=git.dirty,
        git_changes_sha256=git.changes_sha256,
        trainguard_version=__version__,
        created_at=time.time() if now is None else now,
    )


def staleness(
    record: Provenance | dict[str, Any],
    job_file: str | os.PathLike[str],
    max_age: float | None,
    *,
    now: float | None = None,
) -> list[str]:
    """Every reason the report with ``record`` no longer applies to ``job_file``; [] if fresh.

    Checked: the job file's content (sha256), the repository's commit, its dirty state and
    (when dirty) the fingerprint of the uncommitted changes, the trainguard version, and the age
    against ``max_age`` seconds (None: no limit).
    """
    if isinstance(record, dict):
        try:
            record = Provenance.from_dict(record)
        except ValueError as exc:
            return [f"the report's provenance is unusable ({exc}); run the gate again"]
    now = time.time() if now is None else now
    current = provenance_for(job_file, now=now)
    reasons: list[str] = []
    path = current.job_file
    if current.job_file_sha256 != record.job_file_sha256:
        reasons.append(
            f"job file changed: {path} has sha256 {current.job_file_sha256[:12]}, the report "
            f"was made from {record.job_file_sha256[:12]}"
        )
    if current.git_commit != record.git_commit:
        reasons.append(
            f"git commit changed: the job repository is at {_short(current.git_commit)}, the "
            f"report was made at {_short(record.git_commit)}"
        )
    if current.git_dirty != record.git_dirty:
        reasons.append(
            f"git dirty state changed: the working tree is {_dirty(current.git_dirty)} now, "
            f"it was {_dirty(record.git_dirty)} when the report was made"
        )
    elif current.git_dirty and current.git_changes_sha256 != record.git_changes_sha256:
        reasons.append(
            "uncommitted changes differ: the working tree was dirty when the report was made "
            "and has other uncommitted changes now"
        )
    if current.trainguard_version != record.trainguard_version:
        reasons.append(
            f"trainguard version changed: {record.trainguard_version} made the report, "
            f"{current.trainguard_version} is installed"
        )
    age = now - record.created_at
    if max_age is not None and age > max_age:
        reasons.append(
            f"the report is {_duration(age)} old, over gate.max_report_age ({_duration(max_age)})"
        )
    elif age < -60:
        reasons.append(f"the report's creation time is {_duration(-age)} in the future")
    return reasons


def _dirty(value: bool | None) -> str:
    return {True: "dirty", False: "clean", None: "not in git"}[value]


def _short(commit: str | None) -> str:
    return commit[:12] if commit else "no git commit"


def _duration(seconds: float) -> str:
    seconds = abs(seconds)
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    if seconds < 172800:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} d"
