"""Which commit was promoted last: the promoted-report index of a gate directory.

Each time the gate promotes, :func:`record_promotion` rewrites ``promoted.json`` beside the
reports (atomically: temp file, fsync, rename) with the newest promoted report's commit, so
``checks.compat: {base: promoted}`` finds it whatever number of other reports came after it.
:func:`last_promoted` reads that index whole, as data, bounded and validated; without a usable
index (reports written before it existed, or an index that is not one) it scans every
``gate-*.json`` newest first and says that it did.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainguard._internal.atomic import atomic_write_text, os_error_text, warn
from trainguard._internal.readers import OverLimit, ReadLimits, Unreadable, active_limits, read_json

__all__ = ["INDEX_NAME", "Lookup", "Promotion", "last_promoted", "record_promotion"]

#: the index's file name in the gate directory (not a ``gate-*.json``: never read as a report)
INDEX_NAME = "promoted.json"
_INDEX_VERSION = 1
#: the index holds one entry: more than this is not an index trainguard wrote
_INDEX_LIMITS = ReadLimits(max_bytes=64 * 1024, seconds=10.0)
#: a gate report read by the scan: trainguard's own reports are far smaller
_REPORT_MAX_BYTES = 64 * 1024**2
_GATE_REPORT = re.compile(r"^gate-\d{8}-\d{6}\.json$")
#: a commit id: SHA-1 (40 hex digits) or SHA-256 (64) repositories
_COMMIT = re.compile(r"[0-9a-f]{40}|[0-9a-f]{64}")


def _is_commit_id(text: object) -> bool:
    """Whether ``text`` is a full commit id of a SHA-1 or a SHA-256 repository."""
    return isinstance(text, str) and _COMMIT.fullmatch(text) is not None


@dataclass(frozen=True)
class Promotion:
    """A promoted gate report: the commit it was made at, its file, when."""

    commit: str
    report: Path
    created_at: float


@dataclass(frozen=True)
class Lookup:
    """What :func:`last_promoted` found (``promotion`` None: nothing) and how, in words."""

    promotion: Promotion | None
    how: str


def record_promotion(gate_dir: Path, report: Path, commit: str | None, created_at: float) -> None:
    """Make ``report`` (a promoted gate report in ``gate_dir``, made at ``commit``) the index's
    newest promotion, unless the index already names a newer one. A failing write is said on
    stderr; :func:`last_promoted` then scans the reports."""
    if not _is_commit_id(commit) or report.parent != gate_dir or not _GATE_REPORT.match(report.name):
        return  # a report outside git, or written to a fallback place: nothing to index
    current = _read_index(gate_dir / INDEX_NAME)
    if isinstance(current, Promotion) and current.created_at > created_at:
        return
    entry = {"index_version": _INDEX_VERSION,
             "newest": {"git_commit": commit, "report": report.name, "created_at": created_at}}
    try:
        atomic_write_text(gate_dir / INDEX_NAME, json.dumps(entry, indent=2) + "\n")
    except OSError as exc:
        warn(f"cannot write the promoted-report index {gate_dir / INDEX_NAME}: {os_error_text(exc)}; "
             "`base: promoted` will scan the gate reports instead")


def last_promoted(gate_dir: Path) -> Lookup:
    """The newest promoted gate report under ``gate_dir`` that names a commit: from the index,
    else from a scan of the reports (newest first), with how it was found or why nothing was."""
    index = gate_dir / INDEX_NAME
    found = _read_index(index)
    if isinstance(found, Promotion):
        return Lookup(found, f"{found.report}, named by the promoted-report index {index}")
    why = found if found is not None else f"no promoted-report index {index} (reports of an older trainguard)"
    return _scan(gate_dir, why)


def _read_index(path: Path) -> Promotion | str | None:
    """The index's promotion; the reason it is unusable; None when there is none."""
    if not os.path.lexists(path):
        return None
    try:
        data = read_json(path, _INDEX_LIMITS)
    except OverLimit:
        return f"the promoted-report index {path} is unusable (over {_INDEX_LIMITS.max_bytes // 1024} KiB: not one trainguard wrote)"
    except (Unreadable, OSError) as exc:
        return f"the promoted-report index {path} is unusable ({exc})"
    newest = data.get("newest") if isinstance(data, dict) else None
    if not isinstance(data, dict) or data.get("index_version") != _INDEX_VERSION or not isinstance(newest, dict):
        return f"the promoted-report index {path} is unusable (not an index of version {_INDEX_VERSION})"
    commit, report, created = newest.get("git_commit"), newest.get("report"), newest.get("created_at")
    if not _is_commit_id(commit):
        return f"the promoted-report index {path} is unusable (git_commit is not a commit id)"
    if not isinstance(report, str) or not _GATE_REPORT.match(report):
        return f"the promoted-report index {path} is unusable (report is not a gate report's name)"
    if _time(created) <= 0:
        return f"the promoted-report index {path} is unusable (created_at is not a time)"
    return Promotion(str(commit), path.parent / report, _time(created))


def _scan(gate_dir: Path, why: str) -> Lookup:
    try:
        names = sorted((e.name for e in os.scandir(gate_dir) if _GATE_REPORT.match(e.name)), reverse=True)
    except OSError:
        names = []
    limits = ReadLimits(max_bytes=min(active_limits().max_bytes, _REPORT_MAX_BYTES),
                        max_files=active_limits().max_files, seconds=active_limits().seconds)
    skipped = 0
    for i, name in enumerate(names, 1):
        try:
            data = read_json(gate_dir / name, limits)
        except (Unreadable, OSError):  # an OverLimit is an Unreadable: counted, said
            skipped += 1
            continue
        found = _promotion_in(data, gate_dir / name)
        if found is not None:
            return Lookup(found, f"{found.report}, found by scanning {i} gate report(s) newest first: {why}")
    unread = f", {skipped} of them unreadable or over {limits.max_bytes // 1024**2} MiB" if skipped else ""
    return Lookup(None, f"no promoted gate report with a git commit under {gate_dir} ({why}; scanned "
                        f"{len(names)} gate report(s){unread})")


def _promotion_in(data: Any, path: Path) -> Promotion | None:
    if not isinstance(data, dict):
        return None
    decision, provenance = data.get("decision"), data.get("provenance")
    if not (isinstance(decision, dict) and decision.get("verdict") == "promote" and isinstance(provenance, dict)):
        return None
    commit = provenance.get("git_commit")
    return Promotion(str(commit), path, _time(provenance.get("created_at"))) if _is_commit_id(commit) else None


def _time(value: Any) -> float:
    """A report's creation time; 0 when it is not one (a huge integer, NaN, text)."""
    try:
        when = float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else 0.0
    except OverflowError:
        return 0.0
    return when if math.isfinite(when) else 0.0

