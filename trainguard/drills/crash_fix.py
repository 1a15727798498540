"""The fix ``checks.crash_points`` names for the first unsafe boundary of a save, from what that
boundary did (docs/crash-points.md: "Resume and judge")."""

from __future__ import annotations

from typing import Any

from trainguard.drills.crash_records import Boundary, BoundaryOutcome

__all__ = ["fix_for", "top_folder"]


def top_folder(path: Any) -> str:
    """The first component of a path under the mount (``/step_000010/x.distcp``: ``step_000010``)."""
    return str(path).strip("/").split("/", 1)[0]


def _unsynced(found: list[Boundary]) -> tuple[list[str], list[str]]:
    """Files renamed with data never fsynced before the rename; renames whose destination's
    directory was not fsynced after them."""
    data, entries = [], []
    for i, b in enumerate(found):
        if b.op != "rename":
            continue
        if not any(o.op in ("fsync", "fdatasync") and o.path == b.path for o in found[:i]):
            data.append(b.path)
        folder = (b.to or "/").rsplit("/", 1)[0] or "/"
        if not any(o.op == "fsyncdir" and (o.path.rstrip("/") or "/") == folder for o in found[i + 1:]):
            entries.append(b.to or b.path)
    return data, entries


def fix_for(boundary: Boundary, row: BoundaryOutcome, renamed: set[str], mode: str, found: list[Boundary]) -> str:
    """The fix for the first unsafe boundary, from what it did."""
    outcome = row.outcome
    if row.ranks_resumed_from:
        return ("commit a save of many ranks as one: once every rank's files are in place, write a "
                "marker (rank 0, after a barrier) and resume only from the newest save that has it")
    if mode == "power":
        data, entries = _unsynced(found)
        fixes = []
        if data:
            fixes.append(f"fsync {', '.join(data[:2])} before renaming it (os.fsync on the open file): a power "
                         "loss drops data never synced, and the rename publishes an empty or short file")
        if entries:
            fixes.append(f"fsync the directory after renaming into {', '.join(entries[:2])} (os.open the "
                         "directory, os.fsync): until then a power loss forgets the rename")
        if fixes:
            return "; ".join(fixes)
    folder = top_folder(boundary.path)
    if (boundary.op == "mkdir" or "/" in boundary.path.strip("/")) and not any(
            b.op == "rename" and (b.path.strip("/") == folder or (b.to or "").strip("/") == folder) for b in found):
        return (f"build /{folder} under a temporary name and rename it into place once every file in it is "
                "complete (or write a completion marker last and resume only from a folder that has it): "
                "a restart took the half-written folder for the newest checkpoint")
    if boundary.op in ("create", "write", "truncate") and boundary.path not in renamed:
        return ("write the checkpoint to a temporary file in the same directory and rename it over "
                "the old one (os.replace) once it is complete: the save overwrote it in place")
    if boundary.op == "unlink":
        return "delete the previous checkpoint only after the new one is complete and renamed into place"
    if outcome == "began again":
        return "keep the previous checkpoint until the new one is complete"
    return ("make the checkpoint complete before anything points at it: write, fsync, then rename "
            "(or write its completion marker last)")
