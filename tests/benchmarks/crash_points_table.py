"""crash_points on every writer of the test jobs (and the digits example): launches, wall time,
CPU seconds of the processes it started, verdict and first unsafe boundary (issue 49).

    .venv/bin/python -m tests.benchmarks.crash_points_table [--only SUBSTRING ...] [--set KEY=VALUE ...]

One JSON line per row on stdout. ``--set`` adds keys to every row's ``crash_points`` (``infer=false``
explores every chosen boundary with a run of its own; ``lanes=1`` runs them one after the other). Run it from an old tree (``PYTHONPATH``) and
this one side by side to compare: the launch counts do not depend on the machine's load, the wall
times do.
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]


def _writer(writer: str, mode: str = "kill", **kw: Any) -> Callable[[Path, dict[str, Any]], Path]:
    def build(tmp: Path, extra: dict[str, Any]) -> Path:
        from tests.distributed.test_crash_points import writer_job

        path = writer_job(tmp, writer, mode, **kw)
        data = yaml.safe_load(path.read_text())
        data["checks"]["crash_points"].update(extra)
        path.write_text(yaml.safe_dump(data, sort_keys=False))
        return path
    return build


def _digits(limit: int) -> Callable[[Path, dict[str, Any]], Path]:
    def build(tmp: Path, extra: dict[str, Any]) -> Path:
        example = tmp / "digits"
        shutil.copytree(ROOT / "examples" / "digits", example, ignore=shutil.ignore_patterns(".trainguard", "tests"))
        data = yaml.safe_load((example / "trainguard.yaml").read_text())
        data = {"job": data["job"], "checks": {"crash_points": {"steps": 20, "after_step": 7,
                                                                "max_boundaries": limit, **extra}}}
        path = example / "trainguard.yaml"
        path.write_text(yaml.safe_dump(data, sort_keys=False))
        return path
    return build


ROWS: dict[str, Callable[[Path, dict[str, Any]], Path]] = {
    "atomic/kill": _writer("atomic"),
    "rename/kill": _writer("rename"),
    "sharded-marker/kill": _writer("sharded-marker", world=2),
    "pid/kill": _writer("pid", limit=2),
    "inplace/kill": _writer("inplace"),
    "unlink-first/kill": _writer("unlink-first"),
    "sharded-newest/kill": _writer("sharded-newest", limit=4, world=2),
    "megatron/kill": _writer("megatron", limit=5, steps=15),
    "last-save/kill": _writer("atomic", after=17, limit=3),
    "tracker-first/kill": _writer("tracker-first", after=17, limit=3),
    "atomic/power": _writer("atomic", "power"),
    "rename/power": _writer("rename", "power", limit=3),
    "rename/power-16": _writer("rename", "power"),
    "digits/kill": _digits(16),
    "digits/kill-1000": _digits(1000),
}


def _row(name: str, extra: dict[str, Any]) -> dict[str, Any]:
    from trainguard.session import check

    with tempfile.TemporaryDirectory(prefix="crash-bench-") as folder:
        path = ROWS[name](Path(folder), extra)
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        started = time.monotonic()
        report = check(path, only=["crash_points"])
        wall = time.monotonic() - started
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        (result,) = report.checks
        ev = result.to_dict()["evidence"]
        first = ev.get("first_unsafe") or {}
        return {"row": name, "status": result.status, "runs": ev.get("runs"), "found": ev.get("boundaries_found"),
                "explored": ev.get("boundaries_explored"), "inferred": ev.get("inferred"), "start": ev.get("start"),
                "lanes": ev.get("lanes"),
                "first_unsafe": first.get("boundary"), "first_outcome": first.get("outcome"),
                "outcomes": [(o.get("outcome"), o.get("resumed_from_step")) for o in ev.get("outcomes", [])],
                "wall_s": round(wall, 1), **({"summary": result.summary[:400]} if result.status == "error" else {}),
                "cpu_s": round(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime, 1)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", nargs="*", default=[])
    parser.add_argument("--set", nargs="*", default=[], help="KEY=VALUE added to crash_points (YAML values)")
    args = parser.parse_args(argv)
    extra = {k: yaml.safe_load(v) for k, v in (item.split("=", 1) for item in args.set)}
    for name in ROWS:
        if args.only and not any(s in name for s in args.only):
            continue
        print(json.dumps(_row(name, extra)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
