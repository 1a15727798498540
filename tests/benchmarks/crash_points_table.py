"""crash_points on every writer of the test jobs, the digits example and the public jobs (nanoGPT
unmodified, the Hugging Face Trainer, Lightning, the FSDP2 example's sync and async saves):
launches, wall time, CPU seconds of the processes it started, verdict and first unsafe boundary
(issue 49).

    .venv/bin/python -m tests.benchmarks.crash_points_table [--only SUBSTRING ...] [--set KEY=VALUE ...]

One JSON line per row on stdout. ``--set`` adds keys to every row's ``crash_points`` (``infer=false``
explores every chosen boundary with a run of its own; ``lanes=1`` runs them one after the other). The public rows need the extras (``hf``,
``lightning``, ``fsdp``) and the nanoGPT mirror (``TRAINGUARD_NANOGPT_MIRROR``); the writer rows and
the FSDP2 rows need FUSE.

Old against new: an older tree (``git archive OLD | tar -x -C /tmp/old``) gets a copy of this file
at the same place and runs it from its own root with itself first on the path, so that the
checks, the job helpers and the processes they start all come from it (``PYTHONPATH`` wins over
the venv's editable install):

    cp tests/benchmarks/crash_points_table.py /tmp/old/tests/benchmarks/
    cd /tmp/old && TRAINGUARD_TRACKING=off PYTHONPATH=/tmp/old $VENV/bin/python -m tests.benchmarks.crash_points_table

The rows build their jobs with the helpers both trees have (``writer_job``, ``example_copy``,
``nanogpt_job``); the launch counts do not depend on the machine's load, the wall times do: run
each row old then new, one after the other.
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


def _settings(extra: dict[str, Any], **settings: Any) -> str:
    """The ``checks:`` body of a job file: crash_points with ``settings`` and ``extra`` (JSON is
    YAML's flow style)."""
    return f"  crash_points: {json.dumps({**settings, **extra})}\n"


def _nanogpt(tmp: Path, extra: dict[str, Any]) -> Path:
    """karpathy/nanoGPT unmodified (tests/benchmarks/cause_table.py), tiny settings, resumed
    with ``--init_from=resume`` as ``trainguard init`` writes it."""
    from tests.benchmarks.cause_table import nanogpt_job

    path = nanogpt_job(tmp)
    path.write_text(path.read_text().split("checks:\n")[0] + "checks:\n"
                    + _settings(extra, steps=20, after_step=7))
    return path


def _hf(tmp: Path, extra: dict[str, Any]) -> Path:
    from tests.distributed.test_hf_example import example_copy

    return example_copy(tmp, _settings(extra, steps=20, after_step=7))


# run_clm.py's resume: the newest checkpoint-N folder under --output_dir, whatever it holds
# (transformers' get_last_checkpoint), as a wrapper of the example's train.py (unchanged)
RESUME_LAST = """\
import runpy, sys
from transformers.trainer_utils import get_last_checkpoint
args = sys.argv[1:]
if "--resume-last" in args:
    args.remove("--resume-last")
    last = get_last_checkpoint(args[args.index("--output_dir") + 1])
    args += ["--resume_from_checkpoint", last] if last else []
sys.argv = ["train.py", *args]
runpy.run_path("train.py", run_name="__main__")
"""


def _hf_last(tmp: Path, extra: dict[str, Any]) -> Path:
    root = _hf(tmp, extra)
    (root / "resume_last.py").write_text(RESUME_LAST)
    job = root / "trainguard.yaml"
    text = job.read_text()
    assert text.count("python train.py") == 1 and text.count("--resume_from_checkpoint {latest_checkpoint}") == 1, job
    job.write_text(text.replace("python train.py", "python resume_last.py").replace(
        "--resume_from_checkpoint {latest_checkpoint}", "--resume-last"))
    return root


def _lightning(tmp: Path, extra: dict[str, Any]) -> Path:
    from tests.distributed.test_lightning_example import example_copy

    return example_copy(tmp, _settings(extra, steps=20, after_step=7), args=" --resumable-data")


def _fsdp2(limit: int, *args: str) -> Callable[[Path, dict[str, Any]], Path]:
    def build(tmp: Path, extra: dict[str, Any]) -> Path:
        from tests.distributed.test_fsdp2_checks import example_copy

        more = {"args": list(args)} if args else {}
        return example_copy(tmp, [], _settings(extra, steps=20, after_step=7, max_boundaries=limit, **more))
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
    "nanogpt/kill": _nanogpt,
    "hf-trainer/kill": _hf,
    "hf-trainer-last/kill": _hf_last,
    "lightning/kill": _lightning,
    "fsdp2-sync/kill": _fsdp2(8),
    "fsdp2-async/kill": _fsdp2(16, "--async-save"),
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
    parser.add_argument("--only", nargs="*", default=[], help="rows whose name holds one of these (exactly, with =NAME)")
    parser.add_argument("--set", nargs="*", default=[], help="KEY=VALUE added to crash_points (YAML values)")
    args = parser.parse_args(argv)
    extra = {k: yaml.safe_load(v) for k, v in (item.split("=", 1) for item in args.set)}
    for name in ROWS:
        if args.only and not any(name == s[1:] if s.startswith("=") else s in name for s in args.only):
            continue
        print(json.dumps(_row(name, extra)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
